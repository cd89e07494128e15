"""KDA chunked forward and fused decode step (Pallas-Triton; the decode step also Pallas TPU),
the kernel paths of the KDA ops."""

from .ops import CHUNK_SIZES, factor_diagonal, kda_chunked, kda_recurrent

__all__ = ["CHUNK_SIZES", "factor_diagonal", "kda_chunked", "kda_recurrent"]
