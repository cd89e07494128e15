"""The kernel path of `ops.grouped_matmul` for packed `MXFP4Weight`s (`impl` "pallas" |
"interpret"), and the fused gate/up launch `ops.routed_experts` uses.

Dtype policy: activations bf16 (or f32); the E2M1 codes are decoded in-kernel to exact values
in the activation dtype, products accumulate in fp32 and each 32-block's E8M0 scale is applied
to its fp32 partial product (exact powers of two), the result is cast back to the activation
dtype — the contract of `ops.grouped_matmul`, equal to it up to fp32 accumulation order.
Float (non-MXFP4) weights (including the QAT fake-quant path) are the op's XLA path only.
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from ...quant import MXFP4Weight
from .._common import pow2_at_least
from .pallas_mxfp4_gmm import mxfp4_gmm


def block_rows(m: int, n_groups: int) -> int:
    """Rows per tile: about the mean group size, a power of two in [16, 128]."""
    return min(128, pow2_at_least(m // max(n_groups, 1)))


def _check_packed(w) -> None:
    if not isinstance(w, MXFP4Weight):
        raise TypeError(f"MXFP4 grouped matmul kernel: expected an MXFP4Weight, got {type(w).__name__} "
                        "(float weights take the XLA path: impl='xla')")


def grouped_matmul(
    x_sorted: Float[Array, "M in"],
    w,
    group_sizes: Int[Array, "E"],
    *,
    impl: str = "pallas",
    block_m: int | None = None,
) -> Float[Array, "M out"]:
    """The kernel path of `ops.grouped_matmul` (packed `MXFP4Weight` only)."""
    _check_packed(w)
    bm = block_m or block_rows(x_sorted.shape[0], group_sizes.shape[0])
    (y,) = mxfp4_gmm(x_sorted, [(w.packed, w.scale)], group_sizes, impl=impl, block_m=bm)
    return y


def grouped_matmul_gate_up(
    x_sorted: Float[Array, "M in"],
    w_gate,
    w_up,
    group_sizes: Int[Array, "E"],
    *,
    impl: str = "pallas",
    block_m: int | None = None,
) -> tuple[Float[Array, "M out"], Float[Array, "M out"]]:
    """Gate and up projections of the same sorted rows in one launch (one activation read)."""
    _check_packed(w_gate)
    _check_packed(w_up)
    bm = block_m or block_rows(x_sorted.shape[0], group_sizes.shape[0])
    g, u = mxfp4_gmm(x_sorted, [(w_gate.packed, w_gate.scale), (w_up.packed, w_up.scale)],
                     group_sizes, impl=impl, block_m=bm)
    return g, u
