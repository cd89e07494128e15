"""The kernel path of `ops.grouped_matmul` for packed `MXFP4Weight`s (`impl` "pallas" |
"interpret" | "interpret_tpu"), and the fused gate/up launch `ops.routed_experts` uses.

"pallas" is the target platform's kernel (`kernel_platform`): the Mosaic kernel
(`mosaic_mxfp4_gmm`) for a TPU, the Triton one (`pallas_mxfp4_gmm`) otherwise; "interpret"
runs the Triton body and "interpret_tpu" the Mosaic body (TPU semantics) on any backend.

Dtype policy: activations bf16 (or f32); the E2M1 codes are decoded in-kernel to exact values
in the activation dtype, products accumulate in fp32 and each 32-block's E8M0 scale is applied
to its fp32 partial product (exact powers of two), the result is cast back to the activation
dtype — the contract of `ops.grouped_matmul`, equal to it up to fp32 accumulation order.
Float (non-MXFP4) weights (including the QAT fake-quant path) are the op's XLA path only.

MXU inputs: bf16 (x's dtype) on every TPU but where the MXU multiplies fp8 natively
(`FP8_MXU_KINDS`) and the activations are MXFP8 already (`mxfp8_activations`): there both sides
go in as e4m3, exactly (`mosaic_mxfp4_gmm`'s docstring; a tile whose values e4m3 cannot hold
exactly takes bf16).

Gradients: the Mosaic path differentiates itself — the activation gradient is the transposed
kernel (`mosaic_mxfp4_gmm.mxfp4_gmm_dx_tpu`: the packed experts decoded in VMEM again, never
widened in HBM), and the packed weights, frozen integer codes, get none — so the ops call it
without `with_reference_grad`. The Triton path takes the XLA path's gradient.
"""

from __future__ import annotations

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from ...quant import MXFP4KernelWeight, MXFP4Weight, kernel_layout
from .._common import pow2_at_least, runs_mosaic, tpu_device_kind
from .mosaic_mxfp4_gmm import mxfp4_gmm_dx_tpu, mxfp4_gmm_tpu
from .pallas_mxfp4_gmm import mxfp4_gmm


# The TPU generations whose MXU multiplies fp8 (e4m3) natively: TPU7x (Ironwood). v5e, v5p and
# v6e multiply bf16 (and int8), so fp8 operands would be widened to bf16 first, for nothing.
FP8_MXU_KINDS = ("TPU7x",)


def mxu_inputs(mxfp8_activations: bool) -> str:
    """The Mosaic kernel's MXU inputs for the TPU being built for (`tpu_device_kind`): "fp8" where
    its MXU takes fp8 and the activations are MXFP8 (e4m3 values already), else "bf16"."""
    return "fp8" if mxfp8_activations and tpu_device_kind() in FP8_MXU_KINDS else "bf16"


def block_rows(m: int, n_groups: int) -> int:
    """Rows per tile: about the mean group size, a power of two in [16, 128]."""
    return min(128, pow2_at_least(m // max(n_groups, 1)))


def _tpu_pairs(weights) -> tuple[list, object]:
    """The Mosaic kernel's (words, scale) pairs and layer row: a state held in the kernel layout
    (one scale part) is read where it lies; any other layout is converted here, a transpose of
    the layer in every call."""
    if all(isinstance(w, MXFP4KernelWeight) and w.scale.shape[-3] == 1 for w in weights) and \
            len({w.row is None for w in weights}) == 1:
        return [(w.packed, w.scale) for w in weights], [w.row for w in weights]
    return [kernel_layout(*w.as_bytes()[:2]) for w in weights], None


def _launch(x_sorted, weights, group_sizes, impl: str, block_m: int, out_dtype=None, expected_rows=None,
            mxfp8_activations: bool = False):
    """One launch of the platform's kernel over `weights` (`MXFP4Weight`s of any layout); the
    results in `out_dtype` (default x's; the Mosaic kernel stores its f32 accumulators in it,
    the Triton one rounds to x's dtype first). `expected_rows`: the rows expected in groups
    (default all), for the Mosaic kernel's cost estimate; `mxfp8_activations`: x holds MXFP8
    values (`mxu_inputs`)."""
    if runs_mosaic(impl):
        return _mosaic_launch(x_sorted, tuple(weights), group_sizes, block_m=block_m, out_dtype=out_dtype,
                              expected_rows=expected_rows or x_sorted.shape[0], interpret=impl == "interpret_tpu",
                              mxu=mxu_inputs(mxfp8_activations))
    pairs = [w.as_bytes()[:2] for w in weights]
    outs = mxfp4_gmm(x_sorted, pairs, group_sizes, impl=impl, block_m=block_m)
    return tuple(o.astype(out_dtype or o.dtype) for o in outs)


def _no_gradient(a):
    return np.zeros(np.shape(a), jax.dtypes.float0)


def _mosaic_launch(x_sorted, weights: tuple, group_sizes, *, block_m: int, out_dtype, expected_rows: int,
                   interpret: bool, mxu: str):
    """The Mosaic launch, differentiated by the transposed kernel (module docstring)."""

    @jax.custom_vjp
    def run(x, ws, sizes):
        pairs, row = _tpu_pairs(ws)
        return mxfp4_gmm_tpu(x, pairs, sizes, block_m=block_m, row=row, interpret=interpret, out_dtype=out_dtype,
                             expected_rows=expected_rows, mxu=mxu)

    def forward(x, ws, sizes):
        return run(x, ws, sizes), (ws, sizes)

    def backward(saved, dys):
        ws, sizes = saved
        pairs, row = _tpu_pairs(ws)
        dx = mxfp4_gmm_dx_tpu([d.astype(x_sorted.dtype) for d in dys], pairs, sizes, block_m=block_m, row=row,
                              interpret=interpret, expected_rows=expected_rows)
        return (dx, *jax.tree.map(_no_gradient, (ws, sizes)))

    run.defvjp(forward, backward)
    return run(x_sorted, weights, group_sizes)


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
    out_dtype=None,
    expected_rows: int | None = None,
    mxfp8_activations: bool = False,
) -> Float[Array, "M out"]:
    """The kernel path of `ops.grouped_matmul` (packed `MXFP4Weight` only); `out_dtype`: the
    result's (default x's); `expected_rows`, `mxfp8_activations`: see `_launch`."""
    _check_packed(w)
    bm = block_m or block_rows(x_sorted.shape[0], group_sizes.shape[0])
    (y,) = _launch(x_sorted, [w], group_sizes, impl, bm, out_dtype, expected_rows, mxfp8_activations)
    return y


def grouped_matmul_gate_up(
    x_sorted: Float[Array, "M in"],
    w_gate,
    w_up,
    group_sizes: Int[Array, "E"],
    *,
    impl: str = "pallas",
    block_m: int | None = None,
    expected_rows: int | None = None,
    mxfp8_activations: bool = False,
) -> tuple[Float[Array, "M out"], Float[Array, "M out"]]:
    """Gate and up projections of the same sorted rows in one launch (one activation read)."""
    _check_packed(w_gate)
    _check_packed(w_up)
    bm = block_m or block_rows(x_sorted.shape[0], group_sizes.shape[0])
    g, u = _launch(x_sorted, [w_gate, w_up], group_sizes, impl, bm, expected_rows=expected_rows,
                   mxfp8_activations=mxfp8_activations)
    return g, u
