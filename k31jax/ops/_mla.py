"""Gated NoPE MLA attention cores: naive (MHA), absorbed (MQA over the latent) and sparse.

Spec attention.md §1. No rotation anywhere: the `pe` dims are plain features, `k_pe` is one
vector per token shared by all heads. Logits and softmax are fp32; outputs are fp32.
Masks are boolean `[B, T, S]` (True = may attend); a query with no allowed key yields a
finite (uniform) row instead of NaN, so padding never poisons other tokens.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._impl import resolve_impl, with_reference_grad

_HI = jax.lax.Precision.HIGHEST
_NEG = jnp.finfo(jnp.float32).min


def _masked_softmax(logits, mask):
    return jax.nn.softmax(jnp.where(mask, logits, _NEG), axis=-1)


def mla_attention(
    q_nope: Float[Array, "B T H dn"],
    q_pe: Float[Array, "B T H dr"],
    k_nope: Float[Array, "B S H dn"],
    k_pe: Float[Array, "B S dr"],
    v: Float[Array, "B S H dv"],
    mask: Bool[Array, "B T S"],
    scale: float,
) -> Float[Array, "B T H dv"]:
    """Naive (MHA) form: `softmax((q_nope·k_nope + q_pe·k_pe)·scale)` over allowed keys, then ·v."""
    f32 = jnp.float32
    logits = (jnp.einsum("bthd,bshd->bhts", q_nope, k_nope, preferred_element_type=f32)
              + jnp.einsum("bthd,bsd->bhts", q_pe, k_pe, preferred_element_type=f32)) * scale
    p = _masked_softmax(logits, mask[:, None])
    return jnp.einsum("bhts,bshd->bthd", p, v.astype(f32), precision=_HI)


def absorb_query(q_nope: Float[Array, "B T H dn"], w_uk: Float[Array, "r H dn"]) -> Float[Array, "B T H r"]:
    """`W_UK_hᵀ q_nope_h`: the query moved into the kv latent space (fp32)."""
    return jnp.einsum("bthd,rhd->bthr", q_nope.astype(jnp.float32), w_uk.astype(jnp.float32),
                      precision=_HI)


def mla_attention_absorbed(
    q_nope: Float[Array, "B T H dn"],
    q_pe: Float[Array, "B T H dr"],
    c_kv: Float[Array, "B S r"],
    k_pe: Float[Array, "B S dr"],
    w_uk: Float[Array, "r H dn"],
    w_uv: Float[Array, "r H dv"],
    mask: Bool[Array, "B T S"],
    scale: float,
) -> Float[Array, "B T H dv"]:
    """Absorbed (MQA) form over the latent cache: one 576-d key and one 512-d value per token."""
    f32 = jnp.float32
    q_lat = absorb_query(q_nope, w_uk)
    logits = (jnp.einsum("bthr,bsr->bhts", q_lat, c_kv.astype(f32), precision=_HI)
              + jnp.einsum("bthd,bsd->bhts", q_pe.astype(f32), k_pe.astype(f32), precision=_HI)) * scale
    p = _masked_softmax(logits, mask[:, None])
    o_lat = jnp.einsum("bhts,bsr->bthr", p, c_kv.astype(f32), precision=_HI)
    return jnp.einsum("bthr,rhd->bthd", o_lat, w_uv.astype(f32), precision=_HI)


def mla_attention_sparse(
    q_nope: Float[Array, "B T H dn"],
    q_pe: Float[Array, "B T H dr"],
    c_kv: Float[Array, "B S r"],
    k_pe: Float[Array, "B S dr"],
    w_uk: Float[Array, "r H dn"],
    w_uv: Float[Array, "r H dv"],
    idx: Int[Array, "B T K"],
    valid: Bool[Array, "B T K"],
    scale: float,
    *,
    impl: str | None = None,
) -> Float[Array, "B T H dv"]:
    """Absorbed attention over only the selected latent rows `idx` (DSA, attention.md §3).

    Gathers `[B, T, K, r + dr]` rows; never builds a `[T, S]` mask.
    impl (see `_impl.resolve_impl`): "xla" is this path; "pallas" / "interpret" the kernel of
    `k31jax.kernels.sparse_mla` (decode split-K for T = 1, prefill otherwise); None / "auto"
    the kernel on a GPU.
    """
    impl = resolve_impl(impl)
    if impl != "xla":
        from ..kernels.sparse_mla import mla_attention_sparse as kernel

        return with_reference_grad(functools.partial(kernel, scale=scale, impl=impl),
                                   functools.partial(mla_attention_sparse, scale=scale, impl="xla"))(
            q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, valid)
    f32 = jnp.float32
    gather = jax.vmap(lambda rows, i: rows[i])
    ckv_sel = gather(c_kv, idx).astype(f32)  # [B, T, K, r]
    kpe_sel = gather(k_pe, idx).astype(f32)
    q_lat = absorb_query(q_nope, w_uk)
    logits = (jnp.einsum("bthr,btkr->bhtk", q_lat, ckv_sel, precision=_HI)
              + jnp.einsum("bthd,btkd->bhtk", q_pe.astype(f32), kpe_sel, precision=_HI)) * scale
    p = _masked_softmax(logits, valid[:, None])
    o_lat = jnp.einsum("bhtk,btkr->bthr", p, ckv_sel, precision=_HI)
    return jnp.einsum("bthr,rhd->bthd", o_lat, w_uv.astype(f32), precision=_HI)
