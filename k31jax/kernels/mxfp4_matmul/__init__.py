"""MXFP4 grouped expert matmul (down, fused gate/up) with in-kernel dequantisation: Pallas-Triton
and Pallas TPU (Mosaic, with its activation gradient and fp8 MXU inputs where the TPU takes them)."""

from .ops import FP8_MXU_KINDS, block_rows, grouped_matmul, grouped_matmul_gate_up, mxu_inputs

__all__ = ["FP8_MXU_KINDS", "block_rows", "grouped_matmul", "grouped_matmul_gate_up", "mxu_inputs"]
