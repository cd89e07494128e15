"""GPU Pallas kernels for the hot paths, reached through the ops' `impl=` seam.

- `kda_chunk`: KDA chunked forward (intra-chunk UT solve + inter-chunk state pass) and the
  fused single-token decode step (`ops.kda_chunked`, `ops.kda_recurrent`);
- `sparse_mla`: sparse gated-MLA attention over selected latent rows (decode with split-K,
  prefill with a per-query selection) and the lightning-indexer decode scores + top-k
  (`ops.mla_attention_sparse`, `ops.select_topk`);
- `mxfp4_matmul`: grouped expert matmul with packed MXFP4 weights dequantised in-kernel
  (down, and fused gate/up) (`ops.grouped_matmul`, `ops.routed_experts`).

Each package has `ref.py` (the XLA op it must match), `pallas_*.py` (the kernels) and `ops.py`
(the kernel path of the op: padding, launch, unpadding; `impl` is "pallas" or "interpret").
The ops choose between their XLA path and these (`k31jax.ops._impl.resolve_impl`: the kernel
on a GPU, XLA elsewhere) and give the kernels the XLA path's gradient.
"""

from ..ops._impl import IMPLS, resolve_impl

__all__ = ["IMPLS", "resolve_impl"]
