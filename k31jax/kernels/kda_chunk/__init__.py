"""KDA chunked forward and fused decode step (Pallas-Triton; the decode step also Pallas TPU),
the kernel paths of the KDA ops."""

from .mosaic_kda import cost_estimate as tpu_decode_cost_estimate
from .ops import CHUNK_SIZES, factor_diagonal, kda_chunked, kda_recurrent

__all__ = ["CHUNK_SIZES", "factor_diagonal", "kda_chunked", "kda_recurrent", "tpu_decode_cost_estimate"]
