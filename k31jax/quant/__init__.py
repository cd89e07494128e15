"""MX number formats (MXFP4 / MXFP8) for k31jax.

Spec: ``shared/spec/mx_formats.md``. Element formats "e2m1" (MXFP4), "e4m3" and
"e5m2" (MXFP8), each with one E8M0 scale byte per block of 32 elements along one
axis (by default the last, the contraction axis of ``[out, in]`` weights).

Core (pure, jit-able; static format / rule / block / axis / dtype):
  quantize, dequantize, compute_scales, quantize_with_scales, decode_elements

Packed MXFP4 (the model's path):
  pack_fp4, unpack_fp4, mxfp4_quantize_packed, mxfp4_dequantize_packed,
  mxfp4_unpack_to_e4m3, mxfp4_block_max_histogram

Layouts (byte-exact converters, NumPy or jax in -> same kind out):
  from_compressed_tensors, to_compressed_tensors, stack_experts, unstack_experts,
  from_gpt_oss, to_gpt_oss, split_interleaved_rows, interleave_rows,
  f4_from_safetensors, f4_to_safetensors, e8m0_from_safetensors,
  e8m0_to_safetensors, check_scale_bytes

QAT:
  fake_quant (STE), mx_fake_quant_activations
"""

from k31jax.quant._formats import (
    DEFAULT_BLOCK,
    E2M1_VALUES,
    FORMATS,
    RULES,
    ElemFormat,
    FormatName,
    Rule,
    get_format,
)
from k31jax.quant._layouts import (
    CT_FORMAT,
    SAFETENSORS_E8M0,
    SAFETENSORS_F4,
    check_scale_bytes,
    e8m0_from_safetensors,
    e8m0_to_safetensors,
    f4_from_safetensors,
    f4_to_safetensors,
    from_compressed_tensors,
    from_gpt_oss,
    interleave_rows,
    split_interleaved_rows,
    stack_experts,
    to_compressed_tensors,
    to_gpt_oss,
    unstack_experts,
)
from k31jax.quant._mx import (
    compute_scales,
    decode_elements,
    dequantize,
    quantize,
    quantize_with_scales,
)
from k31jax.quant._pack import (
    mxfp4_block_max_histogram,
    mxfp4_dequantize_packed,
    mxfp4_quantize_packed,
    mxfp4_unpack_to_e4m3,
    pack_fp4,
    unpack_fp4,
)
from k31jax.quant._qat import fake_quant, mx_fake_quant_activations

__all__ = [
    "CT_FORMAT",
    "DEFAULT_BLOCK",
    "E2M1_VALUES",
    "FORMATS",
    "RULES",
    "SAFETENSORS_E8M0",
    "SAFETENSORS_F4",
    "ElemFormat",
    "FormatName",
    "Rule",
    "check_scale_bytes",
    "compute_scales",
    "decode_elements",
    "dequantize",
    "e8m0_from_safetensors",
    "e8m0_to_safetensors",
    "f4_from_safetensors",
    "f4_to_safetensors",
    "fake_quant",
    "from_compressed_tensors",
    "from_gpt_oss",
    "get_format",
    "interleave_rows",
    "mx_fake_quant_activations",
    "mxfp4_block_max_histogram",
    "mxfp4_dequantize_packed",
    "mxfp4_quantize_packed",
    "mxfp4_unpack_to_e4m3",
    "pack_fp4",
    "quantize",
    "quantize_with_scales",
    "split_interleaved_rows",
    "stack_experts",
    "to_compressed_tensors",
    "to_gpt_oss",
    "unpack_fp4",
    "unstack_experts",
]
