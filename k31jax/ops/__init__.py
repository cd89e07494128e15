"""Pure functional ops (no NNX), each with a float64 NumPy reference in `tests/refs/`.

Dtype policy: inputs may be bf16; every "fp32 island" named in the spec (norm statistics,
gates, KDA recurrence, attention softmax, router, MoE combine) upcasts internally.

The hot paths have one kernel seam (`impl: Impl`, resolved by `resolve_impl`: the Pallas
kernels of `k31jax.kernels` or the XLA path); the forms of one computation have their own
names and types (`routed_experts(form: MoeForm)`, `SparseForm`, `EpExchange`). The model and
the engine take the whole choice as one `Backends` object. `ep_routed_experts` runs the routed experts expert-parallel under a mesh.
"""

from ._activations import glu, situ_glu, swiglu
from ._attn_res import attn_res_mix
from ._impl import (IMPLS, MOE_FORMS, Backends, EpExchange, Impl, ImplChoice, MoeForm, SparseForm, resolve_impl,
                    tpu_kernel_layout)
from ._indexer import indexer_keys, indexer_queries, indexer_scores, select_topk, selection_mask
from ._kda import kda_chunked, kda_gate, kda_mask_padding, kda_recurrent, short_conv, softplus_thresholded
from ._mla import absorb_query, mla_attention, mla_attention_absorbed, mla_attention_logits, mla_attention_sparse
from ._moe import (MXFP4Weight, blocked_rows, combine, expert_window, grouped_matmul, grouped_matmul_blocked,
                   ExpertAdapter, materialize, permute, routed_experts, visit_selected_experts)
from ._moe_ep import EXCHANGES, EPPlan, ep_routed_experts, exchange_rounds, make_ep_plan, ragged_exchange
from ._norms import l2_normalize, layer_norm, rms_norm
from ._router import route, router_scores

__all__ = [
    "EXCHANGES", "EPPlan", "EpExchange", "IMPLS", "Impl", "ImplChoice", "MOE_FORMS", "MoeForm", "SparseForm",
    "Backends", "ep_routed_experts", "exchange_rounds", "make_ep_plan", "ragged_exchange", "resolve_impl", "tpu_kernel_layout",
    "MXFP4Weight", "absorb_query", "attn_res_mix", "blocked_rows", "combine", "glu", "grouped_matmul",
    "grouped_matmul_blocked",
    "indexer_keys", "indexer_queries", "indexer_scores", "kda_chunked", "kda_gate",
    "kda_mask_padding", "kda_recurrent", "l2_normalize", "layer_norm", "mla_attention",
    "mla_attention_absorbed", "mla_attention_logits", "mla_attention_sparse", "materialize", "permute", "rms_norm", "route",
    "ExpertAdapter", "routed_experts", "router_scores", "select_topk", "selection_mask", "short_conv", "situ_glu",
    "softplus_thresholded", "swiglu", "expert_window", "visit_selected_experts",
]
