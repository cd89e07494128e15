"""Pallas TPU (Mosaic) grouped expert matmul with packed MXFP4 weights decoded in VMEM.

`y_m = W_{e(m)} x_m` for rows sorted by expert (mx_formats.md §1.3, §3-§5), megablox-style:
the tile schedule (row block, expert) is scalar-prefetched, so each grid step's BlockSpec
index map DMAs that tile's expert only; an expert nobody chose is never read.

The weights come in the kernel layout (`quant.MXFP4KernelWeight`, `quant.kernel_layout`):
codes as uint32 words `[(L,) E, K/8, N]` (word r of column n holds elements 8r..8r+7 of that
column's input, element 8r + p in nibble p: the released bytes, little-endian) and E8M0 scale
bytes `[(L,) E, 1, B, N]` (one part: B = K/32 rounded up to a multiple of 8; the extra rows
are never read). Output columns are the minor axis of both, so XLA:TPU keeps its default
layout for them and hands the stacks to the kernel as they are: with `[E, N, K/8]` words
(K/8 = 448 at K3.1 Pro) it stores N minor and would copy the whole stack into the kernel's
order on every call, and a 12-row scale axis it moves outside the experts (mx_formats.md §3.1). A layer stack is read in place: the layer is one more scalar-prefetched
index, never a sliced copy of the layer's experts.

In VMEM, per tile and weight:
- the words are split into their eight nibble planes `[K/8, BN]` (plane p holds elements
  8r + p), and the columns of x were permuted outside to the same order (`x_planes`:
  `[8, M, K/8]`), so `x · W = Σ_p x_p · W_p` needs no interleaving of the codes;
- element 8r + p lies in scale block (8r + p) // 32 = r // 4 for every p, so all planes share
  one per-word scale. The `[B, BN]` scale bytes are widened to `[K/8, BN]` by a matmul with
  a 0/1 matrix (exact: bytes are integers below 256, one term per sum), because a repeat
  along sublanes by 4 is not a Mosaic operation;
- each plane is decoded to its exact E2M1 values (bit construction, `e2m1_values`) times
  2^(byte − 127) in f32 (0xFF → NaN), cast to x's dtype: the dequantise-then-matmul weight of
  the XLA path, never written to HBM; the MXU multiplies bf16 (or f32) and accumulates f32.

Grid: (N / BN, tiles). The tiles of one row block are consecutive, so its output block stays
in VMEM across them and each tile writes only its expert's rows (the first tile of a block
writes zeros elsewhere: rows outside every group are 0, as in `lax.ragged_dot`). Every row
block has at least one tile. Unused tiles repeat the last used tile's block indices, so they
move no data, and do no work.

fp8 MXU inputs (`mxu="fp8"`, for MXFP8 activations on a TPU whose MXU multiplies e4m3): every
E2M1 value is exact in e4m3, but a block scale folded in is not (2^-10 x 6 underflows e4m3's
range), and the per-32 scales vary along K, the contracted axis. So each column's scales are
split into the column's largest, 2^S[n], applied to the f32 result, and a relative 2^-d[b, n]
(d <= 8 keeps E2M1 x 2^-d exact in e4m3), folded into the codes; x gets one power-of-two shift
per row (`_fp8_rows`). The products are then exact, accumulated in f32, and y = acc · shift ·
2^S: the XLA path's sum up to order, but for activations more than 2^16 below their row's
largest (rounded on e4m3's subnormal grid, at most 2^-17 of that largest). A tile with a
column whose scales span more than 8 octaves (or hold a NaN or zero scale) takes x's dtype.

The activation gradient `dx_m = Σ_i W_{i,e(m)}ᵀ dy_{i,m}` (`mxfp4_gmm_dx_tpu`; the packed
weights themselves are frozen: they have no gradient) is the same schedule transposed: grid
(tiles, N / BN) with N the reduction, each plane decoded as above and multiplied as
`dy · W_pᵀ -> [BM, K/8]` (plane p of dx, columns 8r + p, un-permuted outside), accumulated in
f32 in the row block's `[8, BM, K/8]` output block, which stays in VMEM across the block's tiles
and column blocks. A tile with no rows freezes its column-block index at the last one, so it
fetches nothing. For the fused gate/up launch one dx sums both weights' terms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...quant import E8M0_NAN, kernel_scale_rows
from .pallas_mxfp4_gmm import e2m1_values

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
PLANES = 8  # E2M1 codes per uint32 word
MXU_INPUTS = ("bf16", "fp8")


def tpu_tile_schedule(group_sizes, m_rows: int, block_m: int):
    """Per tile (int32 `[n_tiles]` each): expert, row block, first row, end row, and whether it
    is the first tile of its row block (it zero-fills the block's other rows).

    Tiles are (row block, expert) pairs that intersect, in row order, then one empty tile per
    row block past the last group (padding rows), then unused tiles, which repeat the last
    used tile's expert and block with an empty row range. `n_tiles = cdiv(M, BM) + min(E, M)
    - 1` is a static bound: each non-empty group after the first adds at most one tile.
    """
    e = group_sizes.shape[0]
    n_blocks = -(-m_rows // block_m)
    n_tiles = max(n_blocks + min(e, m_rows) - 1, 1)
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    total = ends[-1]
    first = starts // block_m
    last = jnp.maximum(ends - 1, 0) // block_m
    count = jnp.where(gs > 0, last - first + 1, 0)
    t_end = jnp.cumsum(count)
    t_start = t_end - count
    n_real = t_end[-1]
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    grp = jnp.minimum(jnp.searchsorted(t_end, t, side="right"), e - 1).astype(jnp.int32)
    blk = first[grp] + t - t_start[grp]
    lo = jnp.maximum(starts[grp], blk * block_m)
    hi = jnp.minimum(ends[grp], (blk + 1) * block_m)
    # row blocks no group reaches (rows past the last group): one empty tile each
    filled = -(-total // block_m)
    n_used = n_real + n_blocks - filled
    empty_blk = filled + t - n_real
    real = t < n_real
    used = t < n_used
    last_grp = jnp.where(n_real > 0, grp[jnp.maximum(n_real - 1, 0)], 0)
    grp = jnp.where(real, grp, last_grp)
    blk = jnp.where(real, blk, empty_blk)
    last_used = jnp.maximum(n_used - 1, 0)
    blk = jnp.where(used, blk, blk[last_used])
    lo = jnp.where(real, lo, 0)
    hi = jnp.where(real, hi, 0)
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), blk[:-1]])
    fresh = (used & (blk != prev)).astype(jnp.int32)
    return grp, blk.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32), fresh


def x_planes(x, m_pad: int):
    """x `[M, K]` as `[8, M_pad, K/8]`: plane p holds columns 8r + p (zero rows appended)."""
    m, k = x.shape
    xp = x.reshape(m, k // PLANES, PLANES).transpose(2, 0, 1)
    return jnp.pad(xp, [(0, 0), (0, m_pad - m), (0, 0)]) if m_pad != m else xp


def word_scales(scale_bytes, k8: int):
    """E8M0 bytes `[B, BN]` -> f32 factors `[K/8, BN]` (word r takes block r // 4):
    2^(byte − 127), 0xFF -> NaN. The widening is a 0/1 matmul, exact for byte values."""
    blocks = scale_bytes.shape[0]
    word = jax.lax.broadcasted_iota(jnp.int32, (k8, blocks), 0)
    block = jax.lax.broadcasted_iota(jnp.int32, (k8, blocks), 1)
    spread = ((word >> 2) == block).astype(jnp.bfloat16)
    b = jnp.dot(spread, scale_bytes.astype(jnp.int32).astype(F32).astype(jnp.bfloat16),
                preferred_element_type=F32).astype(jnp.int32)
    factor = jax.lax.bitcast_convert_type(b << 23, F32)  # 2^(b - 127); byte 0 -> 0 (an f32 subnormal, flushed)
    return jnp.where(b == E8M0_NAN, jnp.float32(jnp.nan), factor)


def _pow2_of_exponent(e):
    """2^e for int32 e in the normal f32 range."""
    return jax.lax.bitcast_convert_type((jnp.clip(e, -126, 127) + 127) << 23, F32)


def _fp8_rows(x_ref):
    """x's planes as e4m3 after one power-of-two shift per row (its largest value lands below
    2^8, inside e4m3's 448), and the shifts `[BM, 1]`. MXFP8 values keep all their bits down to
    2^-6 after the shift; below it e4m3 has subnormals on a 2^-9 grid, so a value more than 2^16
    times smaller than its row's largest is rounded by at most 2^-17 of that largest."""
    planes = [x_ref[p].astype(F32) for p in range(PLANES)]
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(a), axis=1, keepdims=True) for a in planes])
    top = ((jax.lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF) - 127  # the row's largest exponent
    shift = _pow2_of_exponent(jnp.where(amax > 0, top - 7, 0))
    return [(a / shift).astype(FP8) for a in planes], shift


def _kernel(row_ref, grp_ref, blk_ref, lo_ref, hi_ref, fresh_ref, x_ref, *refs, n_w: int, block_m: int, mxu: str):
    del row_ref, grp_ref  # used by the index maps
    w_refs, out_refs = refs[:2 * n_w], refs[2 * n_w:]
    t = pl.program_id(1)
    lo, hi = lo_ref[t], hi_ref[t]
    rows = blk_ref[t] * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    mine = (rows >= lo) & (rows < hi)
    dt = x_ref.dtype
    prec = jax.lax.Precision.HIGHEST if dt == F32 else jax.lax.Precision.DEFAULT

    @pl.when(fresh_ref[t] == 1)
    def _():
        for o_ref in out_refs:
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    def store(i, acc):
        o_ref = out_refs[i]
        o_ref[...] = jnp.where(mine, acc.astype(o_ref.dtype), o_ref[...])

    def weight_planes(i):
        words = pltpu.bitcast(w_refs[2 * i][...], jnp.int32)  # [K/8, BN]
        return [e2m1_values((words >> (4 * p)) & 0xF, F32) for p in range(PLANES)], \
            word_scales(w_refs[2 * i + 1][...], words.shape[0])

    def in_dtype(i, codes, factor):  # the dequantise-then-matmul weight of the XLA path, on the MXU in x's dtype
        acc = None
        for p in range(PLANES):
            part = jnp.dot(x_ref[p], (codes[p] * factor).astype(dt), precision=prec, preferred_element_type=F32)
            acc = part if acc is None else acc + part
        store(i, acc)

    def fp8(i, x8, x_shift):
        codes, factor = weight_planes(i)
        column = jnp.max(factor, axis=0, keepdims=True)  # [1, BN]: the column's largest block scale
        rel = factor / column  # 2^-d per word row, exact
        # E2M1 x 2^-d is exact in e4m3 for d <= 8 (0.5 x 2^-8 = 2^-9, its smallest subnormal); a
        # tile with a wider column, a NaN (0xFF) or a zero scale takes x's dtype, which handles
        # them as the XLA path does
        exact = jnp.all((rel >= 2.0 ** -8) & (column > 0) & (column < jnp.inf))

        @pl.when(exact)
        def _():
            acc = None
            for p in range(PLANES):
                part = jnp.dot(x8[p], (codes[p] * rel).astype(FP8), preferred_element_type=F32)
                acc = part if acc is None else acc + part
            store(i, acc * x_shift * column)  # exact powers of two

        pl.when(jnp.logical_not(exact))(functools.partial(in_dtype, i, codes, factor))

    @pl.when(hi > lo)
    def _():
        if mxu == "fp8":
            x8, x_shift = _fp8_rows(x_ref)
        for i in range(n_w):
            if mxu == "fp8":
                fp8(i, x8, x_shift)
            else:
                in_dtype(i, *weight_planes(i))


def pick_block_n(n: int) -> int:
    """Output columns per tile: all of N up to 1,024 (x's row block is read once per column
    block), else the largest of 512, 256, 128 dividing N, else all of N."""
    if n <= 1024:
        return n
    return next((b for b in (512, 256, 128) if n % b == 0), n)


def cost_estimate(m_pad: int, k: int, n: int, n_experts: int, n_w: int, itemsize: int, block_m: int,
                  block_n: int, out_itemsize: int | None = None, rows: int | None = None) -> pl.CostEstimate:
    """What the grid's DMAs move and the MXU does, from the BlockSpecs. A block is fetched when
    its index differs from the previous grid step's, so per column block: x's `[8, BM, K/8]`
    blocks once per row block (a row block's tiles are consecutive), each reached expert's words
    `[K/8, BN]` and scale rows `[B, BN]` once (an expert's tiles are consecutive), every output
    block written once; products (the 0/1 scale widening with them) on tiles that hold rows.

    The experts reached depend on the routing: without `rows`, the bound min(E, M); with `rows`
    (the rows expected in groups, e.g. a device's mean share of the assignments under expert
    parallelism), their expected number under uniform routing, E (1 - (1 - 1/E)^rows), the
    expectation `k31jax.aot` counts the XLA paths' selected experts with."""
    if rows is None:
        experts, busy = min(n_experts, m_pad), m_pad
    else:
        experts, busy = n_experts * (1 - (1 - 1 / n_experts) ** rows), min(rows, m_pad)
    weight_bytes = n_w * experts * n * (k // 2 + kernel_scale_rows(k // 32))
    x_bytes = (n // block_n) * m_pad * k * itemsize
    out_bytes = n_w * m_pad * n * (out_itemsize or itemsize)
    tiles = -(-busy // block_m) + experts
    products = 2 * block_m * k * block_n + 2 * (k // 8) * kernel_scale_rows(k // 32) * block_n
    flops = n_w * (n // block_n) * tiles * products
    return pl.CostEstimate(flops=int(flops), transcendentals=0, bytes_accessed=int(weight_bytes + x_bytes + out_bytes))


def _layer_rows(row, n_weights: int):
    """The scalar-prefetched layer row of each weight: `row` is one for all, or one per weight
    (None: unstacked weights, row 0)."""
    rows = row if isinstance(row, (list, tuple)) else [row] * n_weights
    if len(rows) != n_weights:
        raise ValueError(f"mxfp4 TPU grouped matmul: {len(rows)} rows for {n_weights} weights")
    return jnp.stack([jnp.asarray(0 if r is None else r, jnp.int32).reshape(()) for r in rows])


def _weight_specs(n_weights: int, stacked: bool, k: int, block_n: int, expert_and_column):
    """Each weight's BlockSpecs: words `[K/8, BN]` and scale rows `[B, BN]` of one expert's column
    block, at the weight's layer row when `stacked`. `expert_and_column(*grid_ids, *prefetch)`
    -> (expert, column block) is the grid's schedule (the prefetched refs start with the layer
    rows)."""

    def index(i, scale: bool):
        def at(g0, g1, row_r, *refs):
            e, c = expert_and_column(g0, g1, row_r, *refs)
            inner = (0, 0, c) if scale else (0, c)
            return (row_r[i], e, *inner) if stacked else (e, *inner)
        return at

    squeezed = (None, None) if stacked else (None,)
    specs = []
    for i in range(n_weights):
        specs += [pl.BlockSpec((*squeezed, k // PLANES, block_n), index(i, False)),
                  pl.BlockSpec((*squeezed, None, kernel_scale_rows(k // 32), block_n), index(i, True))]
    return specs


def mxfp4_gmm_tpu(x, weights, group_sizes, *, block_m: int, row=None, interpret: bool = False,
                  block_n: int | None = None, out_dtype=None, expected_rows: int | None = None, mxu: str = "bf16"):
    """x `[M, K]` sorted by expert; weights: a sequence of kernel-layout pairs (`quant.kernel_layout`
    in one part: uint32 words `[(L,) E, K/8, N]`, scale bytes `[(L,) E, 1, B, N]`) sharing their
    shapes (a leading L when `row`, the layer, is given: one for all weights, or one per
    weight); group_sizes `[E]`. Returns one `[M, N]` array
    per weight, in `out_dtype` (default x's: the f32 accumulators are rounded once, at the
    store). `interpret`: run the body with TPU semantics on any backend (`pltpu.InterpretParams`).
    `expected_rows`: for the cost estimate only (`cost_estimate(rows=)`). `mxu`: the MXU's inputs,
    "bf16" (x's dtype) or "fp8" (e4m3 on both sides, for MXFP8 activations on an MXU that takes
    fp8: `mxu_inputs`; module docstring)."""
    if mxu not in MXU_INPUTS:
        raise ValueError(f"mxfp4 TPU grouped matmul: mxu={mxu!r}, expected one of {MXU_INPUTS}")
    m, k = x.shape
    words0 = weights[0][0]
    stacked = row is not None
    *lead, e, k8, n = words0.shape
    if len(lead) != int(stacked):
        raise ValueError(f"mxfp4 TPU grouped matmul: words {tuple(words0.shape)} need "
                         f"{'a layer axis (row given)' if stacked else 'no layer axis (no row)'}")
    if k8 * PLANES != k:
        raise ValueError(f"mxfp4 TPU grouped matmul: x has {k} columns, the words hold {k8 * PLANES}")
    want_scale = (*lead, e, 1, kernel_scale_rows(k // 32), n)
    for words, scale in weights:
        if words.dtype != jnp.uint32 or tuple(words.shape) != tuple(words0.shape):
            raise ValueError(f"mxfp4 TPU grouped matmul: expected uint32 words {tuple(words0.shape)}, got "
                             f"{words.dtype}{list(words.shape)}")
        if scale.dtype != jnp.uint8 or tuple(scale.shape) != want_scale:
            raise ValueError(f"mxfp4 TPU grouped matmul: expected uint8 scale rows {want_scale} (one part), "
                             f"got {scale.dtype}{list(scale.shape)}")
    bn = block_n or pick_block_n(n)
    m_pad = -(-m // block_m) * block_m
    grp, blk, lo, hi, fresh = tpu_tile_schedule(group_sizes, m, block_m)
    n_tiles = grp.shape[0]
    layer = _layer_rows(row, len(weights))

    def x_map(nb, t, row_r, grp_r, blk_r, *_):
        return (0, blk_r[t], 0)

    def out_map(nb, t, row_r, grp_r, blk_r, *_):
        return (blk_r[t], nb)

    w_specs = _weight_specs(len(weights), stacked, k, bn, lambda nb, t, row_r, grp_r, *_: (grp_r[t], nb))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(n // bn, n_tiles),
        in_specs=[pl.BlockSpec((PLANES, block_m, k8), x_map), *w_specs],
        out_specs=[pl.BlockSpec((block_m, bn), out_map) for _ in weights],
    )
    fn = pl.pallas_call(
        functools.partial(_kernel, n_w=len(weights), block_m=block_m, mxu=mxu),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((m_pad, n), out_dtype or x.dtype) for _ in weights],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=cost_estimate(m_pad, k, n, e, len(weights), x.dtype.itemsize, block_m, bn,
                                    jnp.dtype(out_dtype or x.dtype).itemsize, expected_rows),
        name="mxfp4_gmm_tpu",
    )
    outs = fn(layer, grp, blk, lo, hi, fresh, x_planes(x, m_pad), *[a for pair in weights for a in pair])
    return tuple(o[:m] for o in outs)


def _dx_kernel(row_ref, grp_ref, blk_ref, lo_ref, hi_ref, fresh_ref, *refs, n_w: int, block_m: int):
    del row_ref, grp_ref  # used by the index maps
    dy_refs, w_refs, dx_ref = refs[:n_w], refs[n_w:3 * n_w], refs[3 * n_w]
    t, nb = pl.program_id(0), pl.program_id(1)
    lo, hi = lo_ref[t], hi_ref[t]
    rows = blk_ref[t] * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    mine = (rows >= lo) & (rows < hi)
    dt = dy_refs[0].dtype
    prec = jax.lax.Precision.HIGHEST if dt == F32 else jax.lax.Precision.DEFAULT

    @pl.when((fresh_ref[t] == 1) & (nb == 0))
    def _():
        dx_ref[...] = jnp.zeros(dx_ref.shape, dx_ref.dtype)

    @pl.when(hi > lo)
    def _():
        for i in range(n_w):
            dy = jnp.where(mine, dy_refs[i][...], jnp.zeros((), dt))  # other experts' rows contribute nothing
            words = pltpu.bitcast(w_refs[2 * i][...], jnp.int32)  # [K/8, BN]
            factor = word_scales(w_refs[2 * i + 1][...], words.shape[0])
            for p in range(PLANES):
                w_p = (e2m1_values((words >> (4 * p)) & 0xF, F32) * factor).astype(dt)
                dx_ref[p] = dx_ref[p] + jax.lax.dot_general(dy, w_p, (((1,), (1,)), ((), ())), precision=prec,
                                                            preferred_element_type=F32)


def dx_cost_estimate(m_pad: int, k: int, n: int, n_experts: int, n_w: int, itemsize: int, block_m: int,
                     block_n: int, rows: int | None = None) -> pl.CostEstimate:
    """What the dx grid's DMAs move and the MXU does, from its BlockSpecs: per tile with rows,
    every column block of its expert's words and scale rows and of dy's `[BM, BN]` rows (both
    re-read for each tile: N is the inner, reduction axis), dx's `[8, BM, K/8]` f32 block written
    once per row block; products and the scale widening per tile and column block. The tiles,
    as `cost_estimate`: min(E, M) experts' worth (or their expectation at `rows`) plus one per
    row block."""
    if rows is None:
        experts, busy = min(n_experts, m_pad), m_pad
    else:
        experts, busy = n_experts * (1 - (1 - 1 / n_experts) ** rows), min(rows, m_pad)
    tiles = -(-busy // block_m) + experts
    weight_bytes = n_w * tiles * n * (k // 2 + kernel_scale_rows(k // 32))
    dy_bytes = n_w * tiles * block_m * n * itemsize
    dx_bytes = m_pad * k * 4
    products = 2 * block_m * k * block_n + 2 * (k // 8) * kernel_scale_rows(k // 32) * block_n
    flops = n_w * (n // block_n) * tiles * products
    return pl.CostEstimate(flops=int(flops), transcendentals=0, bytes_accessed=int(weight_bytes + dy_bytes + dx_bytes))


def mxfp4_gmm_dx_tpu(dys, weights, group_sizes, *, block_m: int, row=None, interpret: bool = False,
                     block_n: int | None = None, expected_rows: int | None = None):
    """The activation gradient of `mxfp4_gmm_tpu`: dys, one `[M, N]` per weight (rows sorted by
    expert, in the forward's x dtype), weights and `row` as `mxfp4_gmm_tpu` takes them. Returns
    dx `[M, K]` = Σ_i dy_i W_iᵀ per row's expert, in dy's dtype (f32 accumulation)."""
    m, n = dys[0].shape
    words0 = weights[0][0]
    stacked = row is not None
    *lead, e, k8, n_w_cols = words0.shape
    if n_w_cols != n or any(tuple(d.shape) != (m, n) for d in dys):
        raise ValueError(f"mxfp4 TPU grouped matmul dx: dy shapes {[tuple(d.shape) for d in dys]}, expected "
                         f"{(m, n_w_cols)} for words {tuple(words0.shape)}")
    if len(dys) != len(weights):
        raise ValueError(f"mxfp4 TPU grouped matmul dx: {len(dys)} dy for {len(weights)} weights")
    k = k8 * PLANES
    bn = block_n or pick_block_n(n)
    n_nb = n // bn
    m_pad = -(-m // block_m) * block_m
    grp, blk, lo, hi, fresh = tpu_tile_schedule(group_sizes, m, block_m)
    layer = _layer_rows(row, len(weights))

    def col_block(t, nb, lo_r, hi_r):  # a tile with no rows keeps the last column block: no fetch
        return jnp.where(hi_r[t] > lo_r[t], nb, n_nb - 1)

    def dy_map(t, nb, row_r, grp_r, blk_r, lo_r, hi_r, fresh_r):
        return (blk_r[t], col_block(t, nb, lo_r, hi_r))

    def dx_map(t, nb, row_r, grp_r, blk_r, *_):
        return (0, blk_r[t], 0)

    w_specs = _weight_specs(len(weights), stacked, k, bn, lambda t, nb, row_r, grp_r, blk_r, lo_r, hi_r, fresh_r:
                            (grp_r[t], col_block(t, nb, lo_r, hi_r)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(grp.shape[0], n_nb),
        in_specs=[pl.BlockSpec((block_m, bn), dy_map) for _ in dys] + w_specs,
        out_specs=pl.BlockSpec((PLANES, block_m, k8), dx_map),
    )
    fn = pl.pallas_call(
        functools.partial(_dx_kernel, n_w=len(weights), block_m=block_m),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((PLANES, m_pad, k8), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=dx_cost_estimate(m_pad, k, n, e, len(weights), dys[0].dtype.itemsize, block_m, bn,
                                       expected_rows),
        name="mxfp4_gmm_dx_tpu",
    )
    padded = [jnp.pad(d, [(0, m_pad - m), (0, 0)]) if m_pad != m else d for d in dys]
    planes = fn(layer, grp, blk, lo, hi, fresh, *padded, *[a for pair in weights for a in pair])
    return planes[:, :m].transpose(1, 2, 0).reshape(m, k).astype(dys[0].dtype)
