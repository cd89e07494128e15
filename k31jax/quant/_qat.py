"""MX fake quantisation for QAT with a straight-through estimator.

Spec: ``mx_formats.md`` §6.

``fake_quant(w) = dequantize(quantize(w))`` in the forward pass (bit-identical to
the two calls, returned in ``w.dtype``); the derivative is the identity (STE):
the scale is a power-of-two step function of ``w`` and is treated as a constant
(as under ``stop_gradient``), and no clipping mask is applied. It is written as a
``jax.custom_jvp`` whose tangent map is the identity, so forward mode, reverse
mode, ``vmap`` and ``jit`` all work, and the forward value is exactly ``fq(w)``
(``w + stop_gradient(fq(w) - w)`` can be off by one rounding).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from k31jax.quant._formats import DEFAULT_BLOCK, check_rule, get_format
from k31jax.quant._mx import (
    _check_blocked,
    _from_blocks,
    _to_blocks,
    apply_scale_blocks,
    block_scale_bytes,
    scale_blocks,
)

if TYPE_CHECKING:
    from jaxtyping import Array, Float


@functools.partial(jax.jit, static_argnames=("fmt", "rule", "axis", "block"))
def _fake_quant_fwd(w: jax.Array, fmt: str, rule: str, axis: int, block: int) -> jax.Array:
    f = get_format(fmt)
    ax = _check_blocked(w.shape, block, axis, "fake_quant")
    wb = _to_blocks(w, block, ax)
    sb = jax.lax.stop_gradient(block_scale_bytes(wb, f, rule))
    # Each element's own scale byte, materialised as one byte per element in the weight's own
    # shape (the barrier), and the elements as blocks of one: the scale factors are then made
    # per element inside the fusion that writes the result. Derived per block and broadcast,
    # they were f32 and s32 copies of the weight, and copies of those, wherever the consumer's
    # layout keeps XLA from fusing a broadcast that splits the minor axis: a grouped matmul's
    # weight and its gradient held eight weight-sized f32 buffers, now one u8 (tests/aot).
    spread = _from_blocks(jnp.broadcast_to(sb[..., None], wb.shape), ax)
    each = _to_blocks(jax.lax.optimization_barrier(spread), block, ax)
    q = scale_blocks(wb[..., None], each, f).astype(f.dtype).astype(jnp.float32)  # RNE to the grid
    return _from_blocks(apply_scale_blocks(q, each)[..., 0], ax).astype(w.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4))
def _fake_quant_ste(w, fmt, rule, axis, block):
    return _fake_quant_fwd(w, fmt, rule, axis, block)


@_fake_quant_ste.defjvp
def _fake_quant_ste_jvp(fmt, rule, axis, block, primals, tangents):
    (w,), (t,) = primals, tangents
    return _fake_quant_fwd(w, fmt, rule, axis, block), t


def fake_quant(
    w: Float[Array, "*shape"],
    fmt: str = "e2m1",
    rule: str = "floor",
    axis: int = -1,
    *,
    block: int = DEFAULT_BLOCK,
) -> Float[Array, "*shape"]:
    """MX fake-quantisation with a straight-through (identity) gradient.

    Args:
      w: float weights (bf16/f32 master copy); ``w.shape[axis] % block == 0``.
      fmt: element format, "e2m1" (MXFP4, routed-expert weights), "e4m3" or "e5m2".
      rule: scale rule, "floor", "rceil" or "even". Export with the same rule.
      axis: blocked axis (-1 = ``in`` for ``[out, in]`` weights). A backward GEMM
        contracting another axis needs its own ``fake_quant`` along that axis.
      block: block size (32).

    Returns:
      ``dequantize(*quantize(w, fmt, rule=rule, axis=axis), fmt, axis=axis)`` in
      ``w.dtype`` (exact: every MX value fits bf16/f32). Gradient: identity.
    """
    get_format(fmt)
    check_rule(rule)
    w = jnp.asarray(w)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"fake_quant: w must be floating point, got {w.dtype}")
    return _fake_quant_ste(w, fmt, rule, axis, block)


def mx_fake_quant_activations(
    x: Float[Array, "*B K"],
    fmt: str = "e4m3",
    rule: str = "rceil",
    *,
    block: int = DEFAULT_BLOCK,
) -> Float[Array, "*B K"]:
    """MXFP8 activation simulation along the last (contraction) axis.

    ``dequantize(quantize(x, fmt, rule=rule))`` in ``x.dtype``, rceil by default
    (the cuBLAS / Transformer Engine MXFP8 rule). Straight-through gradient, as
    :func:`fake_quant`.
    """
    return fake_quant(x, fmt, rule, -1, block=block)
