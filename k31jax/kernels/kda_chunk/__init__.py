"""KDA chunked forward and fused decode step (Pallas-Triton), behind an `impl` seam."""

from .ops import factor_diagonal, kda_chunked, kda_recurrent

__all__ = ["factor_diagonal", "kda_chunked", "kda_recurrent"]
