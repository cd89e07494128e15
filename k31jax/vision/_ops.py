"""Pure MoonViT-V2 ops on a packed sequence of image patches (spec vision.md §2-§3).

Images of different sizes are packed into one sequence `[N, ...]`; the host-side layout
(`_layout.py`) gives, per patch, its image (`segment_ids`), its (row, column) in the patch
grid, the four taps of the resized position table, and per merged token the four patches it
concatenates. All shapes therefore depend on N (and M) only, never on the image sizes.

Dtype policy as in `k31jax.ops`: inputs may be bf16; norms, softmax, GELU and the RoPE
rotation are fp32 islands cast back to the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..ops import rms_norm

ROPE_THETA = 10000.0
# The peers precompute RoPE tables for grids up to 512 x 512 patches (vision.md §2).
ROPE_MAX_GRID = 512


def patch_embed(patches: Float[Array, "N C p p"], weight: Float[Array, "Cpp D"]) -> Float[Array, "N D"]:
    """The stride-p Conv2d without bias, as a Linear on each flattened (c, y, x) patch."""
    n = patches.shape[0]
    flat = patches.reshape(n, -1).astype(weight.dtype)
    return jnp.dot(flat, weight, preferred_element_type=jnp.float32).astype(weight.dtype)


def position_embedding(table: Float[Array, "Ht Wt D"], tap_index: Int[Array, "N 4"],
                       tap_weight: Float[Array, "N 4"]) -> Float[Array, "N D"]:
    """The learned table resized bilinearly to each patch's image grid: four weighted taps of
    the flattened table per patch (the taps and weights come from `_layout.bilinear_taps`)."""
    flat = table.reshape(-1, table.shape[-1]).astype(jnp.float32)
    out = jnp.zeros((tap_index.shape[0], flat.shape[-1]), jnp.float32)
    # Four gathers of [N, D] rather than one [N, 4, D]: the largest images have ~66k patches.
    for k in range(4):
        out = out + jnp.take(flat, tap_index[:, k], axis=0) * tap_weight[:, k:k + 1].astype(jnp.float32)
    return out.astype(table.dtype)


def rope_angles(positions: Int[Array, "N 2"], head_dim: int) -> Float[Array, "N half"]:
    """The 2-D RoPE angles per patch, `[x f_0, y f_0, x f_1, y f_1, ...]` with
    `f_i = theta^(-4i/head_dim)` (positions are (row y, column x))."""
    n_freq = head_dim // 4
    freqs = 1.0 / (ROPE_THETA ** (jnp.arange(n_freq, dtype=jnp.float32) * 4.0 / head_dim))
    y = positions[:, 0:1].astype(jnp.float32) * freqs
    x = positions[:, 1:2].astype(jnp.float32) * freqs
    return jnp.stack([x, y], axis=-1).reshape(positions.shape[0], 2 * n_freq)


def apply_rope_2d(x: Float[Array, "N H hd"], angles: Float[Array, "N half"]) -> Float[Array, "N H hd"]:
    """Rotate the adjacent pairs `(x[2m], x[2m+1])` by angle m (interleaved, not rotate-half)."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    a, b = xf[..., 0], xf[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def _dense_attention(q, k, v, q_seg, k_seg, scale):
    logits = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * scale
    mask = q_seg[:, None] == k_seg[None, :]
    logits = jnp.where(mask[None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("hqk,khd->qhd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)


def packed_attention(q: Float[Array, "N H hd"], k: Float[Array, "N H hd"], v: Float[Array, "N H hd"],
                     segment_ids: Int[Array, "N"], scale: float, *, block_size: int = 1024) -> Float[Array, "N H hd"]:
    """Full, non-causal attention within each image, block-diagonal across the packed images.

    `segment_ids` must be non-decreasing (images packed one after another). Up to
    `block_size` patches the scores are formed at once; beyond, an online softmax runs over
    key blocks (queries a block at a time), skipping key blocks that hold none of the query
    block's images, so memory stays O(block_size^2) per head.
    """
    n = q.shape[0]
    if n <= block_size:
        return _dense_attention(q, k, v, segment_ids, segment_ids, scale).astype(q.dtype)
    nb = -(-n // block_size)
    pad = nb * block_size - n
    # Padding keys get an id no query has; padding queries are sliced off at the end.
    seg = jnp.pad(segment_ids, (0, pad), constant_values=-1)
    kseg = jnp.pad(segment_ids, (0, pad), constant_values=-2)
    qb, kb, vb = (jnp.pad(t, ((0, pad), (0, 0), (0, 0))).reshape(nb, block_size, *t.shape[1:]) for t in (q, k, v))
    seg_b, kseg_b = seg.reshape(nb, block_size), kseg.reshape(nb, block_size)
    h, d = q.shape[1], v.shape[2]

    def one_query_block(args):
        qi, si = args
        lo, hi = jnp.min(jnp.where(si >= 0, si, jnp.iinfo(jnp.int32).max)), jnp.max(si)

        def step(carry, kv):
            m, l, acc = carry
            kj, vj, sj = kv
            valid = sj >= 0
            k_lo = jnp.min(jnp.where(valid, sj, jnp.iinfo(jnp.int32).max))
            k_hi = jnp.max(sj)

            def update(c):
                m, l, acc = c
                logits = jnp.einsum("qhd,khd->hqk", qi, kj, preferred_element_type=jnp.float32) * scale
                logits = jnp.where((si[:, None] == sj[None, :])[None], logits, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(logits - m_safe[..., None])
                corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
                l_new = l * corr + jnp.sum(p, axis=-1)
                acc_new = acc * corr[..., None] + jnp.einsum("hqk,khd->hqd", p.astype(vj.dtype), vj,
                                                             preferred_element_type=jnp.float32)
                return m_new, l_new, acc_new

            overlap = (k_lo <= hi) & (k_hi >= lo)
            return jax.lax.cond(overlap, update, lambda c: c, (m, l, acc)), None

        init = (jnp.full((h, block_size), -jnp.inf, jnp.float32), jnp.zeros((h, block_size), jnp.float32),
                jnp.zeros((h, block_size, d), jnp.float32))
        (_, l, acc), _ = jax.lax.scan(step, init, (kb, vb, kseg_b))
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        return jnp.transpose(out, (1, 0, 2))

    out = jax.lax.map(one_query_block, (qb, seg_b))
    return out.reshape(nb * block_size, h, d)[:n].astype(q.dtype)


def gelu_tanh(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """torch `gelu(approximate="tanh")` (`gelu_pytorch_tanh`), in fp32."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


def gelu_erf(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """Exact (erf) GELU, in fp32: the projector's activation."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)


def _linear(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def vision_block(x: Float[Array, "N D"], p: dict, angles: Float[Array, "N half"], segment_ids: Int[Array, "N"], *,
                 num_heads: int, eps: float, block_size: int = 1024) -> Float[Array, "N D"]:
    """One pre-norm block: `x += wo(Attn(RoPE(q), RoPE(k), v))`, `x += fc1(gelu_tanh(fc0(norm1 x)))`.

    `p`: norm0 [D], wqkv [D, 3, H*hd] (q | k | v, each head-major), wo [H*hd, D], norm1 [D],
    fc0 [D, F], fc1 [F, D].
    """
    n = x.shape[0]
    h = rms_norm(x, p["norm0"], eps)
    qkv = jnp.einsum("nd,dte->nte", h, p["wqkv"], preferred_element_type=jnp.float32).astype(x.dtype)
    qkv = qkv.reshape(n, 3, num_heads, -1)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    q, k = apply_rope_2d(q, angles), apply_rope_2d(k, angles)
    attn = packed_attention(q, k, v, segment_ids, q.shape[-1] ** -0.5, block_size=block_size)
    x = x + _linear(attn.reshape(n, -1), p["wo"])
    h = rms_norm(x, p["norm1"], eps)
    return x + _linear(gelu_tanh(_linear(h, p["fc0"])), p["fc1"])


def merge_patches(x: Float[Array, "N D"], merge_index: Int[Array, "M k"]) -> Float[Array, "M kD"]:
    """`sd2_tpool` for images (T = 1): each merged token is its kh x kw patches' features side
    by side (top-left, top-right, bottom-left, bottom-right for 2 x 2)."""
    return jnp.take(x, merge_index, axis=0).reshape(merge_index.shape[0], -1)


def project(merged: Float[Array, "M kD"], w0: Float[Array, "kD kD"], w2: Float[Array, "kD Dt"],
            post_norm: Float[Array, "Dt"], eps: float) -> Float[Array, "M Dt"]:
    """`patchmergerv2`: Linear -> exact GELU -> Linear -> RMSNorm (no biases)."""
    h = gelu_erf(_linear(merged.astype(w0.dtype), w0))
    return rms_norm(_linear(h, w2), post_norm, eps)
