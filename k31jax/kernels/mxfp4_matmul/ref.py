"""The oracle for the MXFP4 grouped matmul: the XLA op, unchanged — dequantise the packed
weights in-graph (`materialize` -> `mxfp4_dequantize_packed`), then `lax.ragged_dot_general`
with fp32 accumulation (mx_formats.md §1.3, §4). The float64 NumPy check is in
`tests/test_kernels_mxfp4.py` (E2M1 table × 2^(scale−127), a per-expert loop)."""

from ...ops._moe import MXFP4Weight, grouped_matmul, materialize

grouped_matmul_ref = grouped_matmul

__all__ = ["MXFP4Weight", "grouped_matmul_ref", "materialize"]
