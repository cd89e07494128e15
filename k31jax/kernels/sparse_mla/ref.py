"""The oracles for the sparse-MLA and indexer kernels: the XLA ops, unchanged.

`mla_attention_sparse_ref` gathers `[B, T, K, 576]` selected latent rows and runs the absorbed
form over them (attention.md §1.3, §3); `select_topk_ref` is the causal top-min(k, S) of the
lightning-indexer scores (attention.md §2-§4). Float64 NumPy references:
`tests/refs/attention.py` (`indexer_scores`, `indexer_select`, `mla_layer`) and the absorbed
sparse attention written from the spec in `tests/test_kernels_sparse_mla.py`.
"""

from ...ops._indexer import indexer_scores as indexer_scores_ref
from ...ops._indexer import select_topk as select_topk_ref
from ...ops._mla import absorb_query
from ...ops._mla import mla_attention_absorbed as mla_attention_absorbed_ref
from ...ops._mla import mla_attention_sparse as mla_attention_sparse_ref

__all__ = ["absorb_query", "indexer_scores_ref", "mla_attention_absorbed_ref",
           "mla_attention_sparse_ref", "select_topk_ref"]
