"""Per-device memory of one QAT or LoRA fine-tuning step on a mesh, on paper (`k31jax plan --train`).

What `k31jax.train` holds per device during `train_step`, term by term:

- **master weights**: every parameter in the master dtype (the training form: routed experts
  as float master weights, not MXFP4-packed; float32 leaves such as the KDA convs, `A_log`,
  `dt_bias` and the router bias stay float32), split as the rule table splits them. Exact.
- **gradients**: `train_step` differentiates only the trained leaves (the trainer splits the
  parameters into the frozen rest and the trained sub-tree), so gradients exist for what
  `trainable` selects alone. Exact. With `grad_accum > 1` the scan over micro-batches also
  carries an accumulator of the same size.
- **optimizer state** (the `multi_transform` of `k31jax.train.make_optimizer`): AdamW keeps
  two moments per trained leaf in the leaf's dtype (optax's `mu_dtype=None`); Muon one
  momentum per Muon matrix and AdamW moments for the other trained leaves; frozen leaves
  (`set_to_zero`) and the router bias (never trained by gradient) keep nothing. Plus the
  optax step counters. Exact; the labels mirror `k31jax.train.param_labels` (checked in
  tests/distributed/test_plan_train.py).
- **activations** for one micro-batch of `micro_batch` rows x `seq_len` tokens: an analytic
  estimate of the values JAX saves for the backward pass (`jax.ad_checkpoint` residuals) of
  this implementation's XLA paths (what a multi-device mesh runs), derived from the code:
    * every layer's kinds are static (`k31jax.nn.layer_groups`: repeated groups are scanned,
      the rest unrolled), so a layer saves its own mixer's and FFN's residuals only;
    * the chunked KDA op's residuals come from JAX's own trace of `kda_chunked` at one row
      and one head (abstract shapes, nothing allocated), scaled by the local rows and heads:
      its sub-chunk tiling (kda.md §6b) makes a hand count fragile;
    * remat "none": every layer's intermediates, plus the per-layer weight slices its matmuls
      read back and the QAT fake-quantised expert copies, for all layers;
    * "dots": each layer's input carry (partial sum + AttnRes block buffer) and the outputs of
      its plain matmuls; the rest of one layer is recomputed during the backward pass;
    * "full": only each layer's input carry; one layer is recomputed at a time;
    * the chunked loss's working set (one `[N, vocab_chunk]` fp32 logits block and its
      gradient, assumed unsplit) comes before the layer backward, the optimizer update (one
      leaf's update buffer at a time) after it: the total takes the largest phase.
  Per device: the batch divides by the mesh axes the `batch` rule gives it, heads and
  intermediates by `tensor`, experts and their dispatch buffers by the expert-parallel plan
  (`k31jax.ops.make_ep_plan`, worst-case receive capacity, one exchange round at a time when
  `k31jax.ops.exchange_rounds` splits a device's tokens). The KDA and attention internals
  are counted in fp32 (their XLA paths compute there), the rest in the master dtype, which is
  also the compute dtype of a training run. tests/distributed/test_plan_train.py checks the saved terms
  within 5% of `saved_residuals` of a small model (and of one expert-parallel MoE layer on
  a CPU mesh). XLA's own fusion and buffer reuse are not modelled: read the activations as
  the saved-residual footprint, not a profiler's peak.

A **LoRA step** (`lora_rank` > 0, `k31jax train --lora-rank`) holds instead:
- the frozen base as the step takes it: packed MXFP4 experts stay packed (and with adapters
  beside the routed experts, their slots), everything else in the master dtype. Exact.
- the fp32 adapters, their gradients and AdamW moments (`lora_bytes`), split as
  `k31jax.train.lora_shardings` places them: each factor along its weight's axes. Exact
  (checked against the arguments of the trainer's abstract step).
- the activations of the same forward pass (the packed experts decoded one layer at a time
  where QAT fake-quantises them: the same bytes), plus what `apply_lora` makes before the
  layers run: a merged copy `W + A B` of every adapted weight, every layer, live through the
  backward pass, and its cotangent of the same size, accumulated by the layer scan's backward
  and turned into the factors' gradients after it. The merged copies are checked against
  JAX's saved residuals; the cotangents only against the compiler (benchmarks/RESULTS.md
  "## compile").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..nn import REMAT_POLICIES, MLAMixer
from ..ops import exchange_rounds, kda_chunked, make_ep_plan
from ..sharding import (Rules, abstract_mesh, get_rules, logical_to_spec, mesh_str, parse_mesh, rules_for_mesh,
                        rules_name)
from ._plan import (_RULE_PREFERENCE, DEVICES, GB, _factor, _param_leaves, _shard_bytes,
                    candidate_meshes)

# Which leaves each trainable set trains, by the leaf's path ("moe/w_up/packed", "mla/indexer/wk",
# ...): the trainer's optimizer labels (`k31jax.train`) and this planner read the same table.
_ROUTED_EXPERTS = re.compile(r"moe/w_(gate|up|down)(/(packed|scale))?")
_TRAINED = {
    "all": lambda path: True,
    "experts": lambda path: _ROUTED_EXPERTS.fullmatch(path) is not None,
    "indexer": lambda path: re.fullmatch(r"mla/indexer/.*", path) is not None,
    "no_embed": lambda path: re.fullmatch(r"embed|lm_head", path) is None,
}
TRAINABLE_SETS = tuple(_TRAINED)


# The weights a LoRA run adapts (regexes matched in full against parameter paths): KDA q/k/v/o,
# MLA q (q_a/q_b or q), kv_a/kv_b and o, and the shared experts; `EXPERT_LORA_TARGET` adds the
# routed experts. `k31jax.train` creates its adapters from this table, the planner counts them.
DEFAULT_LORA_TARGETS = (
    r"kda/[qkvo]_proj",
    r"mla/(q|q_a|q_b|kv_a|kv_b|o)_proj",
    r"moe/shared/(gate|up|down)_proj",
)
EXPERT_LORA_TARGET = r"moe/w_(gate|up|down)"
_ADAPTER_SLOTS = re.compile(r"(.*)/adapter_([ab])")  # packed experts' slots (`nn.with_expert_adapters`)


def lora_factor_axes(weight_axes: tuple) -> tuple[tuple, tuple]:
    """The logical axes of a LoRA weight's factors, `A [..., n, r]` and `B [..., r, m]`: the
    weight's leading and input axes, and its leading and output axes; the rank axis whole.
    `k31jax.train.lora_shardings` places the adapters by it and the planner counts them by it."""
    return (*weight_axes[:-1], None), (*weight_axes[:-2], None, weight_axes[-1])


def lora_targets(experts: bool) -> tuple[str, ...]:
    """The adapted weights of a LoRA run (`experts`: the routed experts too)."""
    return DEFAULT_LORA_TARGETS + ((EXPERT_LORA_TARGET,) if experts else ())


def is_trained(trainable: str, path: str) -> bool:
    """Whether the trainable set `trainable` (one of `TRAINABLE_SETS`) trains the leaf at `path`."""
    return _TRAINED[trainable](path)


OPTIMIZERS = ("adamw", "muon")
MASTER_DTYPES = ("float32", "bfloat16")

# optax step counters of `make_optimizer`: AdamW (decay / no-decay groups) 2 x (Adam count +
# schedule count) int32; Muon adds its own count, schedule count, Adam-side counts and the
# 3 float32 Newton-Schulz coefficients; `make_lora_optimizer` one AdamW.
_COUNTER_BYTES = {"adamw": 16, "muon": 44, "lora": 8}  # LoRA: one AdamW (Adam + schedule counts)
_F32 = 4

try:  # what JAX keeps for a backward pass (not re-exported publicly by every jax version)
    from jax.ad_checkpoint import saved_residuals
except ImportError:  # pragma: no cover - older jax
    from jax._src.ad_checkpoint import saved_residuals
# Muon's choice of matrices, as `k31jax.train` makes them.
_BATCH_AXES = ("layers", "expert")
_KINDS = ("kda", "mla", "dense", "moe")


def _label(path: str, names: tuple, dtype, trainable: str, optimizer: str) -> str:
    """"frozen", "muon" or "adamw" for one leaf (see `k31jax.train.param_labels`)."""
    if (not jnp.issubdtype(dtype, jnp.floating) or re.fullmatch(r"(.*/)?gate_bias", path)
            or not is_trained(trainable, path)):
        return "frozen"
    batch = sum(a in _BATCH_AXES for a in names)
    is_matrix = (len(names) - batch == 2 and all(a in _BATCH_AXES for a in names[:batch])
                 and not {"vocab", "conv"} & set(names))
    return "muon" if optimizer == "muon" and is_matrix else "adamw"


def training_config(cfg: ModelConfig, master_dtype: str) -> ModelConfig:
    """The model as `k31jax.train` trains it: float master experts in `master_dtype`, QAT on."""
    return cfg.replace(expert_weights="bf16", dtype=master_dtype, expert_qat=bool(cfg.moe_layers))


def lora_config(cfg: ModelConfig, master_dtype: str, rank: int, experts: bool) -> ModelConfig:
    """The model as a LoRA run holds it (`k31jax.train.training_form`): packed MXFP4 experts
    stay packed and frozen (with adapter slots beside them when `experts`), float experts are
    float masters with QAT on; everything in `master_dtype`."""
    packed = cfg.expert_weights == "mxfp4"
    return cfg.replace(expert_weights="mxfp4" if packed else "bf16", dtype=master_dtype,
                       expert_qat=bool(cfg.moe_layers) and not packed,
                       expert_adapter_rank=rank if packed and experts else 0)


def lora_bytes(cfg: ModelConfig, mesh_shape: Mapping[str, int], rules: Rules, rank: int,
               experts: bool) -> dict[str, int]:
    """Per-device bytes of a LoRA step's state and of its merged weights (`cfg` in its LoRA
    form): the frozen base as held, the fp32 adapters (`A [..., n, r]` split as the weight's
    leading and input axes, `B [..., r, m]` as its leading and output axes; beside packed
    experts, their slots' shapes and splits), their gradients and AdamW moments, and what
    `k31jax.train.apply_lora` makes each step: a merged copy of every adapted float weight (and
    of each slotted factor) in the weight's dtype, with a cotangent of the same size in the
    backward pass."""
    out = {f"{what}_{part}": 0 for what in ("weights", "grads", "moments") for part in ("experts", "rest")}
    out.update(trained=0, largest_trained=0, adapters=0, merged=0, counters=_COUNTER_BYTES["lora"])
    patterns = [re.compile(t) for t in lora_targets(experts)]
    for path, shape, dtype, names in _param_leaves(cfg):
        name = "/".join(path)
        n = _shard_bytes(shape, dtype, logical_to_spec(names, shape, mesh_shape, rules), mesh_shape)
        part = "experts" if _ROUTED_EXPERTS.fullmatch(name) else "rest"
        slot = _ADAPTER_SLOTS.fullmatch(name)
        out["weights_" + ("experts" if slot else part)] += n
        if slot:  # the slot's factor, trained in fp32; the slot itself holds its cast copy
            factors = [(shape, names)]
            part = "experts"
        elif any(p.fullmatch(name) for p in patterns) and jnp.issubdtype(dtype, jnp.floating) and len(shape) >= 2:
            factors = list(zip(((*shape[:-1], rank), (*shape[:-2], rank, shape[-1])), lora_factor_axes(names)))
        else:
            continue
        out["merged"] += n
        for f_shape, f_names in factors:
            m = _shard_bytes(f_shape, jnp.float32, logical_to_spec(f_names, f_shape, mesh_shape, rules), mesh_shape)
            out["adapters"] += m
            out["grads_" + part] += m
            out["moments_" + part] += 2 * m
            out["trained"] += m
            out["largest_trained"] = max(out["largest_trained"], m)
    return out


def state_bytes(cfg: ModelConfig, mesh_shape: Mapping[str, int], rules: Rules, trainable: str,
                optimizer: str) -> dict[str, int]:
    """Per-device bytes of master weights, gradients and optimizer moments, each split into the
    routed experts and everything else (`cfg` already in its training form)."""
    out = {f"{what}_{part}": 0 for what in ("weights", "grads", "moments") for part in ("experts", "rest")}
    out["trained"] = out["largest_trained"] = 0
    for path, shape, dtype, names in _param_leaves(cfg):
        name = "/".join(path)
        n = _shard_bytes(shape, dtype, logical_to_spec(names, shape, mesh_shape, rules), mesh_shape)
        part = "experts" if _ROUTED_EXPERTS.fullmatch(name) else "rest"
        label = _label(name, names, dtype, trainable, optimizer)
        out["weights_" + part] += n
        out["moments_" + part] += {"frozen": 0, "muon": 1, "adamw": 2}[label] * n
        if label != "frozen":
            out["grads_" + part] += n
            out["trained"] += n
            out["largest_trained"] = max(out["largest_trained"], n)
    out["counters"] = _COUNTER_BYTES[optimizer]
    return out


# ----------------------------------------------------------------------------- activations


@dataclasses.dataclass(frozen=True)
class _Local:
    """One device's share of a micro-batch: tokens, heads and widths after the rules split them."""

    cfg: ModelConfig
    mesh_shape: Mapping[str, int]
    rules: Rules
    micro_batch: int
    seq_len: int

    def split(self, name: str, size: int) -> float:
        return size / _factor(name, size, self.mesh_shape, self.rules)

    @property
    def rows(self) -> float:
        return self.split("batch", self.micro_batch)

    @property
    def tokens(self) -> float:
        return self.rows * self.seq_len

    @property
    def act(self) -> int:
        return jnp.dtype(self.cfg.dtype).itemsize


@functools.lru_cache(maxsize=64)
def _kda_chunk_residual_bytes(seq_len: int, head_dim: int, chunk: int) -> int:
    """Bytes `kda_chunked` (XLA form, packed segments) saves for its backward pass for one row
    and one head, from JAX's trace at these shapes (nothing is allocated)."""
    sds = jax.ShapeDtypeStruct
    x = sds((1, seq_len, 1, head_dim), jnp.float32)

    def loss(q, k, v, g, beta, segment_ids):
        o, state = kda_chunked(q, k, v, g, beta, chunk_size=chunk, impl="xla", segment_ids=segment_ids)
        return jnp.sum(o) + jnp.sum(state)

    saved = saved_residuals(loss, x, x, x, x, sds((1, seq_len, 1), jnp.float32), sds((1, seq_len), jnp.int32))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, what in saved if "from the argument" not in what)


def _kda(loc: _Local) -> tuple[float, float]:
    """(all residuals, matmul outputs) of one KDA layer, XLA chunked form with segments."""
    cfg, a, f = loc.cfg, loc.act, _F32
    h, dk, k = loc.split("act_heads", cfg.kda_num_heads), cfg.kda_head_dim, cfg.kda_conv_size
    c = h * dk
    scan = loc.rows * h * _kda_chunk_residual_bytes(loc.seq_len, dk, cfg.kda_chunk_size)
    convs = loc.tokens * c * ((6 * k + 27) * f + 3 * k + 6)  # conv taps, SiLU, gates, L2 norms, gated norm
    dots = loc.tokens * (5 * c + h + dk) * a  # q, k, v, f_b, g | b_proj | f_a
    return scan + convs + loc.tokens * cfg.hidden_size * a, dots  # + the layer's normalised input


def _mla(loc: _Local) -> tuple[float, float]:
    """(all residuals, matmul outputs) of one MLA (+ indexer) layer, as `MLAMixer` trains."""
    cfg, a, f = loc.cfg, loc.act, _F32
    h, t, n = loc.split("act_heads", cfg.num_attention_heads), loc.seq_len, loc.tokens
    dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_lora = cfg.q_lora_rank or 0
    per_token = h * (dn + dr) * a + h * dv * (5 * f + 1) + 3 * q_lora * a + 2 * r * a + cfg.hidden_size * a
    dots = n * (q_lora + h * (dn + dr) + r + dr + h * dv) * a  # q_a, q_b, kv_a, g_proj
    select = cfg.use_indexer and cfg.index_topk < t
    if select:  # the fp32 index queries, key and head weights, kept for the recomputed selection
        hi = cfg.index_n_heads / _factor("index_heads", cfg.index_n_heads * cfg.index_head_dim, loc.mesh_shape,
                                         loc.rules)
        dots += n * (hi * (cfg.index_head_dim + 1) + cfg.index_head_dim) * f
    if select and t * t > MLAMixer.mask_path_max_elements:  # gather form: selected latent rows
        k = cfg.index_topk
        per_token += 2 * h * r * f + k * (r + dr) * f + 4 * k + h * k * (3 * f + 1)
        return n * per_token, dots
    # naive form: per-head keys / values from the latent, [T, T] logits
    per_token += h * (dn + dv) * a
    logits = loc.rows * t * t * (h * (3 * f + 1) + (1 if select else 0))
    return n * per_token + logits, dots + n * h * (dn + dv) * a


def _dense(loc: _Local) -> tuple[float, float]:
    cfg, a = loc.cfg, loc.act
    i = loc.split("mlp", cfg.intermediate_size)
    return loc.tokens * (i * (7 * _F32 + a) + cfg.hidden_size * a), loc.tokens * 2 * i * a


def _moe(loc: _Local) -> tuple[float, float, float, float]:
    """(all residuals, matmul outputs, the fake-quantised local experts, one exchange round's
    residuals) of one MoE layer. In several exchange rounds (`exchange_rounds`) each round is
    recomputed in the backward pass: its residuals are one round's, live during that pass only."""
    cfg, a, f = loc.cfg, loc.act, _F32
    e, i, ell, k, d = (cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_in_dim, cfg.num_experts_per_token,
                       cfg.hidden_size)
    sds = jax.ShapeDtypeStruct
    up, down = sds((e, i, ell), jnp.dtype(cfg.dtype)), sds((e, ell, i), jnp.dtype(cfg.dtype))
    plan = make_ep_plan(loc.micro_batch * loc.seq_len, (up, up, down), exchange="dense",
                        mesh=abstract_mesh(loc.mesh_shape), rules=loc.rules)
    rounds = 1
    if plan is None:  # one device's ragged path: every assignment, all experts
        rows = returned = loc.tokens * k
        e_loc, i_loc, received = e, i, 0
    else:  # expert parallel: a worst-case receive buffer for every peer's assignments, per round
        tokens = loc.micro_batch * loc.seq_len // plan.token_shards
        rounds = exchange_rounds(tokens, k, plan.ep_size, ell)
        returned = tokens / rounds * k
        rows, e_loc, i_loc = plan.ep_size * returned, e // plan.ep_size, i / plan.tp_size
        received = ell * (a + 2 * f)  # the received rows and the fp32 outputs sent back
    glu = 7 * f + a  # the SiTU / SwiGLU fp32 island
    experts = rows * (ell * a + received + ell + i_loc * glu + 8) + returned * (ell * (3 * f + 1) + 8)
    experts, in_rounds = (0.0, experts) if rounds > 1 else (experts, 0.0)
    si = cfg.shared_intermediate_size
    si_loc = loc.split("mlp", si) if si else 0
    n = loc.tokens
    router = e * f + k * (2 * f + 4) + 2 * f + (d * f if a < f else 0)  # scores, choice, fp32 input
    outside = n * (router + ell * (f + 2 * a) + si_loc * glu + d * a)     # + latent sum / norm, shared GLU
    dots = n * (e * (f if a < f else a) + (ell + 2 * si_loc) * a)  # router, latent down, shared gate / up
    fake_quant = 3 * e_loc * i_loc * ell * a
    return experts + outside, dots, fake_quant, in_rounds


def _layer_slice_bytes(cfg: ModelConfig, mesh_shape, rules, merged: tuple[str, ...] = ()) -> dict[str, float]:
    """One layer's slice of each stacked kind's weights (routed experts excluded, and the
    weights matching a `merged` regex, whose LoRA-merged copies are counted whole), per device:
    what a layer of that kind saves for its matmuls' backward without remat."""
    out = dict.fromkeys(_KINDS, 0.0)
    for path, shape, dtype, names in _param_leaves(cfg):
        name = "/".join(path)
        if path[0] in _KINDS and not _ROUTED_EXPERTS.fullmatch(name) and not any(re.fullmatch(m, name) for m in merged):
            out[path[0]] += _shard_bytes(shape, dtype, logical_to_spec(names, shape, mesh_shape, rules),
                                         mesh_shape) / shape[0]
    return out


def _layer_kinds(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(mixer, FFN) kind of every layer."""
    return [("mla" if t == "mla" else "kda", "moe" if cfg.is_moe_layer(i) else "dense")
            for i, t in enumerate(cfg.layer_types)]


def activation_terms(cfg: ModelConfig, mesh_shape: Mapping[str, int], rules: Rules, *, remat: str, seq_len: int,
                     micro_batch: int, vocab_chunk: int = 4096, merged: tuple[str, ...] = ()) -> dict[str, float]:
    """The activation terms of one micro-batch (`cfg` in its training form), per device:
    `saved_*` live through the backward pass, `layer_backward` / `loss_chunk` are transient.
    `merged`: the regexes of LoRA-adapted weights (their merged copies are not counted here)."""
    loc = _Local(cfg, dict(mesh_shape), rules, micro_batch, seq_len)
    a, n, d, layers = loc.act, loc.tokens, cfg.hidden_size, cfg.num_hidden_layers
    kinds = {"kda": _kda(loc) if cfg.kda_layers else (0, 0), "mla": _mla(loc) if cfg.mla_layers else (0, 0),
             "dense": _dense(loc) if cfg.dense_layers else (0, 0)}
    moe_all, moe_dots, fake_quant, moe_round = _moe(loc) if cfg.moe_layers else (0, 0, 0, 0)
    # a round's residuals are transient: in the one layer being differentiated (remat "none")
    # or with the layer's recomputed rest (otherwise)
    kinds["moe"] = (moe_all + (moe_round if remat != "none" else 0), moe_dots)
    slots = cfg.num_attn_res_slots
    attn_res = 4 * (slots + 1) * n * d * _F32 if cfg.use_attn_res else 0  # two mixes: candidates, normalised
    per_layer = _layer_kinds(cfg)
    # per layer: its mixer's and FFN's residuals, + AttnRes mixes, norms and partial sums
    layer_all = [kinds[m][0] + kinds[f][0] + attn_res + 6 * n * d * a for m, f in per_layer]
    # + the mixes' fp32 scores and one [N, D] product the recomputation starts from
    layer_dots = [kinds[m][1] + kinds[f][1] + (2 * (slots + 1) * n * _F32 if cfg.use_attn_res else 0) + n * d * a
                  for m, f in per_layer]
    carry = (slots + 1) * n * d * a
    out = {"saved_carry": 0.0, "saved_intermediates": 0.0, "saved_weight_slices": 0.0, "fake_quant": 0.0,
           "layer_backward": 0.0}
    moe_count = sum(f == "moe" for _, f in per_layer)
    if remat == "none":
        out["saved_intermediates"] = sum(layer_all)
        slices = _layer_slice_bytes(cfg, mesh_shape, rules, merged)
        out["saved_weight_slices"] = sum(slices[m] + slices[f] for m, f in per_layer)
        out["fake_quant"] = moe_count * fake_quant
        out["layer_backward"] = 2 * carry + moe_round  # the cotangents into and out of the layer
    else:
        out["saved_carry"] = layers * carry
        out["saved_intermediates"] = sum(layer_dots) if remat == "dots" else 0.0
        out["layer_backward"] = max(full - (dots if remat == "dots" else 0.0)
                                    for full, dots in zip(layer_all, layer_dots)) + 2 * carry
        out["fake_quant"] = fake_quant if moe_count else 0.0
    # outside the scan: embedding, output AttnRes mix, final norm, the loss's saved inputs
    out["saved_outside"] = n * d * (2 * a + (2 * (slots + 1) * _F32 if cfg.use_attn_res else 0) + 3 * _F32) + 16 * n
    out["loss_chunk"] = n * (3 * min(vocab_chunk, cfg.vocab_size) + d) * _F32
    return out


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class TrainingMemoryPlan:
    """Per-device bytes of one training step (see the module docstring for each term)."""

    config_name: str
    mesh: dict[str, int]
    rules_name: str
    trainable: str
    optimizer: str
    master_dtype: str
    remat: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    layers: int
    state: dict[str, int]
    activations: dict[str, float]
    notes: tuple[str, ...] = ()
    slices: int = 1  # TPU slices joined by the data-center network; the data axis runs across them
    lora_rank: int = 0  # > 0: a LoRA step (adapters of this rank on the frozen base), not a QAT one
    lora_experts: bool = False  # LoRA adapters beside the routed experts too
    packed_experts: bool = False  # LoRA: the routed experts stay packed MXFP4 (decoded per layer as used)

    @property
    def cross_slice_bytes(self) -> int:
        """What each device sends across slices per step: its shard of the trained gradients,
        summed over the slices by one all-reduce (every other axis stays inside a slice, and the
        parameters are replicated over the data axis, so nothing else is exchanged). The
        deviceless TPU compiler's cross-slice transfers of a training step carry exactly these
        bytes plus a few scalars (loss, token counts)."""
        return self.state["trained"] if self.slices > 1 else 0

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def weights(self) -> int:
        """The parameters as the step holds them (under LoRA: the frozen base and the adapters)."""
        return self.state["weights_experts"] + self.state["weights_rest"] + self.state.get("adapters", 0)

    @property
    def gradients(self) -> int:
        return self.state["trained"] * (2 if self.grad_accum > 1 else 1)

    @property
    def optimizer_state(self) -> int:
        return self.state["moments_experts"] + self.state["moments_rest"] + self.state["counters"]

    @property
    def saved_activations(self) -> int:
        return int(sum(v for k, v in self.activations.items() if k.startswith("saved_")))

    @property
    def backward_peak(self) -> int:
        """Saved residuals plus the larger transient: the loss chunk, or one layer's backward
        (its recomputed intermediates, the carry cotangents and the fake-quantised experts)."""
        act = self.activations
        layer = act["layer_backward"] + (act["fake_quant"] if self.remat != "none" else 0)
        saved = self.saved_activations + (act["fake_quant"] if self.remat == "none" else 0)
        merged = act.get("lora_merged", 0) + act.get("lora_cotangents", 0)  # live through the backward pass
        return saved + int(merged) + int(max(layer, act["loss_chunk"]))

    @property
    def update_transient(self) -> int:
        """The optimizer update, after the activations are freed: one trained leaf's update
        buffer at a time (the update is elementwise per leaf, applied in place to donated
        buffers; a schedule that kept every leaf's update alive would need `state["trained"]`)."""
        return self.state["largest_trained"]

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_state + self.activation_peak

    def fits(self, device: str, usable: float = 0.9) -> bool:
        return self.total <= DEVICES[device][1] * usable

    @property
    def activation_peak(self) -> int:
        """What the activations phase adds on top of weights, gradients and optimizer state."""
        return max(self.backward_peak, self.update_transient)

    def _state_rows(self) -> list[tuple[str, float]]:
        s, dt = self.state, self.master_dtype
        if self.lora_rank:
            experts = ("packed MXFP4" if self.packed_experts else dt) + ", frozen"
            experts += "; their adapter slots" if self.lora_experts and self.packed_experts else ""
            return [(f"base weights: routed experts ({experts})", s["weights_experts"]),
                    (f"base weights: everything else ({dt}, frozen)", s["weights_rest"]),
                    (f"LoRA adapters, rank {self.lora_rank} (fp32)", s["adapters"]),
                    ("gradients: adapters", s["trained"]),
                    ("gradient accumulator (grad_accum > 1)", self.gradients - s["trained"]),
                    ("optimizer: AdamW moments, adapters", s["moments_experts"] + s["moments_rest"]),
                    ("optimizer: step counters", s["counters"])]
        opt = "Muon momentum + AdamW moments" if self.optimizer == "muon" else "AdamW moments"
        return [(f"master weights: routed experts ({dt})", s["weights_experts"]),
                (f"master weights: everything else ({dt}, f32 leaves f32)", s["weights_rest"]),
                ("gradients: routed experts (trained)", s["grads_experts"]),
                ("gradients: everything else (trained)", s["grads_rest"]),
                ("gradient accumulator (grad_accum > 1)", self.gradients - s["trained"]),
                (f"optimizer: {opt}, routed experts", s["moments_experts"]),
                (f"optimizer: {opt}, everything else", s["moments_rest"]),
                ("optimizer: step counters", s["counters"])]

    def table(self, device: str | None = None, usable: float = 0.9) -> str:
        act = self.activations
        experts = "decoded" if self.packed_experts else "fake-quant"
        rows = self._state_rows() + [
            (f"act. saved: layer inputs (prefix + AttnRes blocks) x {self.layers}", act["saved_carry"]),
            (f"act. saved: layer intermediates x {self.layers}" + (" (matmul outputs)" if self.remat == "dots" else ""),
             act["saved_intermediates"]),
            (f"act. saved: per-layer weight slices x {self.layers}", act["saved_weight_slices"]),
            ("act. saved: embedding, output mix, loss inputs", act["saved_outside"]),
            (f"act. {experts} experts, " + (f"x {self.layers}" if self.remat == "none" else "one layer"),
             act["fake_quant"]),
        ] + ([
            ("act. merged adapted weights, every layer", act["lora_merged"]),
            ("act. their cotangents (backward pass)", act["lora_cotangents"]),
        ] if self.lora_rank else []) + [
            ("act. one layer's backward (recompute + cotangents)", act["layer_backward"]),
            ("act. loss: one vocab chunk of logits", act["loss_chunk"]),
            ("optimizer update, largest trained leaf", self.update_transient),
        ]
        what = (f"LoRA fine-tune (rank {self.lora_rank}, adapters on attention and the shared experts"
                + (" and beside the routed experts" if self.lora_experts else "") + ", AdamW)" if self.lora_rank
                else f"QAT fine-tune (trainable {self.trainable}, {self.optimizer})")
        head = (f"{self.config_name} {what} on {mesh_str(self.mesh)} ({self.devices} devices, rules "
                f"{self.rules_name}): {self.master_dtype} " + ("base" if self.lora_rank else "masters") + ", remat "
                f"{self.remat}, micro-batch {self.micro_batch} x {self.seq_len:,} tokens"
                + (f", grad_accum {self.grad_accum}" if self.grad_accum > 1 else ""))
        w = max(len(r[0]) for r in rows) + 2
        lines = [head, f"{'per device':<{w}}{'bytes':>19}{'GB':>9}"]
        lines += [f"{label:<{w}}{int(n):>19,}{n / GB:>9.2f}" for label, n in rows]
        lines.append(f"{'total':<{w}}{self.total:>19,}{self.total / GB:>9.2f}")
        lines.append("total = weights + gradients + optimizer + max(saved act. + "
                     + ("merged weights + their cotangents + " if self.lora_rank else "")
                     + f"max({experts} experts + one layer's backward, loss chunk), update)")
        if self.slices > 1:
            lines.append(f"across {self.slices} slices (data-center network), per device per step: the trained "
                         f"gradients' shard, {self.cross_slice_bytes / GB:.3f} GB, one all-reduce")
        lines += [f"note: {n}" for n in self.notes]
        lines += ["", f"{'device':<22}{'HBM GB':>8}{'usable GB':>11}  fits"]
        for name, (label, cap) in DEVICES.items():
            star = "  <-" if name == device else ""
            lines.append(f"{label + ' (' + name + ')':<22}{cap / GB:>8.0f}{cap * usable / GB:>11.1f}  "
                         f"{'yes' if self.fits(name, usable) else 'no'}{star}")
        return "\n".join(lines)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"plan_training: {name}={value!r}, expected one of {choices}")


def plan_training(
    config: ModelConfig | str,
    mesh: str | Mapping[str, int],
    *,
    trainable: str = "experts",
    optimizer: str = "adamw",
    master_dtype: str = "float32",
    remat: str = "full",
    seq_len: int = 4096,
    micro_batch: int = 1,
    grad_accum: int = 1,
    vocab_chunk: int = 4096,
    rules: Rules | str | None = None,
    slices: int = 1,
    lora_rank: int = 0,
    lora_experts: bool = False,
) -> TrainingMemoryPlan:
    """The per-device memory of one QAT fine-tuning step of `config` on `mesh` (no allocation):
    master weights, gradients, optimizer state and the activations of one micro-batch of
    `micro_batch` rows x `seq_len` tokens under `remat` (module docstring). With `slices` > 1
    the mesh spans that many TPU slices, its `data` axis across them (`cross_slice_bytes`).

    With `lora_rank` > 0, one LoRA step instead (`k31jax train --lora-rank`): the base frozen
    (packed experts stay packed), rank-`lora_rank` adapters on `DEFAULT_LORA_TARGETS` (and
    beside the routed experts with `lora_experts`) trained with AdamW; `trainable` and
    `optimizer` do not apply (`lora_bytes`)."""
    _check_choice("trainable", trainable, TRAINABLE_SETS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    if not (isinstance(lora_rank, (int, np.integer)) and lora_rank >= 0):
        raise ValueError(f"plan_training: lora_rank={lora_rank!r}, expected an int >= 0")
    if lora_experts and not lora_rank:
        raise ValueError("plan_training: lora_experts=True with lora_rank=0: adapters need a rank")
    if lora_rank and optimizer != "adamw":
        raise ValueError(f"plan_training: optimizer={optimizer!r} with lora_rank={lora_rank}: LoRA adapters train "
                         "with AdamW")
    _check_choice("master_dtype", master_dtype, MASTER_DTYPES)
    _check_choice("remat", remat, REMAT_POLICIES)
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("grad_accum", grad_accum),
                        ("vocab_chunk", vocab_chunk), ("slices", slices)):
        if not (isinstance(value, (int, np.integer)) and value >= 1):
            raise ValueError(f"plan_training: {name}={value!r}, expected an int >= 1")
    name = config if isinstance(config, str) else "model"
    cfg = ModelConfig.preset(config) if isinstance(config, str) else config
    packed = bool(lora_rank) and cfg.expert_weights == "mxfp4"
    cfg = lora_config(cfg, master_dtype, lora_rank, lora_experts) if lora_rank else training_config(cfg, master_dtype)
    shape = parse_mesh(mesh)
    if shape["data"] % slices:
        raise ValueError(f"plan_training: mesh {mesh_str(shape)} over {slices} slices: data={shape['data']} is not a "
                         "multiple of the slices (data parallelism runs across slices)")
    rules = get_rules(rules) or rules_for_mesh(shape)
    activations = activation_terms(cfg, shape, rules, remat=remat, seq_len=seq_len, micro_batch=micro_batch,
                                   vocab_chunk=vocab_chunk, merged=lora_targets(lora_experts) if lora_rank else ())
    if lora_rank:
        state = lora_bytes(cfg, shape, rules, lora_rank, lora_experts)
        activations.update(lora_merged=state["merged"], lora_cotangents=state["merged"])
    else:
        state = state_bytes(cfg, shape, rules, trainable, optimizer)
    return TrainingMemoryPlan(
        name, shape, rules_name(rules), trainable, optimizer, master_dtype, remat, seq_len, micro_batch, grad_accum,
        cfg.num_hidden_layers, state, activations, _notes(cfg, shape, rules, micro_batch), slices, lora_rank,
        lora_experts, packed)


def _qat_refusal(cfg: ModelConfig, mesh_shape, rules) -> str | None:
    """Why `k31jax.ops.ep_routed_experts` would refuse QAT on this mesh, or None."""
    if not cfg.moe_layers:
        return None
    if cfg.num_experts % mesh_shape.get("expert", 1):
        return f"expert={mesh_shape['expert']} does not divide num_experts={cfg.num_experts}"
    e, i, ell = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_in_dim
    sds = jax.ShapeDtypeStruct((e, i, ell), jnp.float32)
    plan = make_ep_plan(1, (sds, sds, jax.ShapeDtypeStruct((e, ell, i), jnp.float32)), exchange="dense",
                        mesh=abstract_mesh(mesh_shape), rules=rules)
    if plan is not None and plan.tp_size > 1 and (i // plan.tp_size) % 32:
        return (f"QAT cannot run here: the expert intermediate splits into {i // plan.tp_size}-wide shards, not a "
                "multiple of the MX 32-blocks (ep_routed_experts raises)")
    return None


def _notes(cfg: ModelConfig, mesh_shape, rules, micro_batch: int) -> tuple[str, ...]:
    notes = [n for n in (_qat_refusal(cfg, mesh_shape, rules) if cfg.expert_qat else None,) if n]
    batch = dict(rules).get("batch") or ()
    axes = [ax for ax in ((batch,) if isinstance(batch, str) else batch) if mesh_shape.get(ax, 1) > 1]
    ways = math.prod(mesh_shape[ax] for ax in axes)
    split = _factor("batch", micro_batch, mesh_shape, rules)
    if ways > split:
        how = "is not split" if split == 1 else f"is split only {split} ways"
        notes.append(f"the {micro_batch}-row micro-batch {how} over the batch axes ({', '.join(axes)}: {ways} ways), "
                     f"so devices repeat each other's rows; a multiple of {ways} rows gives each its own")
    return tuple(notes)


def suggest_training_mesh(config: ModelConfig | str, device: str, *, usable: float = 0.9, max_devices: int = 4096,
                          **options) -> TrainingMemoryPlan | None:
    """The smallest candidate mesh (`candidate_meshes`) on which `plan_training(config, mesh,
    **options)` fits `device`: fewest devices, then EP layouts before FSDP ones, then least
    memory. Meshes the QAT expert-parallel path refuses (an expert intermediate shard not a
    multiple of the 32-blocks) and expert counts the `expert` axis does not divide are skipped."""
    cfg = ModelConfig.preset(config) if isinstance(config, str) else config
    _check_choice("master_dtype", options.get("master_dtype", "float32"), MASTER_DTYPES)
    dtype = options.get("master_dtype", "float32")
    train_cfg = (lora_config(cfg, dtype, options["lora_rank"], options.get("lora_experts", False))
                 if options.get("lora_rank") else training_config(cfg, dtype))
    best = None
    for mesh, rules in candidate_meshes(max_devices):
        if best is not None and math.prod(mesh.values()) > best.devices:
            break
        if train_cfg.expert_qat and _qat_refusal(train_cfg, parse_mesh(mesh), get_rules(rules)):
            continue
        p = plan_training(cfg, mesh, rules=rules, **options)
        p = dataclasses.replace(p, config_name=config if isinstance(config, str) else "model")
        key = (_RULE_PREFERENCE.get(p.rules_name, 3), p.total)
        if p.fits(device, usable) and (best is None or key < (_RULE_PREFERENCE.get(best.rules_name, 3), best.total)):
            best = p
    return best
