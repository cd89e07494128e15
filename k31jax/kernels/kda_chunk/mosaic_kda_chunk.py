"""The KDA chunked (WY/UT) forward as a Pallas TPU (Mosaic) kernel (the TPU kernel path of
`ops.kda_chunked`, kda.md §5-§6).

One launch, grid (row, head, chunk): rows and heads are independent, chunks run in order with
the fp32 state `[dk, dv]` held in the state output's VMEM block (its block index does not change
along the chunk axis, so it stays on chip and is written back once per (row, head)). Per chunk
of C rows, everything of kda.md §5 happens in VMEM: nothing chunk-sized but o goes back to HBM
(the Triton path writes A, W and U out and reads them back in a second launch).

1. `A = (Q ⊙ E) Kᵀ` (j ≤ i) and `M = (βK ⊙ E) Kᵀ` (j < i) in 16-row tiles (kda.md §6b):
   off-diagonal columns as one MXU matmul per tile, factored around the tile's first row n,
   `e^{Γ_i−Γ_n} · e^{Γ_n−Γ_j}` (both ≤ 1); the diagonal `16 x 16` tile with the explicit masked
   pairwise decay `exp(where(j ≤ i, Γ_i−Γ_j, −inf))` as a `[16, 16, dk]` block (kda.md §6a).
   Nothing can overflow, whatever the gate.
2. The UT inverse `T = (I + M)^{-1}` by right-looking forward substitution on the vector unit
   (C steps; step l subtracts column l of M times row l of T from the rows below), exact fp32
   as the XLA path's row loop: no doubling product (which loses precision when M has large
   entries) and no MXU pass inside the recurrence.
3. `U = T (βV)`, `W = T (βK ⊙ e^Γ)`; `V' = U − W S`, `O = (Q ⊙ e^Γ) S + A V'`,
   `S ← e^{Γ_C} S + (K ⊙ e^{Γ_C − Γ})ᵀ V'` as MXU matmuls at `Precision.HIGHEST` (fp32 passes:
   a TPU's default fp32 matmul precision is not IEEE fp32).

The launch reads only the layer's own arrays, nothing prepared in HBM: tokens come as
`[B, T, H·d]` (a head's chunk is a `[C, d]` block along the lanes), β as `[B, T, H]` (a `[C, H]`
block, the head's column picked in VMEM), and the chunk-local cumulative gate
`Γ_i = Σ_{j ≤ i} g_j` is one matmul by the lower-triangular ones in VMEM (a cumsum in XLA
would write Γ to HBM and read it back: 2 of the launch's 6 token-sized passes). T is
zero-padded to a multiple of C (an exact identity step: g = 0, β = 0) and head widths to a
multiple of 128 (padded channels never decay a written value and are never written).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .mosaic_kda import check_inputs, lane_rows, padded_state

F32 = jnp.float32
LANES = 128
SUB = 16  # rows per tile of the decayed products (kda.md §6b)
CHUNK_SIZES = (16, 32, 64, 128)
_HI = jax.lax.Precision.HIGHEST
_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ


def _dot(a, b):
    return jnp.dot(a, b, precision=_HI, preferred_element_type=F32)


def _dot_nt(a, b):
    return jax.lax.dot_general(a, b, _NT, precision=_HI, preferred_element_type=F32)


def _column(row):
    """A `[1, d]` row as a `[d, 1]` column (one aligned `[8, d]` transpose)."""
    return jnp.transpose(jnp.broadcast_to(row, (8, row.shape[1])))[:, :1]


def _decayed_products(q, k, kb, gam, chunk):
    """(A, M) of kda.md §5 for one chunk: A_ij = Σ q_i k_j e^{Γ_i−Γ_j} for j ≤ i, M_ij the same
    with βk_i for j < i; 16-row tiles, every exponent ≤ 0 (module docstring, step 1)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    i_in = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB, 1), 0)
    j_in = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB, 1), 1)
    offset = (jax.lax.broadcasted_iota(jnp.int32, (SUB, chunk), 1)
              - jax.lax.broadcasted_iota(jnp.int32, (SUB, chunk), 0))  # tile column j -> chunk column r0 + j
    a_rows, m_rows = [], []
    for r0 in range(0, chunk, SUB):
        tile = slice(r0, r0 + SUB)
        q_i, kb_i, k_i, g_i = q[tile], kb[tile], k[tile], gam[tile]
        a_blk = jnp.zeros((SUB, chunk), F32)
        m_blk = jnp.zeros((SUB, chunk), F32)
        if r0:  # columns before the tile, around its first row n = r0
            g_n = gam[r0:r0 + 1]
            fac = jnp.exp(g_i - g_n)
            k_e = k * jnp.exp(jnp.where(rows < r0, g_n - gam, -jnp.inf))
            a_blk = _dot_nt(q_i * fac, k_e)
            m_blk = _dot_nt(kb_i * fac, k_e)
        decay = jnp.exp(jnp.where(j_in <= i_in, g_i[:, None, :] - g_i[None, :, :], -jnp.inf))  # [SUB, SUB, dk]
        k_dec = k_i[None, :, :] * decay
        a_diag = jnp.sum(q_i[:, None, :] * k_dec, axis=-1)  # [SUB, SUB], j ≤ i
        m_diag = jnp.where(j_in[..., 0] < i_in[..., 0], jnp.sum(kb_i[:, None, :] * k_dec, axis=-1), 0.0)
        place = (offset == r0).astype(F32)  # [SUB, C]: tile column j to chunk column r0 + j (an exact matmul)
        a_rows.append(a_blk + _dot(a_diag, place))
        m_rows.append(m_blk + _dot(m_diag, place))
    return jnp.concatenate(a_rows, axis=0), jnp.concatenate(m_rows, axis=0)


def _unit_lower_inverse(m, chunk):
    """(I + M)^{-1} for strictly lower-triangular M `[C, C]`: step l takes row l of the inverse
    (final once the rows above it are) out of every row below, weighted by column l of M."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)

    def step(l, inv):
        m_col = jnp.sum(jnp.where(cols == l, m, 0.0), axis=1, keepdims=True)  # [C, 1]
        inv_row = jnp.sum(jnp.where(rows == l, inv, 0.0), axis=0, keepdims=True)  # [1, C]
        return inv - m_col * inv_row

    return jax.lax.fori_loop(0, chunk, step, (rows == cols).astype(F32))


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, s_ref, *, chunk: int):
    @pl.when(pl.program_id(2) == 0)
    def _():
        s_ref[...] = s0_ref[...]

    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    gam = _dot((cols <= rows).astype(F32), g_ref[...])  # chunk-local Γ = Σ_{j ≤ i} g_j, non-increasing
    heads = jax.lax.broadcasted_iota(jnp.int32, beta_ref.shape, 1)
    beta = jnp.sum(jnp.where(heads == pl.program_id(1), beta_ref[...], 0.0), axis=1, keepdims=True)  # [C, 1]
    q, k = q_ref[...], k_ref[...]  # [C, dk]
    kb = k * beta
    a, m = _decayed_products(q, k, kb, gam, chunk)
    t_inv = _unit_lower_inverse(m, chunk)
    decay = jnp.exp(gam)  # e^Γ ≤ 1
    u = _dot(t_inv, v_ref[...] * beta)
    w = _dot(t_inv, kb * decay)
    s = s_ref[...]
    pseudo_v = u - _dot(w, s)
    o_ref[...] = _dot(q * decay, s) + _dot(a, pseudo_v)
    g_last = gam[chunk - 1:chunk]  # Γ_C, [1, dk]
    k_to_end = k * jnp.exp(g_last - gam)
    s_ref[...] = _column(jnp.exp(g_last)) * s + _dot(jnp.transpose(k_to_end), pseudo_v)

def cost_estimate(b: int, h: int, t: int, dk: int, dv: int, chunk: int) -> pl.CostEstimate:
    """From the grid (b, h, t / chunk) and the BlockSpecs (`t` padded to the chunk, `dk`, `dv` as
    launched: padded to 128, `h` the launch's heads). Per chunk: q, k, g `[C, dk]`, v `[C, dv]` and
    β `[C, h]` read, o `[C, dv]` written; per (row, head) the state `[dk, dv]` read once and
    written once. FLOPs: the matmuls (2mnk each: Γ, the off-diagonal tiles, the diagonal tiles'
    placement, U, W, W S, the read-out, A V', the state update), the diagonal tiles' products
    and sums, and the substitution's C rank-one updates; exponentials: the tiles' factors and
    pairwise decays, e^Γ, e^{Γ_C − Γ} and e^{Γ_C}."""
    n_chunks, tiles = t // chunk, chunk // SUB
    matmul = 2 * (chunk * chunk * dk + (tiles - 1) * 2 * SUB * chunk * dk + tiles * 2 * SUB * SUB * chunk
                  + chunk * chunk * (dv + dk) + 3 * chunk * dk * dv + chunk * chunk * dv)
    elementwise = tiles * 5 * SUB * SUB * dk + 2 * chunk ** 3 + 2 * dk * dv
    exps = (tiles - 1) * (SUB + chunk) * dk + tiles * SUB * SUB * dk + 2 * chunk * dk + dk
    per_chunk_bytes = chunk * (3 * dk + 2 * dv + h) * 4
    return pl.CostEstimate(flops=b * h * n_chunks * (matmul + elementwise),
                           transcendentals=b * h * n_chunks * exps,
                           bytes_accessed=b * h * (n_chunks * per_chunk_bytes + 2 * dk * dv * 4))


def kda_chunk_tpu(q, k, v, g, beta, state, *, chunk: int = 64, interpret: bool = False):
    """kda.md §5 for every (row, head): q, k, g `[B, T, H, dk]`, v `[B, T, H, dv]`, β `[B, T, H]`,
    state `[B, H, dk, dv]` (the initial state; fp32). Returns (o `[B, T, H, dv]`, the final
    state), fp32, as `ops.kda_chunked`'s XLA path. `chunk` ∈ `CHUNK_SIZES`. `interpret`: run the
    body with TPU semantics on any backend (`pltpu.InterpretParams`)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if chunk not in CHUNK_SIZES:
        raise ValueError(f"KDA TPU chunked forward: chunk={chunk} not in {CHUNK_SIZES}")
    check_inputs("KDA TPU chunked forward", q, k, v, g, beta, state)
    tp = -(-t // chunk) * chunk
    dkp, dvp = -(-dk // LANES) * LANES, -(-dv // LANES) * LANES

    def tokens(a, width):
        return lane_rows(a, tp, width)

    state = padded_state(state, dkp, dvp)

    def head_chunk(width):  # row i's chunk c of head j: lanes j*width .. (j+1)*width
        return pl.BlockSpec((None, chunk, width), lambda i, j, c: (i, c, j))

    per_head = pl.BlockSpec((None, None, dkp, dvp), lambda i, j, c: (i, j, 0, 0))
    fn = pl.pallas_call(
        functools.partial(_kernel, chunk=chunk),
        grid=(b, h, tp // chunk),
        in_specs=[head_chunk(dkp), head_chunk(dkp), head_chunk(dvp), head_chunk(dkp),
                  pl.BlockSpec((None, chunk, h), lambda i, j, c: (i, c, 0)), per_head],
        out_specs=[head_chunk(dvp), per_head],
        out_shape=[jax.ShapeDtypeStruct((b, tp, h * dvp), F32), jax.ShapeDtypeStruct((b, h, dkp, dvp), F32)],
        input_output_aliases={5: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=cost_estimate(b, h, tp, dkp, dvp, chunk),
        name="kda_chunk_tpu",
    )
    beta = jnp.pad(beta.astype(F32), ((0, 0), (0, tp - t), (0, 0)))
    o, state = fn(tokens(q, dkp), tokens(k, dkp), tokens(v, dvp), tokens(g, dkp), beta, state)
    return o.reshape(b, tp, h, dvp)[:, :t, :, :dv], state[:, :, :dk, :dv]
