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
"kda/q_proj"): KDA q/k/v/o, MLA q (q_a/q_b or q), kv_a/kv_b and o, and the shared experts.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ._optim import map_by_path

DEFAULT_LORA_TARGETS = (
    r"kda/[qkvo]_proj",
    r"mla/(q|q_a|q_b|kv_a|kv_b|o)_proj",
    r"moe/shared/(gate|up|down)_proj",
)


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
    chosen = {}
    for pattern in patterns:
        hits = [p for p in leaves if pattern.fullmatch(p)]
        if not hits:
            raise ValueError(f"init_lora: target {pattern.pattern!r} matches no parameter; "
                             f"parameters are {sorted(leaves)}")
        for path in hits:
            w = leaves[path]
            if len(w.shape) < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
                raise ValueError(f"init_lora: target {pattern.pattern!r} matched {path!r} "
                                 f"(shape {tuple(w.shape)}, {w.dtype}): LoRA needs a float weight matrix")
            chosen[path] = w
    a, b = {}, {}
    for i, (path, w) in enumerate(sorted(chosen.items())):
        *lead, n, m = w.shape
        a[path] = jax.random.normal(jax.random.fold_in(rng, i), (*lead, n, rank), jnp.float32) / math.sqrt(n)
        b[path] = jnp.zeros((*lead, rank, m), jnp.float32)
    return LoraState(a=a, b=b, alpha=float(alpha), rank=rank)


def lora_delta(lora: LoraState, path: str) -> jax.Array:
    """`scale · A @ B` for one adapted path, fp32, shaped like the weight."""
    return lora.scale * jnp.matmul(lora.a[path], lora.b[path], precision=jax.lax.Precision.HIGHEST)


def apply_lora(params_state, lora: LoraState):
    """The parameters with each adapted weight replaced by `stop_gradient(W) + delta`.

    Works on an `nnx.State` of Variables or of arrays (e.g. from `nnx.split`), keeping its
    structure, so the result goes straight to `nnx.merge`."""
    missing = set(lora.a)

    def merge(path, x):
        if path not in lora.a:
            return x
        missing.discard(path)
        w = _value(x)
        merged = (jax.lax.stop_gradient(w).astype(jnp.float32) + lora_delta(lora, path)).astype(w.dtype)
        return x.replace(merged) if isinstance(x, nnx.Variable) else merged

    out = map_by_path(merge, params_state)
    if missing:
        raise ValueError(f"apply_lora: adapted parameters {sorted(missing)} are not in params_state")
    return out
