"""LoRA adapters as a parameter delta: `W' = W + (alpha / rank) · A @ B`, merged before the
forward pass.

Why not qwix: qwix 0.1.8's `LoraProvider` + `apply_lora_to_model` intercepts `dot_general` /
`einsum` inside NNX modules, finds the weight operand among the calling module's params and
creates the LoRA params on that module during a first traced call. k31jax runs its layers as
stacks split once per call and re-merged per layer slot inside one `lax.scan`, with raw
`x @ self.w[...]` products; qwix fails on that model, both scanned and with
`scan_layers=False` (the adapters would land on throw-away per-slot modules). A functional
delta needs no model edits and works with the scanned stack, any kernel seam and sharding.

- `lora_state` holds, per adapted parameter path, `A [..., n, r]` (random, std `1/√n`) and
  `B [..., r, m]` (zeros, so a fresh adapter changes nothing). The matrix is the trailing two
  axes of the weight; leading axes (the "layers" stack) get one independent adapter each.
  Projections here are stored `[in, out]`, so `A` is the down- and `B` the up-projection.
- `apply_lora` returns the parameters with the targeted weights replaced by
  `stop_gradient(W) + scale · A @ B` (fp32 product, cast to W's dtype): differentiate the
  loss with respect to `lora_state` and only A and B learn; non-targeted parameters pass
  through untouched (freeze or train them as the optimizer decides).
- Cost: one weight-sized temporary per adapted leaf and step (attention projections and
  shared experts, small next to the routed experts). Numerics: for bf16 base weights the
  merged weight is rounded to bf16, so deltas below W's bf16 resolution do not reach the
  forward pass until they grow (the gradient of the merge is exact).

Default targets (`DEFAULT_LORA_TARGETS`, regexes matched in full against paths such as
"kda/q_proj"): KDA q/k/v/o, MLA q (q_a/q_b or q), kv_a/kv_b and o, and the shared experts;
`EXPERT_LORA_TARGET` adds the routed experts. Packed MXFP4 experts are never merged into (that
would be a float copy of them, and re-rounding would undo a small delta): their adapters run
beside the packed weight, `W x + scale · a (b x)`, as low-rank grouped matmuls
(`ops.ExpertAdapter`); the memory they add is the factors, `r (out + in)` per expert.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..ckpt import ShardWriter, load_tensor, read_header
from ..distributed import DEFAULT_LORA_TARGETS, EXPERT_LORA_TARGET, logical_axes, lora_factor_axes
from ..nn import with_expert_adapters
from ..sharding import current_rules, get_rules, logical_to_spec
from ._optim import map_by_path

# The targets' table lives with the training planner (`distributed.DEFAULT_LORA_TARGETS`), which
# counts the adapters from it. The routed experts (`EXPERT_LORA_TARGET`, `TrainConfig.lora_experts`):
# float experts merge like any weight; packed MXFP4 ones keep their bytes and take the adapters
# beside them (`nn.with_expert_adapters` gives the model the slots, `[..., E, out, r]` and
# `[..., E, r, in]`: the path names the packed weight, `a` is its `[out, r]` factor and `b` its
# `[r, in]` one).
_SLOT_A, _SLOT_B = "/adapter_a", "/adapter_b"


def _slot_owner(path: str) -> str | None:
    """The packed weight an adapter slot's path belongs to (`<weight>/adapter_a|b`), else None."""
    for slot in (_SLOT_A, _SLOT_B):
        if path.endswith(slot):
            return path[:-len(slot)]
    return None


@dataclasses.dataclass(frozen=True)
class LoraState:
    """Adapters keyed by parameter path: `a[path] [..., n, r]`, `b[path] [..., r, m]`.
    A pytree (A and B are its leaves; alpha and rank are static)."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    alpha: float
    rank: int

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


jax.tree_util.register_dataclass(LoraState, data_fields=["a", "b"], meta_fields=["alpha", "rank"])


def _value(x):
    return x.get_value() if isinstance(x, nnx.Variable) else x


def init_lora(
    params_state,
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS,
    rank: int = 8,
    alpha: float = 16.0,
    rng: jax.Array | None = None,
) -> LoraState:
    """Zero-effect adapters (B = 0) for every parameter whose path fully matches one of the
    `targets` regexes. Every regex must match at least one float parameter of rank >= 2."""
    if not (isinstance(rank, int) and rank >= 1):
        raise ValueError(f"init_lora: rank must be an int >= 1, got {rank!r}")
    rng = jax.random.key(0) if rng is None else rng
    patterns = [re.compile(t) for t in targets]
    leaves: dict[str, Any] = {}
    map_by_path(lambda p, x: leaves.setdefault(p, _value(x)), params_state)
    # packed experts with adapter slots: the weight's path -> its (lead..., n, m) shape
    slotted = {_slot_owner(p): (*leaves[p].shape[:-1], leaves[_slot_owner(p) + _SLOT_B].shape[-1])
               for p in leaves if p.endswith(_SLOT_A)}
    chosen = {}
    for pattern in patterns:
        hits = [p for p in leaves if pattern.fullmatch(p)] + [p for p in slotted if pattern.fullmatch(p)]
        if not hits:
            packed = sorted({p.rsplit("/", 1)[0] for p in leaves if p.endswith("/packed")})
            why = (f"; packed experts {packed} need adapter slots (nn.with_expert_adapters)"
                   if any(pattern.fullmatch(p) for p in packed) else "")
            raise ValueError(f"init_lora: target {pattern.pattern!r} matches no parameter{why}; "
                             f"parameters are {sorted(leaves)}")
        for path in hits:
            if path in slotted:
                width = leaves[path + _SLOT_A].shape[-1]
                if width != rank:
                    raise ValueError(f"init_lora: {path!r} has adapter slots of rank {width}, not {rank}")
                chosen[path] = slotted[path]
                continue
            w = leaves[path]
            if len(w.shape) < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
                raise ValueError(f"init_lora: target {pattern.pattern!r} matched {path!r} "
                                 f"(shape {tuple(w.shape)}, {w.dtype}): LoRA needs a float weight matrix")
            chosen[path] = tuple(w.shape)
    a, b = {}, {}
    for i, (path, shape) in enumerate(sorted(chosen.items())):
        *lead, n, m = shape
        a[path] = jax.random.normal(jax.random.fold_in(rng, i), (*lead, n, rank), jnp.float32) / math.sqrt(n)
        b[path] = jnp.zeros((*lead, rank, m), jnp.float32)
    return LoraState(a=a, b=b, alpha=float(alpha), rank=rank)


def lora_shardings(lora: LoraState, params_state, mesh, rules=None) -> LoraState:
    """Where each factor of `lora` (arrays or shapes) lives on `mesh` under `rules` (default:
    the active ones): split as its weight is, `A [..., n, r]` along the weight's leading and
    input axes and `B [..., r, m]` along its leading and output axes, the rank axis whole; a
    packed expert's factors as its adapter slots. Set explicitly so that the step's placement
    of them is the planner's (`distributed.plan_training(lora_rank=...)`), not whatever the
    compiler would choose for unplaced ones."""
    names: dict[str, tuple] = {}
    map_by_path(lambda path, v: names.setdefault(path, _value(v)), logical_axes(params_state))
    shape = dict(mesh.shape)
    rules = get_rules(rules) or current_rules(shape)

    def placed(path, factor, part):
        slot = path + (_SLOT_A if part == "a" else _SLOT_B)
        axes = names[slot] if slot in names else lora_factor_axes(names[path])[part == "b"]
        return NamedSharding(mesh, P(*logical_to_spec(axes, factor.shape, shape, rules)))

    return LoraState(a={p: placed(p, x, "a") for p, x in lora.a.items()},
                     b={p: placed(p, x, "b") for p, x in lora.b.items()}, alpha=lora.alpha, rank=lora.rank)


def lora_delta(lora: LoraState, path: str) -> jax.Array:
    """`scale · A @ B` for one adapted path, fp32, shaped like the weight."""
    return lora.scale * jnp.matmul(lora.a[path], lora.b[path], precision=jax.lax.Precision.HIGHEST)


def apply_lora(params_state, lora: LoraState):
    """The parameters with each adapted weight replaced by `stop_gradient(W) + delta`; packed
    experts keep their bytes and get the factors in their adapter slots instead (`scale · a`,
    `b`), which the forward pass applies beside them.

    Works on an `nnx.State` of Variables or of arrays (e.g. from `nnx.split`), keeping its
    structure, so the result goes straight to `nnx.merge`."""
    missing = set(lora.a)

    def merge(path, x):
        w = _value(x)
        owner = _slot_owner(path)
        if owner is not None and owner in lora.a:
            missing.discard(owner)
            factor = lora.scale * lora.a[owner] if path.endswith(_SLOT_A) else lora.b[owner]
            merged = factor.astype(w.dtype)
        elif path in lora.a:
            missing.discard(path)
            merged = (jax.lax.stop_gradient(w).astype(jnp.float32) + lora_delta(lora, path)).astype(w.dtype)
        else:
            return x
        return x.replace(merged) if isinstance(x, nnx.Variable) else merged

    out = map_by_path(merge, params_state)
    if missing:
        raise ValueError(f"apply_lora: adapted parameters {sorted(missing)} are not in params_state")
    return out


# ----------------------------------------------------------------------------- adapter files
ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_FORMAT = "adapter_config.json", "adapter.safetensors", "k31jax-lora"


def routed_expert_digest(params_state) -> str | None:
    """SHA-256 of the packed routed experts' bytes (codes and scales, in path order); None for
    a model without packed experts. An adapter records its base's, and loading checks it."""
    packed: dict[str, Any] = {}
    map_by_path(lambda p, x: packed.setdefault(p, _value(x)) if re.fullmatch(r"moe/w_\w+/(packed|scale)", p) else None,
                params_state)
    if not packed:
        return None
    digest = hashlib.sha256()
    for path in sorted(packed):
        digest.update(path.encode() + b"\0" + np.ascontiguousarray(np.asarray(packed[path])).tobytes())
    return digest.hexdigest()


def save_adapter(lora: LoraState, folder: str | os.PathLike, *, targets: tuple[str, ...], base: str,
                 base_experts: str | None) -> Path:
    """Write `lora` as `folder/adapter.safetensors` (`<path>.lora_a` / `.lora_b`, fp32) and
    `folder/adapter_config.json` (rank, alpha, targets, the base model and its packed experts'
    digest), written whole in a temporary folder and then renamed into place."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    arrays = {f"{p}.lora_{part}": np.asarray(getattr(lora, part)[p], np.float32)
              for p in sorted(lora.a) for part in ("a", "b")}
    with ShardWriter(tmp / ADAPTER_WEIGHTS, [(k, "F32", v.shape) for k, v in arrays.items()]) as writer:
        for name, value in arrays.items():
            writer.write(name, value)
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(dict(
        format=ADAPTER_FORMAT, rank=lora.rank, alpha=lora.alpha, targets=list(targets), paths=sorted(lora.a),
        base=base, base_routed_experts_sha256=base_experts), indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def load_adapter(folder: str | os.PathLike) -> tuple[LoraState, dict]:
    """(the adapters, their `adapter_config.json`) from a `save_adapter` folder."""
    folder = Path(folder)
    config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for f in (config_file, weights_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing (a LoRA adapter folder holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    meta = json.loads(config_file.read_text())
    if meta.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{config_file}: format {meta.get('format')!r}, expected {ADAPTER_FORMAT!r}")
    infos, _ = read_header(weights_file)
    a, b = {}, {}
    for path in meta["paths"]:
        for part, into in (("a", a), ("b", b)):
            name = f"{path}.lora_{part}"
            if name not in infos:
                raise ValueError(f"{weights_file}: tensor {name!r} missing ({config_file.name} lists {path!r})")
            into[path] = jnp.asarray(load_tensor(infos[name]))
        if a[path].shape[-1] != meta["rank"] or b[path].shape[-2] != meta["rank"]:
            raise ValueError(f"{weights_file}: {path!r} factors {a[path].shape} / {b[path].shape} are not of "
                             f"rank {meta['rank']} ({config_file.name})")
    return LoraState(a=a, b=b, alpha=float(meta["alpha"]), rank=int(meta["rank"])), meta


def with_adapter(model, lora: LoraState):
    """`model` with `lora` applied: merged into its float weights, and beside its packed
    routed experts (`nn.with_expert_adapters` slots, their bytes untouched)."""
    if (any(re.fullmatch(EXPERT_LORA_TARGET, p) for p in lora.a) and model.config.expert_weights == "mxfp4"
            and model.config.expert_adapter_rank != lora.rank):
        model = with_expert_adapters(model, lora.rank)
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, apply_lora(state, lora))
