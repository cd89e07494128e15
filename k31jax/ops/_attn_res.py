"""Block Attention Residuals: the per-token softmax mix over depth. Spec architecture.md §4."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def attn_res_mix(
    blocks: Float[Array, "B T N D"],
    num_blocks: Int[Array, ""] | int,
    partial_sum: Float[Array, "B T D"],
    w_norm: Float[Array, "D"],
    w_proj: Float[Array, "D"],
    eps: float,
) -> Float[Array, "B T D"]:
    """Mix the first `num_blocks` snapshots and the running partial sum of the sub-layer
    outputs since the last snapshot (the spec's `prefix`).

    Candidates `v` are scored by `rms_normalize(v) · (w_norm ⊙ w_proj)` and combined with a
    softmax over candidates, summing the raw (un-normalised) candidates. Entirely fp32; the
    result is cast to partial_sum.dtype. Slots at or beyond `num_blocks` are masked out, so a fixed
    buffer works inside a scan over layers. With no valid snapshot the result is `partial_sum`.
    """
    query = w_norm.astype(jnp.float32) * w_proj.astype(jnp.float32)
    cands = jnp.concatenate([blocks, partial_sum[:, :, None, :]], axis=2).astype(jnp.float32)
    r = cands * jax.lax.rsqrt(jnp.mean(cands * cands, axis=-1, keepdims=True) + eps)
    scores = jnp.einsum("btnd,d->btn", r, query, precision=jax.lax.Precision.HIGHEST)
    n_slots = blocks.shape[2]
    valid = jnp.concatenate([jnp.arange(n_slots) < num_blocks, jnp.ones((1,), bool)])
    scores = jnp.where(valid, scores, -jnp.inf)
    alpha = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("btn,btnd->btd", alpha, cands, precision=jax.lax.Precision.HIGHEST)
    return out.astype(partial_sum.dtype)
