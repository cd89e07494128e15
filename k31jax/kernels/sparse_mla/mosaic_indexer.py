"""The lightning indexer's masked scores as a Pallas TPU (Mosaic) kernel (the TPU counterpart of
`pallas_indexer.indexer_scores_masked`; architecture.md §10, attention.md §2, §4).

`I_{n,s} = dI^-½ · Σ_j w_{n,j} · ReLU(q_{n,j} · k_{b,s})` for query row n of batch row
b = n // T, and −inf where `s > q_pos[n]` or key s is not valid; fp32 throughout.

One grid step per (query row, block of `block_s` keys), both axes "parallel". The row's q
`[HI, dI]` and head weights `[1, HI]` stay in VMEM along the key axis (their block index does
not change, so they are fetched once per row); each step DMAs one k block `[block_s, dI]` (in
the caller's dtype, widened to fp32 in VMEM) and its validity row. The body
is one MXU matmul `q · k_blkᵀ -> [HI, block_s]` at `Precision.HIGHEST` (fp32 passes: the default
fp32 precision on a TPU is not IEEE fp32), ReLU, the head weights as a column `[HI, 1]` (one
in-VMEM transpose of the row) broadcast along the lanes, a sum over the heads (the sublanes) to
`[1, block_s]` on the vector unit in fp32, the scale and the mask — so the XLA path's
`[B, T, HI, S]` fp32 intermediate is never written to HBM.

The positions `q_pos` reach the kernel by scalar prefetch (SMEM): the causal mask is an iota
over the block's key positions against the row's scalar, and the k / validity index maps clamp
the key block to the last one the row can see, so a block wholly after the query's position
repeats the previous block index (no DMA) and its step only fills −inf (decode against a long,
mostly empty cache reads only the filled part). The batch row b = n // T comes from the static T.

Layout: the last two dims of every block are (8, 128)-aligned or whole. HI is zero-padded to a
multiple of 8 in q and w (exact: a padded head has q = 0 and w = 0, so it adds nothing). k is
read in place, never padded or copied (it is the key cache): its block `[block_s, dI]` spans the
whole dI (any width; Mosaic pads the contraction in VMEM), and the key grid runs to S rounded up
to `block_s`, the last block partly past the end of k — its rows past S hold whatever VMEM held,
which only reaches those keys' own score columns (each key's score is its own dot products),
and those are invalid (the validity row is zero-padded to the grid) and sliced off. w travels
as `[N, 1, HI]` (a bitcast of `[N, HI]`; a column `[N, HI, 1]` would be a 128-lane-padded
relayout in HBM), validity as int32 `[B, 1, S]` and the scores as `[N, 1, S]` (XLA relays them
out to `[N, S]` after the call: one small pass over the scores).

The top-k is not in the kernel: it stays `lax.top_k` on the `[N, S]` scores outside, as on the
GPU path (`ops.select_topk`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
LANES = 128
SUBLANES = 8


def _kernel(qpos_ref, layer_ref, q_ref, w_ref, k_ref, valid_ref, o_ref, *, block_s: int, inv_sqrt_d: float):
    n, j = pl.program_id(0), pl.program_id(1)
    qpos = qpos_ref[n]
    start = j * block_s

    @pl.when(start <= qpos)
    def _():
        dots = jax.lax.dot_general(q_ref[...], k_ref[...].astype(F32), (((1,), (1,)), ((), ())),
                                   precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)  # [HI, BS]
        w_row = jnp.broadcast_to(w_ref[...], (SUBLANES, w_ref.shape[-1]))  # [1, HI] -> [8, HI]: a 2-D transpose
        w_col = jnp.transpose(w_row)[:, :1]                                 # -> [HI, 1]
        sc = jnp.sum(jnp.maximum(dots, 0.0) * w_col, axis=0, keepdims=True) * inv_sqrt_d  # [1, BS]
        pos = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_s), 1)
        o_ref[...] = jnp.where((pos <= qpos) & (valid_ref[...] != 0), sc, -jnp.inf)

    @pl.when(start > qpos)
    def _():  # wholly after the query: nothing to see (and the k block was not fetched)
        o_ref[...] = jnp.full((1, block_s), -jnp.inf, F32)


def cost_estimate(n: int, hi: int, di: int, s_pad: int, block_s: int, k_itemsize: int) -> pl.CostEstimate:
    """From the grid (n, s_pad // block_s) and the BlockSpecs (as launched: `hi` padded to a
    multiple of 8, `s_pad` = S rounded up to `block_s`). Once per row: q `[hi, di]` and w
    `[1, hi]` fp32 (their block index is constant along the key axis) and its int32 position
    (scalar prefetch). Per step: the k block `[block_s, di]` (k_itemsize bytes) and the int32
    validity row `[1, block_s]` read, one fp32 score row `[1, block_s]` written. Flops per step:
    the matmul 2·hi·di·block_s, ReLU, the head weight and the head sum 3·hi·block_s, the scale
    block_s. An upper bound: steps after a query's position fetch nothing and compute nothing,
    and the last k block may be partial."""
    steps = n * (s_pad // block_s)
    per_row = (hi * di + hi) * 4 + 4
    per_step = block_s * di * k_itemsize + block_s * 4 + block_s * 4
    return pl.CostEstimate(flops=steps * (2 * hi * di * block_s + 3 * hi * block_s + block_s), transcendentals=0,
                           bytes_accessed=n * per_row + steps * per_step)


def indexer_scores_tpu(q, w, k, q_pos, key_valid, *, layer=None, block_s: int = 512, interpret: bool = False):
    """q [N, HI, dI] fp32 (N = B*T rows, row n belongs to batch row n // T), w [N, HI] fp32,
    k [B, S, dI] (any float dtype; cast to fp32 in the kernel), or with `layer` (an int32
    scalar) the keys of every MLA layer [L, B, S, dI], read at row `layer` in place; q_pos [N]
    int32 (the absolute position of each query row), key_valid [B, S] bool. Returns fp32
    scores [N, S]: dI^-1/2 * sum_j w[n,j] relu(q[n,j] . k[b,s]) where s <= q_pos[n] and
    key_valid[b,s], else -inf. `interpret`: run the body with TPU semantics on any backend
    (`pltpu.InterpretParams`)."""
    if q.ndim != 3:
        raise ValueError(f"indexer TPU scores: q has shape {tuple(q.shape)}, expected [N, HI, dI]")
    if k.ndim != (3 if layer is None else 4):
        raise ValueError(f"indexer TPU scores: k has shape {tuple(k.shape)}, expected "
                         f"{'[B, S, dI]' if layer is None else '[L, B, S, dI] (a layer stack, with layer=)'}")
    n, hi, di = q.shape
    b, s_len, _ = k.shape[-3:]
    if n % b:
        raise ValueError(f"indexer TPU scores: q has {n} rows, expected a multiple of k's batch {b} (N = B*T)")
    for name, a, want in (("k", k, (*k.shape[:-3], b, s_len, di)), ("w", w, (n, hi)), ("q_pos", q_pos, (n,)),
                          ("key_valid", key_valid, (b, s_len))):
        if tuple(a.shape) != tuple(want):
            raise ValueError(f"indexer TPU scores: {name} has shape {tuple(a.shape)}, expected {tuple(want)} "
                             f"(from q {tuple(q.shape)} and k {tuple(k.shape)})")
    if block_s <= 0 or block_s % LANES:
        raise ValueError(f"indexer TPU scores: block_s={block_s}, expected a positive multiple of {LANES}")
    if layer is None:
        k, layer = k[None], 0
    t = n // b
    hip = -(-hi // SUBLANES) * SUBLANES
    sp = -(-s_len // block_s) * block_s  # the key grid's extent; k itself is not padded

    qq = jnp.pad(q.astype(F32), ((0, 0), (0, hip - hi), (0, 0)))
    ww = jnp.pad(w.astype(F32), ((0, 0), (0, hip - hi)))[:, None, :]
    if not jnp.issubdtype(k.dtype, jnp.floating):
        k = k.astype(F32)
    valid = jnp.pad(key_valid.astype(jnp.int32), ((0, 0), (0, sp - s_len)))[:, None, :]

    def key_block(j, pos, row):  # the last block the row can see; later ones repeat it (no DMA)
        return jnp.maximum(jnp.minimum(j, pos[row] // block_s), 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(n, sp // block_s),
        in_specs=[
            pl.BlockSpec((None, hip, di), lambda i, j, pos, lay: (i, 0, 0)),
            pl.BlockSpec((None, 1, hip), lambda i, j, pos, lay: (i, 0, 0)),
            pl.BlockSpec((None, None, block_s, di), lambda i, j, pos, lay: (lay[0], i // t, key_block(j, pos, i), 0)),
            pl.BlockSpec((None, 1, block_s), lambda i, j, pos, lay: (i // t, 0, key_block(j, pos, i))),
        ],
        out_specs=pl.BlockSpec((None, 1, block_s), lambda i, j, pos, lay: (i, 0, j)),
    )
    fn = pl.pallas_call(
        functools.partial(_kernel, block_s=block_s, inv_sqrt_d=float(di) ** -0.5),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((n, 1, sp), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=cost_estimate(n, hip, di, sp, block_s, jnp.dtype(k.dtype).itemsize),
        name="indexer_scores_tpu",
    )
    return fn(q_pos.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32), qq, ww, k, valid)[:, 0, :s_len]
