"""Pallas-Triton sparse absorbed-MLA attention over selected latent rows (attention.md §1.3, §3-§4).

One program = one query token × a block of BH heads × one split of its K selected slots.
Per block of BK slots it gathers the selected latent rows `κ_s = [c_kv_s ; k_pe_s]` straight
from the cache by index (no `[B, T, K, 576]` gather in HBM), computes
`logits = (q̃ · c_kv + q_pe · k_pe) · scale` for all BH heads with two matmuls (MQA: one key
per slot shared by every head), and runs an online softmax with `ô = Σ p · c_kv` accumulated
in fp32. The selection is shared by all heads (attention.md §3), so each row is read once
per head block.

Slot codes: 1 = selected, 0 = a real slot that is not a candidate (its logit becomes
`finfo(f32).min`, exactly the XLA op's masked softmax, so a query with no candidate gets a
uniform average instead of NaN), −1 = padding (logit −inf, never contributes).

Decode (one query per sequence) splits the K slots over `n_split` programs (flash-decoding) so
a small batch still fills the GPU; each split writes its normalised partial output with its
running max and sum, and `combine_splits` merges them. Prefill uses one split per query.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._common import call

F32 = jnp.float32
NEG = float(jnp.finfo(jnp.float32).min)


def _sparse_kernel(q_ref, qpe_ref, ckv_ref, kpe_ref, idx_ref, code_ref, o_ref, m_ref, l_ref, *,
                   seq_len: int, block_h: int, block_k: int, blocks_per_split: int, scale: float,
                   prec):
    n, hb, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b = n // seq_len
    heads = pl.ds(hb * block_h, block_h)
    q = q_ref[n, heads, :]  # [BH, R]
    q_pe = qpe_ref[n, heads, :]  # [BH, P]
    dims = (((1,), (1,)), ((), ()))

    def body(kb, carry):
        m, l, acc = carry
        slots = pl.ds((sp * blocks_per_split + kb) * block_k, block_k)
        ids = idx_ref[n, slots]  # [BK]
        code = code_ref[n, slots]
        kv = ckv_ref[b, ids, :]  # [BK, R] gathered latent rows
        kp = kpe_ref[b, ids, :]  # [BK, P]
        s = (jax.lax.dot_general(q, kv, dims, precision=prec, preferred_element_type=F32)
             + jax.lax.dot_general(q_pe, kp, dims, precision=prec, preferred_element_type=F32)) * scale
        s = jnp.where(code[None, :] > 0, s, jnp.where(code[None, :] == 0, NEG, -jnp.inf))
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a split made only of padding
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        pv = jax.lax.dot_general(p.astype(kv.dtype), kv, (((1,), (0,)), ((), ())),
                                 precision=prec, preferred_element_type=F32)
        return m_new, alpha * l + jnp.sum(p, axis=1), alpha[:, None] * acc + pv

    init = (jnp.full((block_h,), -jnp.inf, F32), jnp.zeros((block_h,), F32),
            jnp.zeros((block_h, q.shape[1]), F32))
    m, l, acc = jax.lax.fori_loop(0, blocks_per_split, body, init)
    o_ref[n, sp, heads, :] = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
    m_ref[n, sp, heads] = m
    l_ref[n, sp, heads] = l


def sparse_latent_attention(q_lat, q_pe, c_kv, k_pe, idx, code, *, seq_len: int, scale: float,
                            n_split: int, impl: str, block_h: int, block_k: int = 32):
    """Padded inputs: q_lat `[N, Hp, R]`, q_pe `[N, Hp, P]` (N = B·T, compute dtype),
    c_kv `[B, S, R]`, k_pe `[B, S, P]`, idx / code `[N, Kp]` int32 with
    Kp % (n_split·block_k) == 0. Returns per-split (o `[N, n_split, Hp, R]` fp32, normalised;
    m, l `[N, n_split, Hp]`)."""
    n, hp, r = q_lat.shape
    kp = idx.shape[1]
    per_split = kp // (n_split * block_k)
    prec = jax.lax.Precision.HIGHEST if c_kv.dtype == F32 else jax.lax.Precision.DEFAULT
    fn = call(
        lambda *refs: _sparse_kernel(*refs, seq_len=seq_len, block_h=block_h, block_k=block_k,
                                     blocks_per_split=per_split, scale=scale, prec=prec),
        out_shape=(jax.ShapeDtypeStruct((n, n_split, hp, r), F32),
                   jax.ShapeDtypeStruct((n, n_split, hp), F32),
                   jax.ShapeDtypeStruct((n, n_split, hp), F32)),
        grid=(n, hp // block_h, n_split), impl=impl, num_warps=4 if block_h <= 16 else 8,
        num_stages=2, name="sparse_mla")
    return fn(q_lat, q_pe, c_kv, k_pe, idx, code)


def combine_splits(o, m, l):
    """Merge split partials: `Σ_s e^{m_s−M} l_s o_s / Σ_s e^{m_s−M} l_s` (fp32)."""
    if o.shape[1] == 1:
        return o[:, 0]
    mx = jnp.max(m, axis=1, keepdims=True)
    wgt = jnp.exp(m - jnp.where(mx == -jnp.inf, 0.0, mx)) * l  # [N, n_split, Hp]
    return jnp.einsum("nsh,nshr->nhr", wgt, o, precision=jax.lax.Precision.HIGHEST) / jnp.sum(
        wgt, axis=1)[..., None]
