"""Dispatch seam for the MXFP4 grouped expert matmul: `impl ∈ {"xla", "pallas", "interpret"}`.

Dtype policy: activations bf16 (or f32); the E2M1 codes are decoded in-kernel to exact values
in the activation dtype, products accumulate in fp32 and each 32-block's E8M0 scale is applied
to its fp32 partial product (exact powers of two), the result is cast back to the activation
dtype — the contract of `ops.grouped_matmul`, equal to it up to fp32 accumulation order.
Float (non-MXFP4) weights (including the QAT fake-quant path) always take the XLA path.
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from .._common import pow2_at_least, resolve_impl
from .pallas_mxfp4_gmm import mxfp4_gmm
from .ref import MXFP4Weight, grouped_matmul_ref


def block_rows(m: int, n_groups: int) -> int:
    """Rows per tile: about the mean group size, a power of two in [16, 128]."""
    return min(128, pow2_at_least(m // max(n_groups, 1)))


def grouped_matmul(
    x_sorted: Float[Array, "M in"],
    w,
    group_sizes: Int[Array, "E"],
    weight_fake_quant: bool = False,
    *,
    impl: str | None = None,
    block_m: int | None = None,
) -> Float[Array, "M out"]:
    """`ops.grouped_matmul` with a kernel seam for packed `MXFP4Weight`s."""
    impl = resolve_impl(impl)
    if impl == "xla" or not isinstance(w, MXFP4Weight):
        return grouped_matmul_ref(x_sorted, w, group_sizes, weight_fake_quant)
    bm = block_m or block_rows(x_sorted.shape[0], group_sizes.shape[0])
    (y,) = mxfp4_gmm(x_sorted, [(w.packed, w.scale)], group_sizes, impl=impl, block_m=bm)
    return y


def grouped_matmul_gate_up(
    x_sorted: Float[Array, "M in"],
    w_gate,
    w_up,
    group_sizes: Int[Array, "E"],
    weight_fake_quant: bool = False,
    *,
    impl: str | None = None,
    block_m: int | None = None,
) -> tuple[Float[Array, "M out"], Float[Array, "M out"]]:
    """Gate and up projections of the same sorted rows in one launch (one activation read)."""
    impl = resolve_impl(impl)
    if impl == "xla" or not (isinstance(w_gate, MXFP4Weight) and isinstance(w_up, MXFP4Weight)):
        return (grouped_matmul(x_sorted, w_gate, group_sizes, weight_fake_quant, impl=impl),
                grouped_matmul(x_sorted, w_up, group_sizes, weight_fake_quant, impl=impl))
    bm = block_m or block_rows(x_sorted.shape[0], group_sizes.shape[0])
    g, u = mxfp4_gmm(x_sorted, [(w_gate.packed, w_gate.scale), (w_up.packed, w_up.scale)],
                     group_sizes, impl=impl, block_m=bm)
    return g, u
