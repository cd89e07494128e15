"""The kernel paths of `ops.kda_chunked` / `ops.kda_recurrent` (`impl` "pallas" | "interpret" |
"interpret_tpu"): Pallas-Triton for both, and Pallas TPU (Mosaic) kernels for both (the chunked
forward `mosaic_kda_chunk`, the decode step `mosaic_kda`), which "pallas" runs for a TPU and
"interpret_tpu" anywhere.

Dtype policy: q, k, v, g, β may be bf16; everything is upcast to fp32 (the recurrence is an
fp32 island, kda.md §5-§6) and the outputs and state are fp32, exactly as the XLA ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._common import pad_axis, pow2_at_least, runs_mosaic
from . import pallas_kda
from .mosaic_kda import kda_decode_tpu
from .mosaic_kda_chunk import kda_chunk_tpu

CHUNK_SIZES = (16, 32, 64, 128)  # the chunk sizes the kernel takes

# |Γ_i − Γ_m| inside a 16-row tile is < 8·|lb| around its middle row: factor the diagonal tiles
# only while that stays far from fp32's e^88.7 (kda.md §6b; lb = −5 gives e^40).
MAX_FACTORED_BOUND = 10.0


def factor_diagonal(lower_bound: float | None) -> bool:
    """Whether the diagonal sub-chunk tiles may be factored (lower-bounded gate only)."""
    return lower_bound is not None and abs(float(lower_bound)) <= MAX_FACTORED_BOUND


def kda_chunked(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    g: Float[Array, "B T H dk"],
    beta: Float[Array, "B T H"],
    initial_state: Float[Array, "B H dk dv"] | None = None,
    chunk_size: int = 64,
    *,
    lower_bound: float | None = None,
    impl: str = "pallas",
    precision: str = "highest",
) -> tuple[Float[Array, "B T H dv"], Float[Array, "B H dk dv"]]:
    """The kernel path of `ops.kda_chunked`. `lower_bound` is the gate's bound (None for the
    softplus gate); it only selects the diagonal-tile factorisation, never the maths.
    `precision`: the kernel's matmuls, "highest" (IEEE fp32, the default) or "tf32x3"
    (3-pass TF32 on the tensor cores, ~fp32 accuracy; GPU only, fp32 in interpret mode).

    Chunk sizes 16, 32, 64, 128 run on the kernel; any T (zero-padded to a multiple of the
    chunk, an exact identity step) and any head width (zero-padded to a power of two ≥ 16).
    For a TPU (`runs_mosaic`) one launch does it all (`mosaic_kda_chunk.kda_chunk_tpu`: fp32
    matmuls at `Precision.HIGHEST`, the explicit diagonal decay whatever the gate, so
    `lower_bound` and `precision` change nothing there).
    """
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"kda_chunked kernel: chunk_size={chunk_size} not in {CHUNK_SIZES}")
    b, t, h, dk = q.shape
    if runs_mosaic(impl):
        state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32) if initial_state is None else initial_state
        return kda_chunk_tpu(q, k, v, g, beta, state, chunk=chunk_size, interpret=impl == "interpret_tpu")
    dv = v.shape[-1]
    c = chunk_size
    tp = -(-t // c) * c
    dkp, dvp = pow2_at_least(dk), pow2_at_least(dv)

    def prep(a, d):
        return pad_axis(pad_axis(a.astype(jnp.float32), 1, tp), 3, d)

    q_, k_, g_ = prep(q, dkp), prep(k, dkp), prep(g, dkp)
    v_ = prep(v, dvp)
    beta_ = pad_axis(beta.astype(jnp.float32), 1, tp)
    gamma = jnp.cumsum(g_.reshape(b, tp // c, c, h, dkp), axis=2).reshape(b, tp, h, dkp)
    if initial_state is None:
        state = jnp.zeros((b, h, dkp, dvp), jnp.float32)
    else:
        state = pad_axis(pad_axis(initial_state.astype(jnp.float32), 2, dkp), 3, dvp)
    o, state = pallas_kda.kda_chunk_fwd(q_, k_, v_, gamma, beta_, state, chunk=c,
                                        factor_diag=factor_diagonal(lower_bound), impl=impl,
                                        precision=precision)
    return o[:, :t, :, :dv], state[:, :, :dk, :dv]


def kda_recurrent(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    g: Float[Array, "B T H dk"],
    beta: Float[Array, "B T H"],
    initial_state: Float[Array, "B H dk dv"] | None = None,
    *,
    impl: str = "pallas",
) -> tuple[Float[Array, "B T H dv"], Float[Array, "B H dk dv"]]:
    """The kernel path of `ops.kda_recurrent`: each token is one fused decode-step launch
    (decay, read, delta write, read-out; the state updated in place), scanned over T. For a TPU
    (`runs_mosaic`) one launch takes all T tokens (`mosaic_kda.kda_decode_tpu`)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if runs_mosaic(impl):
        state = jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state
        return kda_decode_tpu(q, k, v, g, beta, state, interpret=impl == "interpret_tpu")
    dkp, dvp = pow2_at_least(dk), pow2_at_least(dv)

    def prep(a, d):
        return jnp.moveaxis(pad_axis(a.astype(jnp.float32), 3, d), 1, 0)  # [T, B, H, d]

    xs = (prep(q, dkp), prep(k, dkp), prep(v, dvp), prep(g, dkp),
          jnp.moveaxis(beta.astype(jnp.float32), 1, 0))
    if initial_state is None:
        state = jnp.zeros((b, h, dkp, dvp), jnp.float32)
    else:
        state = pad_axis(pad_axis(initial_state.astype(jnp.float32), 2, dkp), 3, dvp)

    def step(s, x):
        o, s = pallas_kda.kda_decode_step(*x, s, impl=impl)
        return s, o

    if t == 1:
        state, o = step(state, jax.tree.map(lambda a: a[0], xs))
        o = o[None]
    else:
        state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1)[..., :dv], state[:, :, :dk, :dv]
