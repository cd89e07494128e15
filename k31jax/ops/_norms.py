"""Normalisations (spec architecture.md §3, kda.md §2, attention.md §2)."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def rms_norm(x: Float[Array, "... D"], weight: Float[Array, "D"], eps: float) -> Float[Array, "... D"]:
    """Kimi RMSNorm: normalise in fp32, cast back to x.dtype, *then* multiply by the weight.

    The cast before the weight matters in bf16 (it is what the release computes).
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y.astype(x.dtype) * weight).astype(x.dtype)


def layer_norm(x: Float[Array, "... D"], weight: Float[Array, "D"], bias: Float[Array, "D"],
               eps: float) -> Float[Array, "... D"]:
    """Mean-centred LayerNorm with biased variance; fp32 in and out (the indexer's k_norm)."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    return (xf - mu) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)


def l2_normalize(x: Float[Array, "... d"], eps: float = 1e-6) -> Float[Array, "... d"]:
    """`x / sqrt(sum(x²) + eps)` in fp32: the eps sits inside the sqrt (not F.normalize's clamp)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)
