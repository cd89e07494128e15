"""Pallas kernels for the hot paths, reached through the ops' one `impl=` seam
(`k31jax.ops.resolve_impl`; the ops give each kernel its XLA path's gradient, but the Mosaic
MXFP4 grouped matmul, which has its own). Pallas-Triton (GPU) and Pallas TPU (Mosaic) for all of
them: the MXFP4 grouped matmul and its activation gradient (`mxfp4_matmul.mosaic_mxfp4_gmm`),
the KDA chunked forward and decode step (`kda_chunk.mosaic_kda_chunk`, `kda_chunk.mosaic_kda`),
the sparse MLA attention over the selected rows (`sparse_mla.mosaic_sparse_mla`) and the
indexer's masked scores (`sparse_mla.mosaic_indexer`); "pallas" picks the Mosaic ones for a TPU
(`kernel_platform`, `tpu_device_kind`).

- `kda_chunk`: KDA chunked forward (intra-chunk UT solve + inter-chunk state pass) and the
  fused single-token decode step (kernel paths of `ops.kda_chunked`, `ops.kda_recurrent`);
- `sparse_mla`: sparse gated-MLA attention over selected latent rows (decode with split-K,
  prefill with a per-query selection) and the lightning-indexer decode scores + top-k
  (`ops.mla_attention_sparse`, `ops.select_topk`);
- `mxfp4_matmul`: grouped expert matmul with packed MXFP4 weights dequantised in-kernel
  (down, and fused gate/up) (`ops.grouped_matmul`, `ops.routed_experts`).

Each package has `pallas_*.py` (the Triton kernels), `mosaic_*.py` where a TPU kernel exists,
and `ops.py` (the kernel path of the op: padding, launch, unpadding; `impl` is "pallas",
"interpret" or "interpret_tpu"). This layer sits below
`k31jax.ops` and never imports it: the XLA paths the kernels are tested against are the ops.
"""

from . import kda_chunk, mxfp4_matmul, sparse_mla
from ._common import kernel_platform, lowering_only, runs_mosaic, target_tpu, tpu_device_kind

__all__ = ["kda_chunk", "kernel_platform", "lowering_only", "mxfp4_matmul", "runs_mosaic", "sparse_mla", "target_tpu",
           "tpu_device_kind"]
