"""The KDA decode step as a Pallas TPU (Mosaic) kernel (the TPU kernel path of
`ops.kda_recurrent`).

One grid step per (row, head): the fp32 state `[dk, dv]` is DMA'd to VMEM once, the T tokens
(T = 1 at decode) are applied to it there in order — decay, read, delta write, read-out
(kda.md §4) — and it is written back once, in place (the state input is aliased to the state
output).

The arithmetic is elementwise work plus sums over `dk`, the state's sublane axis. The tokens
come in the layout the layer has them in, `[B, T, H·d]` (T padded to a multiple of 8: one
(8, 128) tile per head and row block), read per head as `[T8, d]` blocks along the lanes, and o
goes out as `[B, T, H·dv]`: the launch needs no relayout of its operands. (The compiler still
re-lays out a KDA `g_proj` row next to it in the K3.1 Pro decode step: benchmarks/RESULTS.md
"tpu_kernels".) q, k and the gate g become columns `[dk, T8]` in VMEM, one transpose each. A token's column `[dk, 1]` broadcasts along the lanes, its v row
`[1, dv]` along the sublanes:
- decay:    S ← S ⊙ exp(g_t)              (column × state)
- read:     r = Σ_dk S ⊙ k_t              (a sublane reduction: `[1, dv]`)
- write:    S ← S + (β_t k_t) ⊗ (v_t − r) (column × row)
- read-out: o_t = Σ_dk S ⊙ q_t            (`[1, dv]`)
This is the XLA path's arithmetic (kda.md §4) in fp32 on the vector unit, with no MXU pass
(whose default fp32 precision on a TPU is not IEEE fp32). Head widths that are not a multiple
of 128 are zero-padded to one (an exact identity: padded channels never decay a written value
and are never written).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
LANES = 128


def _kernel(q_ref, k_ref, g_ref, v_ref, beta_ref, s_ref, o_ref, s_out_ref, *, steps: int):
    q, k, g = (jnp.transpose(r[...]) for r in (q_ref, k_ref, g_ref))  # [T8, dk] rows -> [dk, T8] columns
    s = s_ref[...]
    for t in range(steps):  # T is static and small (1 at decode): unrolled
        s = s * jnp.exp(g[:, t:t + 1])
        read = jnp.sum(s * k[:, t:t + 1], axis=0, keepdims=True)
        s = s + (k[:, t:t + 1] * beta_ref[:, t:t + 1]) * (v_ref[t:t + 1, :] - read)
        o_ref[t:t + 1, :] = jnp.sum(s * q[:, t:t + 1], axis=0, keepdims=True)
    s_out_ref[...] = s


def cost_estimate(b: int, h: int, t: int, dk: int, dv: int) -> pl.CostEstimate:
    """From the grid (b, h) and the BlockSpecs (`dk`, `dv` as launched: padded to 128): each
    block is fetched once. Per (row, head): q, k, g `[T8, dk]`, v `[T8, dv]`, β `[1, T]` and the
    state `[dk, dv]` read; o `[T, dv]` and the state written (T8: T rounded up to 8). Per token:
    7·dk·dv + dv flops (decay, read, write, read-out) and dk exponentials."""
    t8 = -(-t // 8) * 8
    read = t8 * (3 * dk + dv) + t + dk * dv
    written = t * dv + dk * dv
    return pl.CostEstimate(flops=b * h * t * (7 * dk * dv + dv), transcendentals=b * h * t * dk,
                           bytes_accessed=b * h * (read + written) * 4)


def check_inputs(what: str, q, k, v, g, beta, state) -> None:
    """One clear error for a KDA kernel's inputs: q, k, g `[B, T, H, dk]`, v `[B, T, H, dv]`, β
    `[B, T, H]`, state `[B, H, dk, dv]`."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    for name, a, want in (("k", k, q.shape), ("g", g, q.shape), ("v", v, (b, t, h, dv)), ("beta", beta, (b, t, h)),
                          ("state", state, (b, h, dk, dv))):
        if tuple(a.shape) != tuple(want):
            raise ValueError(f"{what}: {name} has shape {tuple(a.shape)}, expected {tuple(want)} "
                             f"(from q {tuple(q.shape)} and v {tuple(v.shape)})")


def lane_rows(a, rows: int, width: int):
    """Tokens `[B, T, H, d]` as the kernels read them, `[B, rows, H * width]` fp32: T zero-padded to
    `rows`, each head's d to `width` lanes (a reshape when aligned)."""
    b, t, h, d = a.shape
    return jnp.pad(a.astype(F32), ((0, 0), (0, rows - t), (0, 0), (0, width - d))).reshape(b, rows, h * width)


def padded_state(state, dk: int, dv: int):
    """The fp32 state `[B, H, dk, dv]` zero-padded to the launch's widths."""
    state = state.astype(F32)
    return jnp.pad(state, ((0, 0), (0, 0), (0, dk - state.shape[2]), (0, dv - state.shape[3])))


def kda_decode_tpu(q, k, v, g, beta, state, *, interpret: bool = False):
    """T tokens of the delta rule for every (row, head): q, k, g `[B, T, H, dk]`, v
    `[B, T, H, dv]`, β `[B, T, H]`, state `[B, H, dk, dv]` (fp32; updated in place). Returns
    (o `[B, T, H, dv]`, the new state), fp32, as `ops.kda_recurrent`'s XLA path. `interpret`:
    run the body with TPU semantics on any backend (`pltpu.InterpretParams`)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    check_inputs("KDA TPU decode step", q, k, v, g, beta, state)

    t8, dkp, dvp = -(-t // 8) * 8, -(-dk // LANES) * LANES, -(-dv // LANES) * LANES

    def tokens(a, width):
        return lane_rows(a, t8, width)

    state = padded_state(state, dkp, dvp)

    def head_rows(width, rows=t8):  # row i's tokens of head j: lanes j*width .. (j+1)*width
        return pl.BlockSpec((None, rows, width), lambda i, j: (i, 0, j))

    def per_head(*shape):
        return pl.BlockSpec((None, None, *shape), lambda i, j: (i, j, 0, 0))

    fn = pl.pallas_call(
        functools.partial(_kernel, steps=t),
        grid=(b, h),
        in_specs=[head_rows(dkp), head_rows(dkp), head_rows(dkp), head_rows(dvp), per_head(1, t), per_head(dkp, dvp)],
        out_specs=[head_rows(dvp, t), per_head(dkp, dvp)],
        out_shape=[jax.ShapeDtypeStruct((b, t, h * dvp), F32), jax.ShapeDtypeStruct((b, h, dkp, dvp), F32)],
        input_output_aliases={5: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=cost_estimate(b, h, t, dkp, dvp),
        name="kda_decode_tpu",
    )
    o, state = fn(tokens(q, dkp), tokens(k, dkp), tokens(g, dkp), tokens(v, dvp),
                  jnp.transpose(beta.astype(F32), (0, 2, 1))[:, :, None, :], state)
    return o.reshape(b, t, h, dvp)[..., :dv], state[:, :, :dk, :dv]
