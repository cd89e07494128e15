"""Sparse gated-MLA attention (decode split-K, prefill) and indexer decode top-k (Pallas-Triton)."""

from .ops import head_block, indexer_scores, mla_attention_sparse, select_topk

__all__ = ["head_block", "indexer_scores", "mla_attention_sparse", "select_topk"]
