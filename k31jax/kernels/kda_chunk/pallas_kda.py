"""Pallas-Triton kernels for Kimi Delta Attention (kda.md §4-§6): chunked forward + decode step.

Chunked forward = two launches (the fla split), all fp32:

1. `intra` — grid (B, n_chunks, H), fully parallel. Per chunk (C rows, 16-row sub-chunks):
   `A = (Q ⊙ E) Kᵀ` (j ≤ i), `M = β (K ⊙ E) Kᵀ` (j < i), the UT inverse `T = (I + M)^{-1}` by
   forward substitution, then `U = T (β V)` and `W = T (β K ⊙ e^Γ)`.
   Pairwise decays `E_ij = e^{Γ_i − Γ_j}` are never materialised as `[C, C, dk]`:
   - off-diagonal 16-row tiles factor around the first row n of the later tile,
     `e^{Γ_i−Γ_n} · e^{Γ_n−Γ_j}`, both factors ≤ 1 (safe for any gate, kda.md §6b);
   - diagonal tiles, *only with the lower-bounded gate*, factor around the tile's middle row m
     (every factor ≤ e^{8|lb|} = e^40 at lb = −5, inside fp32);
   - diagonal tiles otherwise (softplus gate, Γ unbounded) are built column by column with the
     explicit masked decay `exp(where(i ≥ j, Γ_i − Γ_j, −inf))` (kda.md §6a).
2. `inter` — grid (B, H, dv / BV), sequential over chunks with the fp32 state `[dk, BV]` in
   registers: `V' = U − W S`, `O = (Q ⊙ e^Γ) S + A V'`, `S ← e^{Γ_C} S + (K ⊙ e^{Γ_C − Γ})ᵀ V'`.

Decode: `step` — grid (B, H, dv / BV): decay, read, delta write and read-out of one token, the
state updated in place (input/output aliasing).

Layouts: activations `[B, T, H, d]` (T padded to a multiple of C, d to a power of two ≥ 16),
`Γ` is the chunk-local cumulative sum of g; the state is key-major `[B, H, dk, dv]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._common import call

F32 = jnp.float32
SUB = 16  # sub-chunk rows (fla's BC)


def _dot(a, b, prec):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=F32)


def _dot_nt(a, b, prec):  # a @ b.T
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=F32)


def _dot_tn(a, b, prec):  # a.T @ b
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=prec, preferred_element_type=F32)


def _intra_kernel(q_ref, k_ref, v_ref, gam_ref, beta_ref, a_ref, w_ref, u_ref, *,
                  chunk: int, factor_diag: bool, prec):
    b, c, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t0 = c * chunk
    rows = pl.ds(t0, chunk)
    k_all = k_ref[b, rows, h, :]  # [C, dk]
    g_all = gam_ref[b, rows, h, :]
    beta_all = beta_ref[b, rows, h]  # [C]
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    col_c = col[:, None]  # [C, 1]: a row index of k_all
    col_r = col[None, :]  # [1, C]: a column index of A / M
    sub = jax.lax.broadcasted_iota(jnp.int32, (SUB,), 0)
    t_inv = jnp.zeros((chunk, chunk), F32)

    for tile in range(chunk // SUB):
        r0 = tile * SUB
        sl = pl.ds(t0 + r0, SUB)
        q_i = q_ref[b, sl, h, :]  # [SUB, dk]
        k_i = k_ref[b, sl, h, :]
        g_i = gam_ref[b, sl, h, :]
        beta_i = beta_ref[b, sl, h]  # [SUB]
        row_i = r0 + sub[:, None]  # [SUB, 1]: this tile's rows within the chunk
        a_blk = jnp.zeros((SUB, chunk), F32)
        m_blk = jnp.zeros((SUB, chunk), F32)
        if tile > 0:  # off-diagonal tiles (all earlier rows) in one matmul, around row n = r0
            g_n = gam_ref[b, t0 + r0, h, :]  # [dk]
            fac = jnp.exp(g_i - g_n[None, :])  # Γ_i − Γ_n ≤ 0
            k_e = k_all * jnp.exp(jnp.where(col_c < r0, g_n[None, :] - g_all, -jnp.inf))
            a_blk = a_blk + _dot_nt(q_i * fac, k_e, prec)
            m_blk = m_blk + _dot_nt(k_i * fac, k_e, prec)
        if factor_diag:  # lower-bounded gate: the diagonal tile as matmuls around its middle row
            g_m = gam_ref[b, t0 + r0 + SUB // 2, h, :]
            fac = jnp.exp(g_i - g_m[None, :])
            in_tile = (col_c >= r0) & (col_c < r0 + SUB)
            k_d = k_all * jnp.exp(jnp.where(in_tile, g_m[None, :] - g_all, -jnp.inf))
            a_blk = a_blk + jnp.where(col_r <= row_i, _dot_nt(q_i * fac, k_d, prec), 0.0)
            m_blk = m_blk + jnp.where(col_r < row_i, _dot_nt(k_i * fac, k_d, prec), 0.0)
        else:  # any gate: explicit masked pairwise decay, one column j of the tile at a time

            def col_step(jj, carry, r0=r0, q_i=q_i, k_i=k_i, g_i=g_i):
                a_acc, m_acc = carry
                k_j = k_ref[b, t0 + r0 + jj, h, :]
                g_j = gam_ref[b, t0 + r0 + jj, h, :]
                e = jnp.exp(jnp.where(sub[:, None] >= jj, g_i - g_j[None, :], -jnp.inf))
                a_col = jnp.sum(q_i * k_j[None, :] * e, axis=1)
                m_col = jnp.where(sub > jj, jnp.sum(k_i * k_j[None, :] * e, axis=1), 0.0)
                sel = col_r == r0 + jj
                return (a_acc + jnp.where(sel, a_col[:, None], 0.0),
                        m_acc + jnp.where(sel, m_col[:, None], 0.0))

            a_blk, m_blk = jax.lax.fori_loop(0, SUB, col_step, (a_blk, m_blk))
        m_blk = beta_i[:, None] * m_blk
        a_ref[b, sl, h, :] = a_blk

        def row_step(r, t_acc, r0=r0, m_blk=m_blk):  # T_i = e_i − Σ_{j<i} M_ij T_j
            i = r0 + r
            m_row = jnp.sum(jnp.where(sub[:, None] == r, m_blk, 0.0), axis=0)  # [C]
            t_row = jnp.where(col == i, 1.0, 0.0) - jnp.sum(m_row[:, None] * t_acc, axis=0)
            return jnp.where(col_c == i, t_row[None, :], t_acc)

        t_inv = jax.lax.fori_loop(0, SUB, row_step, t_inv)

    v_all = v_ref[b, rows, h, :]
    u_ref[b, rows, h, :] = _dot(t_inv, beta_all[:, None] * v_all, prec)
    w_ref[b, rows, h, :] = _dot(t_inv, beta_all[:, None] * k_all * jnp.exp(g_all), prec)


def _inter_kernel(q_ref, k_ref, gam_ref, w_ref, u_ref, a_ref, s0_ref, o_ref, s_ref, *,
                  chunk: int, block_v: int, n_chunks: int, prec):
    b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(vb * block_v, block_v)
    state = s0_ref[b, h, :, cols]  # [dk, BV] fp32

    def step(c, s):
        t0 = c * chunk
        rows = pl.ds(t0, chunk)
        q = q_ref[b, rows, h, :]
        k = k_ref[b, rows, h, :]
        g = gam_ref[b, rows, h, :]
        g_last = gam_ref[b, t0 + chunk - 1, h, :]  # Γ_C [dk]
        pseudo_v = u_ref[b, rows, h, cols] - _dot(w_ref[b, rows, h, :], s, prec)
        o = _dot(q * jnp.exp(g), s, prec) + _dot(a_ref[b, rows, h, :], pseudo_v, prec)
        o_ref[b, rows, h, cols] = o
        return (jnp.exp(g_last)[:, None] * s
                + _dot_tn(k * jnp.exp(g_last[None, :] - g), pseudo_v, prec))

    state = jax.lax.fori_loop(0, n_chunks, step, state)
    s_ref[b, h, :, cols] = state


PRECISIONS = {
    "highest": jax.lax.Precision.HIGHEST,  # IEEE fp32 (Triton input_precision="ieee")
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,  # ~fp32 on tensor cores; GPU only
}


def dot_precision(name: str, impl: str):
    """The dot precision for the kernel; the CPU interpreter has no 3xTF32, so it uses fp32."""
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r}: expected one of {tuple(PRECISIONS)}")
    return PRECISIONS["highest" if impl == "interpret" else name]


def kda_chunk_fwd(q, k, v, gamma, beta, state, *, chunk: int, factor_diag: bool, impl: str,
                  block_v: int = 64, precision: str = "highest"):
    """The two launches on padded fp32 inputs. q, k, gamma `[B, Tp, H, DK]`, v `[B, Tp, H, DV]`,
    beta `[B, Tp, H]`, state `[B, H, DK, DV]`; Tp % chunk == 0, chunk % 16 == 0, all tile
    widths powers of two. Returns (o `[B, Tp, H, DV]`, final state)."""
    bsz, tp, h, dk = q.shape
    dv = v.shape[-1]
    n = tp // chunk
    bv = min(block_v, dv)
    prec = dot_precision(precision, impl)
    warps = 8 if dk * chunk >= 8192 else 4  # [C, dk] fp32 tiles: spread them over 8 warps
    intra = call(
        lambda *r: _intra_kernel(*r, chunk=chunk, factor_diag=factor_diag, prec=prec),
        out_shape=(jax.ShapeDtypeStruct((bsz, tp, h, chunk), F32),
                   jax.ShapeDtypeStruct((bsz, tp, h, dk), F32),
                   jax.ShapeDtypeStruct((bsz, tp, h, dv), F32)),
        grid=(bsz, n, h), impl=impl, num_warps=warps, num_stages=1, name="kda_chunk_intra")
    a, w, u = intra(q, k, v, gamma, beta)
    inter = call(
        lambda *r: _inter_kernel(*r, chunk=chunk, block_v=bv, n_chunks=n, prec=prec),
        out_shape=(jax.ShapeDtypeStruct((bsz, tp, h, dv), F32),
                   jax.ShapeDtypeStruct((bsz, h, dk, dv), F32)),
        grid=(bsz, h, dv // bv), impl=impl, num_warps=warps, num_stages=2, name="kda_chunk_inter")
    return inter(q, k, gamma, w, u, a, state)


def _step_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_in_ref, o_ref, s_ref, *, block_v: int):
    b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(vb * block_v, block_v)
    s = s_in_ref[b, h, :, cols]  # [dk, BV]
    k = k_ref[b, h, :]
    s = s * jnp.exp(g_ref[b, h, :])[:, None]  # 1. decay key rows
    read = jnp.sum(s * k[:, None], axis=0)  # 2. S̃ᵀ k
    s = s + (beta_ref[b, h] * k)[:, None] * (v_ref[b, h, cols] - read)[None, :]  # 3. delta write
    o_ref[b, h, cols] = jnp.sum(s * q_ref[b, h, :][:, None], axis=0)  # 4. read-out after write
    s_ref[b, h, :, cols] = s


def kda_decode_step(q, k, v, g, beta, state, *, impl: str, block_v: int = 64):
    """One token: q, k, g `[B, H, DK]`, v `[B, H, DV]`, beta `[B, H]`, state `[B, H, DK, DV]`
    (updated in place). Returns (o `[B, H, DV]`, new state), fp32."""
    bsz, h, dk = q.shape
    dv = v.shape[-1]
    bv = min(block_v, dv)
    fn = call(lambda *r: _step_kernel(*r, block_v=bv),
              out_shape=(jax.ShapeDtypeStruct((bsz, h, dv), F32),
                         jax.ShapeDtypeStruct((bsz, h, dk, dv), F32)),
              grid=(bsz, h, dv // bv), impl=impl, num_warps=4, num_stages=1,
              input_output_aliases={5: 1}, name="kda_decode_step")
    return fn(q, k, v, g, beta, state)
