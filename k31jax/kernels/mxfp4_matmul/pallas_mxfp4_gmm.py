"""Pallas-Triton grouped expert matmul with packed MXFP4 weights dequantised in-kernel.

`y_m = W_{e(m)} x_m` for rows sorted by expert (mx_formats.md §1.3, §3-§5). Weights stay
packed in HBM: `packed u8 [E, out, in/2]` (low nibble = even element) and E8M0 scale bytes
`[E, out, in/32]`. Per 32-element block the kernel loads a `[BN, 16]` byte tile and the `[BN]`
scale bytes, decodes both nibble planes to their exact E2M1 values (bit construction; exact in
bf16, as in e4m3 — mx_formats.md §1.3), multiplies them with the activations on the tensor
cores (fp32 accumulation), and applies the block scale to that block's fp32 partial product
in two exact power-of-two steps (`split_pow2`; scale byte 0xFF → NaN). So the scale costs one
multiply per accumulator element per block instead of work per weight element, and the
result equals the dequantise-then-matmul product up to fp32 accumulation order — more
exactly where the XLA path's dequantised weight would be an f32 subnormal (flushed there) or
overflow (scale 0xFE with |code| > 1.5).

The nibble planes are never interleaved: `x · wᵀ = x_even · w_loᵀ + x_odd · w_hiᵀ`, with the
even/odd activation columns read by stride-2 loads. The H200 has no MX tensor cores and its
fp8 MMA needs both operands in fp8, so with bf16 activations the codes are widened to bf16.

Work list (megablox-style, built in XLA by `tile_schedule`): one tile per (row block of BM
sorted rows, expert) pair that intersects; grid = (tiles, out / BN), unused tiles return
at once. A tile writes only the rows of its expert (masked store), so tiles sharing a row
block never race; the output buffer is zero-initialised (rows outside every group stay 0, as
in `lax.ragged_dot`). Several weights (gate and up) share one launch and one activation read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...quant import E8M0_BIAS, E8M0_NAN, split_pow2
from .._common import call, masked_store

F32 = jnp.float32


def tile_schedule(group_sizes, m_rows: int, block_m: int):
    """Per tile: (expert, row block, first row, end row), int32 `[n_tiles]` each.

    `n_tiles = cdiv(M, BM) + min(E, M)` is a static bound: every non-empty group adds at most
    one tile beyond the row blocks. Unused tiles have first == end == 0.
    """
    e = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    first = starts // block_m
    last = jnp.maximum(ends - 1, 0) // block_m
    count = jnp.where(gs > 0, last - first + 1, 0)
    t_end = jnp.cumsum(count)
    t_start = t_end - count
    n_tiles = -(-m_rows // block_m) + min(e, m_rows)
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    grp = jnp.minimum(jnp.searchsorted(t_end, t, side="right"), e - 1).astype(jnp.int32)
    blk = first[grp] + t - t_start[grp]
    used = t < t_end[-1]
    lo = jnp.where(used, jnp.maximum(starts[grp], blk * block_m), 0)
    hi = jnp.where(used, jnp.minimum(ends[grp], (blk + 1) * block_m), 0)
    return grp, jnp.where(used, blk, 0).astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32)


def e2m1_values(codes, dtype):
    """E2M1 codes (low nibble of u8) -> exact values in `dtype`: magnitude bits u = c & 7 give
    f32 bits `(u << 22) + 0x3F000000` for u >= 2 (2^(e−1)·(1 + m/2)) and `u · 0x3F000000`
    (0, 0.5) below; bit 3 is the sign. Same values as `quant._pack._e2m1_to_f32`."""
    c = codes.astype(jnp.int32)
    u = c & 7
    mag = jnp.where(u < 2, u * 0x3F000000, (u << 22) + 0x3F000000)
    return jax.lax.bitcast_convert_type(mag | ((c & 8) << 28), F32).astype(dtype)


def scale_factors(sbytes):
    """E8M0 bytes -> (f1, f2) with f1·f2 = 2^(byte − 127), both normal f32; 0xFF -> NaN."""
    b = sbytes.astype(jnp.int32)
    f1, f2 = split_pow2(b - E8M0_BIAS)
    return jnp.where(b == E8M0_NAN, jnp.float32(jnp.nan), f1), f2


def _gmm_kernel(*refs, n_w: int, block_m: int, block_n: int, block_k: int, n_k: int, prec):
    grp_ref, blk_ref, lo_ref, hi_ref, x_ref = refs[:5]
    w_refs = refs[5:5 + 2 * n_w]
    out_refs = refs[5 + 3 * n_w:]  # after the n_w aliased zero buffers
    t, nb = pl.program_id(0), pl.program_id(1)
    e, mb, lo, hi = grp_ref[t], blk_ref[t], lo_ref[t], hi_ref[t]
    dt = x_ref.dtype
    row_ids = mb * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    rows = pl.ds(mb * block_m, block_m)
    cols = pl.ds(nb * block_n, block_n)
    dims = (((1,), (1,)), ((), ()))

    @pl.when(hi > lo)
    def _():
        def kstep(kb, accs):
            accs = list(accs)
            for j in range(block_k // 32):  # one MX block (32 elements, 16 bytes) at a time
                blk = kb * (block_k // 32) + j
                x_even = x_ref[rows, pl.ds(32 * blk, 16, stride=2)]  # [BM, 16]
                x_odd = x_ref[rows, pl.ds(32 * blk + 1, 16, stride=2)]
                for i in range(n_w):
                    packed = w_refs[2 * i][e, cols, pl.ds(16 * blk, 16)]  # [BN, 16] u8
                    f1, f2 = scale_factors(w_refs[2 * i + 1][e, cols, blk])  # [BN]
                    part = (jax.lax.dot_general(x_even, e2m1_values(packed & 0xF, dt), dims,
                                                precision=prec, preferred_element_type=F32)
                            + jax.lax.dot_general(x_odd, e2m1_values(packed >> 4, dt), dims,
                                                  precision=prec, preferred_element_type=F32))
                    accs[i] = accs[i] + (part * f1[None, :]) * f2[None, :]
            return tuple(accs)

        init = tuple(jnp.zeros((block_m, block_n), F32) for _ in range(n_w))
        accs = jax.lax.fori_loop(0, n_k, kstep, init)
        mask = ((row_ids >= lo) & (row_ids < hi))[:, None]
        for o_ref, acc in zip(out_refs, accs):
            masked_store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask)


def pick_block(n: int, options) -> int:
    for o in options:
        if n % o == 0:
            return o
    raise ValueError(f"mxfp4 grouped matmul: width {n} is not a multiple of any of {options}")


def mxfp4_gmm(x, weights, group_sizes, *, impl: str, block_m: int, block_n: int | None = None,
              block_k: int | None = None):
    """x `[M, K]` sorted by expert; weights: a sequence of (packed `[E, N, K/2]` u8, scale
    `[E, N, K/32]` u8) sharing N; group_sizes `[E]`. Returns one `[M, N]` array (x.dtype) per
    weight."""
    m, k = x.shape
    e, n, kh = weights[0][0].shape
    if 2 * kh != k:
        raise ValueError(f"mxfp4 grouped matmul: x has {k} columns, packed weight {2 * kh}")
    bn = block_n or pick_block(n, (128, 64, 32, 16))
    bk = block_k or pick_block(k, (128, 64, 32))
    mp = -(-m // block_m) * block_m
    xp = jnp.pad(x, [(0, mp - m), (0, 0)]) if mp != m else x
    grp, blk, lo, hi = tile_schedule(group_sizes, m, block_m)
    n_w = len(weights)
    prec = jax.lax.Precision.HIGHEST if x.dtype == F32 else jax.lax.Precision.DEFAULT
    flat = [a for pair in weights for a in pair]
    zeros = [jnp.zeros((mp, n), x.dtype) for _ in range(n_w)]
    first_zero = 5 + 2 * n_w
    fn = call(
        lambda *refs: _gmm_kernel(*refs, n_w=n_w, block_m=block_m, block_n=bn, block_k=bk,
                                  n_k=k // bk, prec=prec),
        out_shape=tuple(jax.ShapeDtypeStruct((mp, n), x.dtype) for _ in range(n_w)),
        grid=(grp.shape[0], n // bn), impl=impl, num_warps=4, num_stages=3,
        input_output_aliases={first_zero + i: i for i in range(n_w)}, name="mxfp4_gmm")
    outs = fn(grp, blk, lo, hi, xp, *flat, *zeros)
    return tuple(o[:m] for o in outs)
