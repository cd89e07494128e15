"""Sparse gated-MLA attention (decode split-K, prefill) and indexer decode top-k (Pallas-Triton);
the sparse latent attention and the indexer's masked scores as Pallas TPU (Mosaic) kernels."""

from .mosaic_sparse_mla import tile_rows
from .ops import (head_block, indexer_scores, indexer_topk_tpu, latent_attention_sparse_tpu, mla_attention_sparse,
                  select_topk)

__all__ = ["head_block", "indexer_scores", "indexer_topk_tpu", "latent_attention_sparse_tpu", "mla_attention_sparse",
           "select_topk", "tile_rows"]
