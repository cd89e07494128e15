"""MXFP4 grouped expert matmul (down, fused gate/up) with in-kernel dequantisation (Pallas-Triton)."""

from .ops import block_rows, grouped_matmul, grouped_matmul_gate_up

__all__ = ["block_rows", "grouped_matmul", "grouped_matmul_gate_up"]
