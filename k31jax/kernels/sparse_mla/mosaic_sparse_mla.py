"""Sparse absorbed-MLA attention over the indexer's selected latent rows as a Pallas TPU (Mosaic)
kernel (the TPU kernel path of `ops.mla_attention_sparse`, attention.md §3-§4).

A TPU DMA cannot start at an arbitrary row of a cache: HBM arrays are stored in tiles of
8 rows (fp32; 16 for bf16, `tile_rows`) by 128 lanes, and Mosaic only moves whole tiles along
the row axis. So the kernel gathers *tiles*, not rows:
- `tile_schedule` (XLA, on the `[N, K]` indices) sorts each query's selection, lists the
  distinct tiles it touches and gives every row of those tiles a code: 1 = selected, 0 =
  selected but not a candidate (its logit becomes `finfo(f32).min`, the XLA op's masked
  softmax, so a query with no candidate averages instead of NaN), −1 = not selected.
- One grid step per (query, block of `block_t` tiles): the step DMAs its live tiles of the
  latent `c_kv` and `k_pe` rows straight from the caches (the layer stacks read at `layer`, in
  place) into VMEM, computes `logits = (q̃ · c_kv + q_pe · k_pe) · scale` for every head with
  two matmuls (MQA: one key per row shared by all heads), masks them by the codes and runs an
  online softmax with `ô = Σ p · c_kv` accumulated in fp32 across the query's blocks.
- Blocks past a query's last tile are skipped (no DMA, no compute).

Bytes: a selected row costs its whole tile, so a query reads at most `min(K, ⌈S / rows⌉)`
tiles: at a 4k context the whole row of the cache (top-2,048 of 4,096 rows touches nearly every
tile), at long contexts up to `rows`× the selected rows' bytes when the selection is scattered
(the indexer's choices cluster, which the distinct-tile count exploits). The XLA path gathers
exactly the K rows but writes them to HBM as fp32 `[N, K, r]` and reads them back per einsum.
So `ops.mla_attention_sparse` runs this kernel only where the tiles it may read are at most
`ops._mla.MAX_TILE_READ` times the selected rows (short contexts), the XLA gather beyond.

Dtype policy (as the Triton kernel's): fp32 caches give IEEE fp32 matmuls; bf16 caches give
bf16 operands (the query and the softmax weights rounded to bf16) with fp32 accumulation and
an fp32 softmax. Output fp32. The selection of a query must not repeat a row (top-k's do not).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
NEG = float(jnp.finfo(jnp.float32).min)
LANES = 128


def tile_rows(dtype) -> int:
    """Rows of a cache's HBM tile: 8 for 32-bit values, 16 for 16-bit ones (two rows per word)."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def tile_schedule(idx, code, rows: int, n_slots: int):
    """For idx / code `[N, K]` (distinct rows per query): the distinct tiles each query touches,
    ascending, `[N, n_slots]` (unused slots 0); how many `[N]`; and every row of those tiles'
    code `[N, n_slots · rows]` (1 selected, 0 selected but no candidate, −1 not selected)."""
    n, _ = idx.shape
    order = jnp.argsort(idx, axis=1)
    rows_sel = jnp.take_along_axis(idx, order, 1)
    codes = jnp.take_along_axis(code, order, 1)
    tile = rows_sel // rows
    first_of_tile = jnp.concatenate([jnp.ones((n, 1), bool), tile[:, 1:] != tile[:, :-1]], 1)
    slot = jnp.cumsum(first_of_tile, axis=1, dtype=jnp.int32) - 1
    at = jnp.arange(n)[:, None]
    tiles = jnp.zeros((n, n_slots), jnp.int32).at[at, slot].set(tile)
    row_code = jnp.full((n, n_slots, rows), -1, jnp.int32).at[at, slot, rows_sel % rows].set(codes)
    return tiles, slot[:, -1] + 1, row_code.reshape(n, n_slots * rows)


def tile_slots(k: int, s_len: int, rows: int, block_t: int) -> int:
    """Tile slots per query: at most K distinct tiles and at most the cache's, in whole blocks."""
    return -(-min(k, -(-s_len // rows)) // block_t) * block_t


def cost_estimate(n: int, hp: int, r: int, p: int, k: int, s_len: int, dtype, block_t: int) -> pl.CostEstimate:
    """From the grid `(n, slots / block_t)` and the blocks: per query, q̃ `[hp, r]` and q_pe
    `[hp, p]` fetched once (their block does not change along a query's blocks) and ô `[hp, r]`
    fp32 written once; per block, its rows' codes (int32) and its tile ids; and at most `slots`
    tiles DMA'd (`rows` rows of `r + p` lanes each, the kernel skips the rest; `dtype` is the
    caches'). Per row DMA'd: 2·hp·(r + p) flops of logits, 2·hp·r of `p · c_kv` and hp exps."""
    rows, itemsize = tile_rows(dtype), jnp.dtype(dtype).itemsize
    slots = tile_slots(k, s_len, rows, block_t)
    read_rows = slots * rows
    per_query = (hp * (r + p) * itemsize + hp * r * 4 + slots * 4 + read_rows * 4
                 + read_rows * (r + p) * itemsize)
    return pl.CostEstimate(flops=n * read_rows * hp * (2 * (r + p) + 2 * r),
                           transcendentals=n * read_rows * hp, bytes_accessed=n * per_query)


def _kernel(layer_ref, n_tiles_ref, tiles_ref, q_ref, qpe_ref, code_ref, ckv_hbm, kpe_hbm, o_ref,
            ckv_buf, kpe_buf, sem, m_scr, l_scr, acc_scr, *, seq_len: int, block_t: int, rows: int, scale: float,
            prec):
    n, blk = pl.program_id(0), pl.program_id(1)
    b, layer = n // seq_len, layer_ref[0]

    @pl.when(blk == 0)
    def _():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, F32)
        l_scr[...] = jnp.zeros(l_scr.shape, F32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, F32)

    def copies(j):
        start = pl.multiple_of(tiles_ref[0, j] * rows, rows)
        return (pltpu.make_async_copy(ckv_hbm.at[layer, b, pl.ds(start, rows)], ckv_buf.at[j], sem.at[0]),
                pltpu.make_async_copy(kpe_hbm.at[layer, b, pl.ds(start, rows)], kpe_buf.at[j], sem.at[1]))

    def start(j, carry):
        for copy in copies(j):
            copy.start()
        return carry

    def wait(j, carry):
        for copy in copies(j):
            copy.wait()
        return carry

    live = jnp.minimum(n_tiles_ref[n] - blk * block_t, block_t)

    @pl.when(live > 0)
    def _():
        jax.lax.fori_loop(0, live, start, 0)
        jax.lax.fori_loop(0, live, wait, 0)
        # the tiles past `live` hold stale VMEM (perhaps NaN): zero them so their p = 0 adds 0
        fetched = jax.lax.broadcasted_iota(jnp.int32, (block_t * rows, 1), 0) < live * rows
        kv = jnp.where(fetched, ckv_buf[...].reshape(block_t * rows, -1), 0)
        kp = jnp.where(fetched, kpe_buf[...].reshape(block_t * rows, -1), 0)
        rhs_t = (((1,), (1,)), ((), ()))
        s = (jax.lax.dot_general(q_ref[...], kv, rhs_t, precision=prec, preferred_element_type=F32)
             + jax.lax.dot_general(qpe_ref[...], kp, rhs_t, precision=prec, preferred_element_type=F32)) * scale
        code = code_ref[...]  # [1, block_t·rows]
        s = jnp.where(code > 0, s, jnp.where(code == 0, NEG, -jnp.inf))
        m_old = m_scr[...][:, :1]
        m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing selected yet
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_old - m_safe)
        l_scr[...] = jnp.broadcast_to(alpha * l_scr[...][:, :1] + jnp.sum(p, axis=1, keepdims=True), l_scr.shape)
        acc_scr[...] = alpha * acc_scr[...] + jax.lax.dot_general(
            p.astype(kv.dtype), kv, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=F32)
        m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)

    @pl.when(blk == pl.num_programs(1) - 1)
    def _():
        total = l_scr[...][:, :1]
        o_ref[...] = acc_scr[...] / jnp.where(total == 0.0, 1.0, total)


def sparse_mla_tpu(q_lat, q_pe, c_kv, k_pe, idx, code, layer, *, seq_len: int, scale: float, block_t: int = 32,
                   interpret: bool = False):
    """q̃ `[N, Hp, r]` (the absorbed query `W_UKᵀ q_nope`) and q_pe `[N, Hp, p]` in the caches'
    dtype (N = B·T: query n is batch row n // seq_len); the caches as layer stacks
    c_kv `[L, B, S, r]`, k_pe `[L, B, S, p]` read at row `layer` (an int32 scalar); idx / code
    `[N, K]` int32 (code 1 candidate, 0 not). S must be a whole number of tiles (`tile_rows`),
    r and p whole 128-lane rows. Returns ô `[N, Hp, r]` fp32 (softmax-weighted latent rows)."""
    n, hp, r = q_lat.shape
    p = q_pe.shape[-1]
    n_layers, b, s_len = c_kv.shape[:3]
    k = idx.shape[-1]
    for name, a, want in (("q_pe", q_pe, (n, hp, p)), ("k_pe", k_pe, (n_layers, b, s_len, p)),
                          ("code", code, (n, k))):
        if tuple(a.shape) != want:
            raise ValueError(f"sparse MLA TPU kernel: {name} has shape {tuple(a.shape)}, expected {want} "
                             f"(from q̃ {tuple(q_lat.shape)}, c_kv {tuple(c_kv.shape)}, idx {tuple(idx.shape)})")
    rows = tile_rows(c_kv.dtype)
    if s_len % rows or r % LANES or p % LANES or n != b * seq_len:
        raise ValueError(f"sparse MLA TPU kernel: c_kv {tuple(c_kv.shape)} / k_pe {tuple(k_pe.shape)} need S a "
                         f"multiple of {rows} and rows of whole {LANES}-lane groups, and N = {n} queries must be "
                         f"B·T = {b}·{seq_len}")
    slots = tile_slots(k, s_len, rows, block_t)
    width = block_t * rows
    if width % LANES:
        raise ValueError(f"sparse MLA TPU kernel: block_t={block_t} x {rows} rows must fill whole {LANES}-lane rows")
    tiles, n_tiles, row_code = tile_schedule(idx.astype(jnp.int32), code.astype(jnp.int32), rows, slots)
    n_blocks = slots // block_t
    prec = jax.lax.Precision.HIGHEST if c_kv.dtype == F32 else jax.lax.Precision.DEFAULT
    per_query = lambda *shape: pl.BlockSpec((None, *shape), lambda i, j, *_: (i,) + (0,) * len(shape))  # noqa: E731
    per_block = lambda *shape, **kw: pl.BlockSpec(  # noqa: E731
        (None, None, *shape), lambda i, j, *_: (i, j, 0, 0), **kw)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(n, n_blocks),
        in_specs=[per_block(1, block_t, memory_space=pltpu.SMEM), per_query(hp, r), per_query(hp, p),
                  per_block(1, width),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=per_query(hp, r),
        scratch_shapes=[pltpu.VMEM((block_t, rows, r), c_kv.dtype), pltpu.VMEM((block_t, rows, p), k_pe.dtype),
                        pltpu.SemaphoreType.DMA((2,)), pltpu.VMEM((hp, LANES), F32), pltpu.VMEM((hp, LANES), F32),
                        pltpu.VMEM((hp, r), F32)])
    fn = pl.pallas_call(
        functools.partial(_kernel, seq_len=seq_len, block_t=block_t, rows=rows, scale=scale, prec=prec),
        grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((n, hp, r), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=cost_estimate(n, hp, r, p, k, s_len, c_kv.dtype, block_t),
        name="sparse_mla_tpu")
    return fn(jnp.reshape(layer, (1,)).astype(jnp.int32), n_tiles, tiles.reshape(n, n_blocks, 1, block_t),
              q_lat, q_pe, row_code.reshape(n, n_blocks, 1, width), c_kv, k_pe)
