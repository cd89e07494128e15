"""Per-device memory plan of a model on a mesh, on paper (AbstractMesh + nnx.eval_shape).

Weights and caches are exact: every leaf's shape divided as its sharding says. Activations
are an analytic estimate of the largest live intermediates of *this* implementation for one
prefill chunk at the end of the context (keys = the whole context), per layer kind; the peak
is the residual stream plus the largest layer. `k31jax plan` prints the table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..nn import CACHE_AXES, MLAMixer, abstract_model
from ..ops import exchange_rounds, make_ep_plan
from ..quant import MXFP4Weight
from ..sharding import (Rules, abstract_mesh, get_rules, logical_to_spec, mesh_str, parse_mesh,
                        rules_for_mesh, rules_name, shard_factor)
from ._placement import abstract_cache

GB = 1e9
# name -> (label, HBM bytes)
DEVICES: dict[str, tuple[str, float]] = {
    "b300": ("NVIDIA B300", 288 * GB), "b200": ("NVIDIA B200", 192 * GB), "h200": ("NVIDIA H200", 141 * GB),
    "h100": ("NVIDIA H100", 80 * GB), "v5p": ("TPU v5p", 95 * GB), "v6e": ("TPU v6e", 32 * GB),
}
_ROUTED = ("w_gate", "w_up", "w_down")
_MASK_PATH_MAX = MLAMixer.mask_path_max_elements
_INDEX_KEY_BLOCK = MLAMixer.index_key_block


@functools.lru_cache(maxsize=8)
def _param_leaves(cfg: ModelConfig) -> tuple:
    """(path, shape, dtype, logical names) of every parameter: evaluated once per config."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    out = []
    for path, v in nnx.to_flat_state(state):
        val = v.get_value()
        names = v.get_metadata().get("out_sharding") or (None,) * len(val.shape)
        out.append((tuple(map(str, path)), tuple(val.shape), jnp.dtype(val.dtype), tuple(names)))
    return tuple(out)


def _shard_bytes(shape, dtype, spec, mesh_shape) -> int:
    n = 1
    for d, size in enumerate(shape):
        entry = spec[d] if d < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        n *= -(-size // math.prod(mesh_shape[a] for a in axes))
    return n * jnp.dtype(dtype).itemsize


def weight_bytes(cfg: ModelConfig, mesh_shape: Mapping[str, int], rules: Rules) -> dict[str, int]:
    """Per-device bytes: routed experts, everything else, and the largest replicated leaf."""
    out = {"experts": 0, "rest": 0, "total_experts": 0, "total_rest": 0}
    for path, shape, dtype, names in _param_leaves(cfg):
        spec = logical_to_spec(names, shape, mesh_shape, rules)
        key = "experts" if path[0] == "moe" and path[1] in _ROUTED else "rest"
        out[key] += _shard_bytes(shape, dtype, spec, mesh_shape)
        out["total_" + key] += int(np.prod(shape)) * dtype.itemsize
    return out


def cache_bytes(cfg: ModelConfig, batch: int, context: int, mesh_shape, rules, dtype=None) -> dict[str, int]:
    cache = abstract_cache(cfg, batch, context, dtype)
    out = {}
    for name, axes in CACHE_AXES.items():
        leaf = getattr(cache, name)
        if leaf is None:
            out[name] = 0
            continue
        spec = logical_to_spec(axes, leaf.shape, mesh_shape, rules)
        out[name] = _shard_bytes(leaf.shape, leaf.dtype, spec, mesh_shape)
    return out


def _factor(name: str, size: int, mesh_shape, rules) -> int:
    return shard_factor(logical_to_spec((name,), (size,), mesh_shape, rules), mesh_shape)


def activation_bytes(cfg: ModelConfig, batch: int, context: int, chunk: int, mesh_shape, rules) -> dict[str, int]:
    """Largest live intermediates per layer kind for one prefill chunk of `chunk` tokens
    attending to `context` keys (estimates, per device)."""
    act = jnp.dtype(cfg.dtype).itemsize
    f32 = 4
    b = batch / _factor("batch", batch, mesh_shape, rules)
    t, s, d = chunk, context, cfg.hidden_size
    out: dict[str, int] = {}
    out["residual stream"] = int(5 * b * t * d * act)
    if cfg.use_attn_res:
        n = cfg.num_attn_res_slots
        out["attn_res"] = int(b * t * n * d * act + 2 * b * t * (n + 1) * d * f32)
    if cfg.kda_layers:
        h = cfg.kda_num_heads
        h_loc = h / _factor("act_heads", h, mesh_shape, rules)
        c_loc = h_loc * cfg.kda_head_dim
        out["KDA layer"] = int(b * t * c_loc * (4 * act + 12 * f32) + 3 * b * h_loc * t * cfg.kda_chunk_size * f32)
    if cfg.mla_layers:
        h = cfg.num_attention_heads
        tp_h = _factor("act_heads", h, mesh_shape, rules)
        f_seq = _factor("cache_seq", s, mesh_shape, rules)
        h_loc, s_loc = h / tp_h, s / f_seq
        per_logit = b * h / max(tp_h, f_seq) * t
        r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        m = b * t * h_loc * (cfg.qk_head_dim + cfg.v_head_dim) * f32 * 3  # q, o and the gate
        if cfg.use_indexer and cfg.index_topk < s:
            k = cfg.index_topk
            hi_loc = cfg.index_n_heads / _factor("index_heads", cfg.index_n_heads * cfg.index_head_dim,
                                                 mesh_shape, rules)
            s_blk = min(s, _INDEX_KEY_BLOCK) if t > 1 else s  # prefill streams the keys in blocks
            m += 2 * b * t * hi_loc * s_blk * f32 + 2 * b * t * (s_blk + k) * f32  # index dots + ReLU, scores
            if t * s > _MASK_PATH_MAX:
                # the gathered rows stay in the cache's dtype: the float32 convert is fused into
                # the dots that read them (the TPU compiler's buffers, `k31jax compile`)
                m += b * t * k * (r + dr) * act + 2 * per_logit * k * f32
            else:
                m += b * s_loc * h_loc * (cfg.qk_nope_head_dim + cfg.v_head_dim) * act
                m += 2 * per_logit * s * f32 + b * t * s * 5
        else:
            m += b * s_loc * h_loc * (cfg.qk_nope_head_dim + cfg.v_head_dim) * act
            m += 2 * per_logit * s * f32 + b * t * s
        out["MLA layer"] = int(m)
    if cfg.moe_layers:
        out["MoE layer"] = int(_moe_bytes(cfg, batch, chunk, mesh_shape, rules, b, act, f32))
    if cfg.dense_layers:
        i_loc = cfg.intermediate_size / _factor("mlp", cfg.intermediate_size, mesh_shape, rules)
        out["dense FFN layer"] = int(b * t * i_loc * (3 * act + 2 * f32))
    v_loc = cfg.vocab_size / _factor("act_vocab", cfg.vocab_size, mesh_shape, rules)
    out["logits"] = int(b * t * v_loc * f32)
    return out


def _moe_bytes(cfg, batch, chunk, mesh_shape, rules, b, act, f32):
    e, i, ell, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_in_dim, cfg.num_experts_per_token
    sds = jax.ShapeDtypeStruct
    if cfg.expert_weights == "mxfp4":
        up = MXFP4Weight(sds((e, i, ell // 2), jnp.uint8), sds((e, i, ell // 32), jnp.uint8))
        down = MXFP4Weight(sds((e, ell, i // 2), jnp.uint8), sds((e, ell, i // 32), jnp.uint8))
    else:
        up, down = sds((e, i, ell), jnp.bfloat16), sds((e, ell, i), jnp.bfloat16)
    n = batch * chunk
    plan = make_ep_plan(n, (up, up, down), exchange="dense", mesh=abstract_mesh(mesh_shape), rules=rules)
    if plan is None:
        p, tp, n_loc, e_loc = 1, 1, b * chunk, e
    else:
        p, tp = plan.ep_size, plan.tp_size
        n_loc = n / plan.token_shards
        e_loc = e // p
    # one exchange round's buffers at a time (`exchange_rounds`; decode and prefill chunks are one)
    a = n_loc * k / (exchange_rounds(int(n_loc), k, p, ell) if plan is not None else 1)
    cap = p * a
    i_loc = i / tp
    m = cap * ell * act * 2 + cap * 4 * 3                       # received + sorted rows, ids
    m += cap * i_loc * (3 * act + 2 * f32)                       # gate, up, h (+ fp32 islands)
    m += cap * ell * f32 + a * ell * (act + 2 * f32)             # y, returned rows, combine
    if cfg.expert_weights == "mxfp4":
        # decoded experts: few assignments take the "selected" form off CPU, one expert at a
        # time (what the TPU compiler shows, `k31jax compile`); otherwise every local one
        selected = n * k < e
        m += (1 if selected else e_loc) * 3 * i_loc * ell * act
    tp_sh = _factor("mlp", max(cfg.shared_intermediate_size, 1), mesh_shape, rules)
    m += 3 * b * chunk * cfg.shared_intermediate_size / tp_sh * act
    m += b * chunk * (e * f32 + 2 * ell * act)                   # router scores, latent in/out
    return m


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    config_name: str
    mesh: dict[str, int]
    rules_name: str
    batch: int
    context: int
    chunk: int
    prefill_batch: int
    expert_format: str
    weights: dict[str, int]
    weights_other_format: dict[str, int]
    cache: dict[str, int]
    activations: dict[str, int]

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def weight_total(self) -> int:
        return self.weights["experts"] + self.weights["rest"]

    @property
    def cache_total(self) -> int:
        return sum(self.cache.values())

    @property
    def attn_res(self) -> int:
        return self.activations.get("attn_res", 0)

    @property
    def peak_activations(self) -> int:
        layers = {k: v for k, v in self.activations.items() if k not in ("residual stream", "attn_res")}
        return self.activations["residual stream"] + max(layers.values(), default=0)

    @property
    def peak_layer(self) -> str:
        layers = {k: v for k, v in self.activations.items() if k not in ("residual stream", "attn_res")}
        return max(layers, key=layers.get) if layers else ""

    @property
    def total(self) -> int:
        return self.weight_total + self.cache_total + self.attn_res + self.peak_activations

    def fits(self, device: str, usable: float = 0.9) -> bool:
        return self.total <= DEVICES[device][1] * usable

    def table(self, device: str | None = None, usable: float = 0.9) -> str:
        other = "bf16" if self.expert_format == "mxfp4" else "MXFP4 packed"
        fmt = "MXFP4 packed" if self.expert_format == "mxfp4" else "bf16"
        c = self.cache
        rows = [
            (f"weights: routed experts ({fmt})", self.weights["experts"]),
            ("weights: everything else (bf16 + f32)", self.weights["rest"]),
            (f"  (routed experts as {other} instead)", self.weights_other_format["experts"]),
            ("MLA latent cache (c_kv + k_pe)", c["mla_ckv"] + c["mla_kpe"]),
            ("indexer key cache", c["index_keys"]),
            ("KDA recurrent state (fp32)", c["kda_state"]),
            ("KDA conv state (fp32)", c["kda_conv"]),
            ("cache validity mask", c["key_valid"] + c["pos"]),
            (f"AttnRes block state (prefill chunk {self.chunk})", self.attn_res),
            (f"peak activations (prefill chunk {self.chunk}; {self.peak_layer})", self.peak_activations),
        ]
        head = (f"{self.config_name} on {mesh_str(self.mesh)} ({self.devices} devices, rules {self.rules_name}), "
                f"batch {self.batch}, context {self.context:,}, prefill chunk {self.chunk} x {self.prefill_batch} "
                f"sequence{'s' if self.prefill_batch > 1 else ''}")
        w = max(len(r[0]) for r in rows) + 2
        lines = [head, f"{'per device':<{w}}{'bytes':>18}{'GB':>10}"]
        for label, n in rows:
            lines.append(f"{label:<{w}}{n:>18,}{n / GB:>10.2f}")
        lines.append(f"{'total':<{w}}{self.total:>18,}{self.total / GB:>10.2f}")
        lines.append("")
        lines.append(f"{'device':<22}{'HBM GB':>8}{'usable GB':>11}  fits")
        for name, (label, cap) in DEVICES.items():
            mark = "yes" if self.fits(name, usable) else "no"
            star = "  <-" if name == device else ""
            lines.append(f"{label + ' (' + name + ')':<22}{cap / GB:>8.0f}{cap * usable / GB:>11.1f}  {mark}{star}")
        return "\n".join(lines)


def plan_memory(
    config: ModelConfig | str,
    mesh: str | Mapping[str, int],
    *,
    batch: int = 1,
    context: int = 4096,
    chunk: int = 512,
    prefill_batch: int | None = None,
    rules: Rules | str | None = None,
    cache_dtype=None,
) -> MemoryPlan:
    """The per-device memory plan of `config` on `mesh` (no allocation): caches for `batch`
    sequences of `context` tokens, activations for a prefill chunk of `chunk` tokens of
    `prefill_batch` sequences (default: all `batch`) at the end of the context."""
    prefill_batch = batch if prefill_batch is None else prefill_batch
    name = config if isinstance(config, str) else "model"
    cfg = ModelConfig.preset(config) if isinstance(config, str) else config
    shape = parse_mesh(mesh)
    rules = get_rules(rules) or rules_for_mesh(shape)
    alt = cfg.replace(expert_weights="bf16" if cfg.expert_weights == "mxfp4" else "mxfp4") if cfg.moe_layers else cfg
    return MemoryPlan(
        name, shape, rules_name(rules), batch, context, chunk, prefill_batch, cfg.expert_weights,
        weight_bytes(cfg, shape, rules), weight_bytes(alt, shape, rules),
        cache_bytes(cfg, batch, context, shape, rules, cache_dtype),
        activation_bytes(cfg, prefill_batch, context, chunk, shape, rules))


def candidate_meshes(max_devices: int = 1024, max_tensor: int = 8, max_expert: int = 128):
    """(mesh, rules) layouts in order of device count (powers of two): one node with experts
    over `tensor` (tensor <= 8), expert x tensor, and fsdp x expert x tensor."""
    n = 1
    while n <= max_devices:
        if n <= max_tensor:
            yield {"tensor": n}, ("ep_in_tp" if n > 1 else "tp")
        t = min(n, max_tensor)
        while t >= 1:
            e = 1
            while e * t <= n and e <= max_expert:
                f = n // (e * t)
                if f == 1 and e > 1:
                    yield {"expert": e, "tensor": t}, "ep_tp"
                elif f > 1:
                    yield {"fsdp": f, "expert": e, "tensor": t}, "fsdp_ep_tp"
                e *= 2
            t //= 2
        n *= 2


_RULE_PREFERENCE = {"tp": 0, "ep_in_tp": 0, "ep_tp": 1, "fsdp_ep_tp": 2}


def _preference(p: MemoryPlan):
    # FSDP gathers weights every layer: use it only when no EP layout of that size fits.
    return (_RULE_PREFERENCE.get(p.rules_name, 3), p.total)


def suggest_mesh(config: ModelConfig | str, device: str, *, batch: int = 1, context: int = 4096,
                 chunk: int = 512, prefill_batch: int | None = None, usable: float = 0.9,
                 max_devices: int = 1024) -> MemoryPlan | None:
    """The smallest candidate mesh that fits `device`: fewest devices, then EP layouts before
    FSDP ones (which all-gather weights every layer), then least memory."""
    cfg = ModelConfig.preset(config) if isinstance(config, str) else config
    best = None
    for mesh, rules in candidate_meshes(max_devices):
        if best is not None and math.prod(parse_mesh(mesh).values()) > best.devices:
            break
        if cfg.num_experts and cfg.num_experts % mesh.get("expert", 1):
            continue
        p = plan_memory(cfg, mesh, batch=batch, context=context, chunk=chunk, prefill_batch=prefill_batch,
                        rules=rules)
        p = dataclasses.replace(p, config_name=config if isinstance(config, str) else "model")
        if p.fits(device, usable) and (best is None or _preference(p) < _preference(best)):
            best = p
    return best
