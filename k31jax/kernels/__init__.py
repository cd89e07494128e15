"""GPU Pallas kernels for the hot paths, each behind `impl ∈ {"xla", "pallas", "interpret"}`.

- `kda_chunk`: KDA chunked forward (intra-chunk UT solve + inter-chunk state pass) and the
  fused single-token decode step;
- `sparse_mla`: sparse gated-MLA attention over selected latent rows (decode with split-K,
  prefill with a per-query selection) and the lightning-indexer decode scores + top-k;
- `mxfp4_matmul`: grouped expert matmul with packed MXFP4 weights dequantised in-kernel
  (down, and fused gate/up).

Each package has `ref.py` (the XLA op it must match), `pallas_*.py` (the kernels) and `ops.py`
(the seam; default "pallas" on a GPU backend, "xla" elsewhere). The ops in `k31jax.ops` take
an optional `impl=` that defaults to their XLA path and forwards here.
"""

from ._common import IMPLS, resolve_impl

__all__ = ["IMPLS", "resolve_impl"]
