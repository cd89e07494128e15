"""Pallas-Triton lightning-indexer scores (architecture.md §10, attention.md §2, §4).

`I_{t,s} = dI^-½ · Σ_j w_{t,j} · ReLU(q_{t,j} · k_s)`, causal / validity mask → −inf, fp32.
One program = one query token × a block of BS keys: `[BS, dI] @ [dI, HI]`, ReLU, the head
weights and the head sum fused, so the XLA path's `[B, T, HI, S]` fp32 intermediate (256 MB
per token at S = 1M, HI = 64) is never written. The top-k runs on the `[B, T, S]` scores
(`lax.top_k`, ties to the lower index as in `ops.select_topk`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._common import call

F32 = jnp.float32


def _score_kernel(q_ref, w_ref, k_ref, qpos_ref, kvalid_ref, o_ref, *, seq_len: int,
                  block_s: int, inv_sqrt_d: float, prec):
    n, sb = pl.program_id(0), pl.program_id(1)
    b = n // seq_len
    keys = pl.ds(sb * block_s, block_s)
    dots = jax.lax.dot_general(k_ref[b, keys, :], q_ref[n], (((1,), (1,)), ((), ())),
                               precision=prec, preferred_element_type=F32)  # [BS, HI]
    sc = jnp.sum(jnp.maximum(dots, 0.0) * w_ref[n][None, :], axis=1) * inv_sqrt_d
    pos = sb * block_s + jax.lax.broadcasted_iota(jnp.int32, (block_s,), 0)
    ok = (pos <= qpos_ref[n]) & (kvalid_ref[b, keys] != 0)
    o_ref[n, keys] = jnp.where(ok, sc, -jnp.inf)


def indexer_scores_masked(q, w, k, q_pos, key_valid, *, seq_len: int, head_dim: int, impl: str,
                          block_s: int = 64, prec=jax.lax.Precision.HIGHEST):
    """Padded inputs: q `[N, HIp, dIp]` f32, w `[N, HIp]`, k `[B, Sp, dIp]` (Sp % block_s == 0),
    q_pos `[N]` int32, key_valid `[B, Sp]` int32. Returns masked scores `[N, Sp]` fp32."""
    n = q.shape[0]
    sp = k.shape[1]
    fn = call(
        lambda *refs: _score_kernel(*refs, seq_len=seq_len, block_s=block_s,
                                    inv_sqrt_d=float(head_dim) ** -0.5, prec=prec),
        out_shape=jax.ShapeDtypeStruct((n, sp), F32), grid=(n, sp // block_s), impl=impl,
        num_warps=4, num_stages=2, name="indexer_scores")
    return fn(q, w, k, q_pos, key_valid)
