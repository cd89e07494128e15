"""MX number formats (MXFP4 / MXFP8) for k31jax.

Spec: ``docs/mx_formats.md``. Element formats "e2m1" (MXFP4), "e4m3" and
"e5m2" (MXFP8), each with one E8M0 scale byte per block of 32 elements along one
axis (by default the last, the contraction axis of ``[out, in]`` weights).

- Core (pure, jit-able; static format / rule / block / axis / dtype): ``quantize``,
  ``dequantize``, ``compute_scales``, ``quantize_with_scales``, ``decode_elements``.
- Packed MXFP4 (the model's storage): ``MXFP4Weight`` (and ``MXFP4KernelWeight``, the Pallas
  TPU kernel's layout: ``kernel_layout``, ``mxfp4_weight``), ``pack_fp4``, ``unpack_fp4``,
  ``mxfp4_quantize_packed``, ``mxfp4_dequantize_packed``, ``mxfp4_unpack_to_e4m3``,
  ``mxfp4_block_max_histogram``.
- QAT: ``fake_quant`` (straight-through), ``mx_fake_quant_activations``.
- Scale bytes for kernels: ``E8M0_BIAS``, ``E8M0_NAN``, ``split_pow2`` (an exact ``2**k``
  as two normal f32 factors).
"""

from k31jax.quant._formats import E8M0_BIAS, E8M0_NAN, FORMATS, RULES, get_format, split_pow2
from k31jax.quant._mx import compute_scales, decode_elements, dequantize, quantize, quantize_with_scales
from k31jax.quant._pack import (
    MXFP4KernelWeight,
    MXFP4Weight,
    code_bytes,
    kernel_layout,
    kernel_scale_rows,
    mxfp4_block_max_histogram,
    mxfp4_dequantize_packed,
    mxfp4_dequantize_packed_bf16,
    mxfp4_quantize_packed,
    mxfp4_unpack_to_e4m3,
    mxfp4_weight,
    pack_fp4,
    scale_bytes,
    scale_tiles,
    tile_scales,
    unpack_fp4,
    words_view,
)
from k31jax.quant._qat import fake_quant, mx_fake_quant_activations

__all__ = [
    "E8M0_BIAS", "E8M0_NAN", "FORMATS", "MXFP4KernelWeight", "MXFP4Weight", "RULES", "compute_scales", "decode_elements", "dequantize", "fake_quant", "kernel_layout", "kernel_scale_rows",
    "get_format", "mx_fake_quant_activations", "mxfp4_block_max_histogram", "mxfp4_dequantize_packed",
    "mxfp4_dequantize_packed_bf16", "mxfp4_quantize_packed", "mxfp4_unpack_to_e4m3", "mxfp4_weight", "pack_fp4", "quantize", "quantize_with_scales", "scale_bytes", "scale_tiles", "split_pow2", "tile_scales",
    "unpack_fp4",
]
