"""Gated NoPE MLA attention cores: naive (MHA), absorbed (MQA over the latent) and sparse.

Spec attention.md §1. No rotation anywhere: the `pe` dims are plain features, `k_pe` is one
vector per token shared by all heads. Logits and softmax are fp32; outputs are fp32.
Masks are boolean `[B, T, S]` (True = may attend); a query with no allowed key yields a
finite (uniform) row instead of NaN, so padding never poisons other tokens.

Packed rows: every core takes `segment_ids [B, T]` (the queries' documents: 1, 2, ... per
contiguous document, 0 = padding) and `kv_segment_ids [B, S]` (the keys'; default
`segment_ids`, for S == T). A query then attends only to keys of its own document (on top of
`mask` / the selection), and padding queries output zeros, so each document computes exactly
what it would alone and padding affects nothing, forward or backward.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..kernels import runs_mosaic, sparse_mla
from ._impl import ImplChoice, kernel_or_reference, per_device_on_layer_stack, resolve_impl
from ._kda import check_segment_ids

_HI = jax.lax.Precision.HIGHEST
_NEG = jnp.finfo(jnp.float32).min


def _masked_softmax(logits, mask):
    return jax.nn.softmax(jnp.where(mask, logits, _NEG), axis=-1)


def key_document_ids(segment_ids, kv_segment_ids, q_shape, s_len: int, where: str):
    """Checks the queries' document ids; returns the keys' `[B, S]`: `kv_segment_ids`, or the
    queries' own when the keys are the queries (S == T)."""
    check_segment_ids(segment_ids, tuple(q_shape), where)
    if kv_segment_ids is None:
        if q_shape[1] != s_len:
            raise ValueError(f"{where}: {s_len} keys but {q_shape[1]} queries; pass "
                             f"kv_segment_ids [B, {s_len}] for keys that are not the queries")
        return segment_ids
    check_segment_ids(kv_segment_ids, (q_shape[0], s_len), where, "kv_segment_ids")
    return kv_segment_ids


def same_document(segment_ids: Int[Array, "B T"], kv_segment_ids: Int[Array, "B S"]) -> Bool[Array, "B T S"]:
    """True where query t and key s lie in the same document (equal, non-zero ids)."""
    return (segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (segment_ids != 0)[:, :, None]


def _zero_padding_queries(o, segment_ids):
    return jnp.where((segment_ids != 0)[:, :, None, None], o, 0.0)


def mla_attention(
    q_nope: Float[Array, "B T H dn"],
    q_pe: Float[Array, "B T H dr"],
    k_nope: Float[Array, "B S H dn"],
    k_pe: Float[Array, "B S dr"],
    v: Float[Array, "B S H dv"],
    mask: Bool[Array, "B T S"],
    scale: float,
    *,
    segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
) -> Float[Array, "B T H dv"]:
    """Naive (MHA) form: `softmax((q_nope·k_nope + q_pe·k_pe)·scale)` over allowed keys, then ·v.

    segment_ids / kv_segment_ids: packed rows (module docstring)."""
    if segment_ids is not None:
        kv = key_document_ids(segment_ids, kv_segment_ids, q_nope.shape[:2], k_pe.shape[1], "mla_attention")
        mask = mask & same_document(segment_ids, kv)
        return _zero_padding_queries(mla_attention(q_nope, q_pe, k_nope, k_pe, v, mask, scale), segment_ids)
    p = _masked_softmax(mla_attention_logits(q_nope, q_pe, k_nope, k_pe, scale), mask[:, None])
    return jnp.einsum("bhts,bshd->bthd", p, v.astype(jnp.float32), precision=_HI)


def mla_attention_logits(
    q_nope: Float[Array, "B T H dn"],
    q_pe: Float[Array, "B T H dr"],
    k_nope: Float[Array, "B S H dn"],
    k_pe: Float[Array, "B S dr"],
    scale: float,
) -> Float[Array, "B H T S"]:
    """The naive form's fp32 logits `(q_nope·k_nope + q_pe·k_pe)·scale` per head, unmasked:
    what `mla_attention` softmaxes, and where indexer distillation reads the dense attention
    distribution (`k31jax.train.indexer_distill_terms`)."""
    f32 = jnp.float32
    return (jnp.einsum("bthd,bshd->bhts", q_nope, k_nope, preferred_element_type=f32)
            + jnp.einsum("bhtd,bsd->bhts", _heads_first(q_pe), k_pe, preferred_element_type=f32)) * scale


def _heads_first(q: Float[Array, "B T H d"]) -> Float[Array, "B H T d"]:
    """`q` as `[B, H, T, d]`, for a contraction against one key per token shared by the heads:
    with the heads next to the batch, XLA's dot writes the `[B, H, T, S]` logits in place;
    contracted as `bthd,bsd`, XLA:CPU wrote `[S, T·H]` and transposed it inside the mask's
    select, which made the whole attention 2.1-2.6x slower at T = S = 2048 (8 heads, CPU)."""
    return q.transpose(0, 2, 1, 3)


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
    *,
    segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
) -> Float[Array, "B T H dv"]:
    """Absorbed (MQA) form over the latent cache: one 576-d key and one 512-d value per token.

    segment_ids / kv_segment_ids: packed rows (module docstring)."""
    if segment_ids is not None:
        kv = key_document_ids(segment_ids, kv_segment_ids, q_nope.shape[:2], c_kv.shape[1],
                           "mla_attention_absorbed")
        mask = mask & same_document(segment_ids, kv)
        return _zero_padding_queries(
            mla_attention_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, mask, scale), segment_ids)
    f32 = jnp.float32
    q_lat = absorb_query(q_nope, w_uk)
    logits = (jnp.einsum("bhtr,bsr->bhts", _heads_first(q_lat), c_kv.astype(f32), precision=_HI)
              + jnp.einsum("bhtd,bsd->bhts", _heads_first(q_pe.astype(f32)), k_pe.astype(f32),
                           precision=_HI)) * scale
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
    impl: ImplChoice | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    layer: Int[Array, ""] | int | None = None,
) -> Float[Array, "B T H dv"]:
    """Absorbed attention over only the selected latent rows `idx` (DSA, attention.md §3).

    Gathers `[B, T, K, r + dr]` rows; never builds a `[T, S]` mask.
    impl (see `_impl.resolve_impl`): "xla" is this path; "pallas" / "interpret" the kernel of
    `k31jax.kernels.sparse_mla` (decode split-K for T = 1, prefill otherwise; for a TPU the
    Mosaic kernel, reading the stacks' row in place, per device under a mesh); "interpret_tpu"
    the Mosaic kernel anywhere; None / "auto" the kernel on a GPU.
    segment_ids / kv_segment_ids: packed rows (module docstring); selected slots of another
    document are dropped from `valid`, so the kernel path stays available.
    layer: `c_kv` / `k_pe` are the caches of every MLA layer `[Lm, B, S, ·]` and this layer's
    are row `layer` (`nn.MLALayerCache`; k_pe's rows may be padded past dr, `nn.kpe_width`).
    The XLA path gathers the selected rows from the stacks in place: slicing the row out first
    copies all S of its latents, every layer, every step (6 GB per decode step per TPU chip at
    128k tokens, `k31jax compile`), to read K of them.
    """
    resolved = resolve_impl(impl, "sparse_mla")
    mosaic = runs_mosaic(resolved) and segment_ids is None
    if layer is not None and (segment_ids is not None or (resolved != "xla" and not mosaic)):
        c_kv, k_pe = (jax.lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in (c_kv, k_pe))
        k_pe, layer = k_pe[..., :q_pe.shape[-1]], None
    if segment_ids is not None:
        kv = key_document_ids(segment_ids, kv_segment_ids, q_nope.shape[:2], c_kv.shape[1],
                           "mla_attention_sparse")
        slot_docs = jax.vmap(lambda ids, i: ids[i])(kv, idx)  # [B, T, K]
        valid = valid & (slot_docs == segment_ids[:, :, None]) & (segment_ids != 0)[:, :, None]
        return _zero_padding_queries(
            mla_attention_sparse(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, valid, scale, impl=impl),
            segment_ids)
    q_lat = absorb_query(q_nope, w_uk)
    if mosaic:
        o_lat = _latent_attention_sparse_tpu(q_lat, q_pe, c_kv, k_pe, idx, valid, layer, scale, resolved)
    elif resolved != "xla":
        return kernel_or_reference("sparse_mla", resolved,
                                   functools.partial(sparse_mla.mla_attention_sparse, scale=scale, impl=resolved),
                                   functools.partial(mla_attention_sparse, scale=scale, impl="xla"))(
            q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, valid)
    else:
        o_lat = _latent_attention_sparse(q_lat, q_pe, c_kv, k_pe, idx, valid, layer, scale)
    return jnp.einsum("bthr,rhd->bthd", o_lat, w_uv.astype(jnp.float32), precision=_HI)


def _latent_attention_sparse(q_lat, q_pe, c_kv, k_pe, idx, valid, layer, scale):
    """The XLA path's `ô` `[B, T, H, r]`: the selected rows gathered (from the stacks' row
    `layer` in place when given), fp32 logits, masked softmax, weighted latent rows."""
    f32 = jnp.float32
    if layer is None:
        gather = jax.vmap(lambda rows, i: rows[i])
    else:
        def gather(stack, i):
            return stack[layer, jnp.arange(i.shape[0])[:, None, None], i]
    ckv_sel = gather(c_kv, idx).astype(f32)  # [B, T, K, r]
    kpe_sel = gather(k_pe, idx)[..., :q_pe.shape[-1]].astype(f32)
    logits = (jnp.einsum("bthr,btkr->bhtk", q_lat, ckv_sel, precision=_HI)
              + jnp.einsum("bthd,btkd->bhtk", q_pe.astype(f32), kpe_sel, precision=_HI)) * scale
    p = _masked_softmax(logits, valid[:, None])
    return jnp.einsum("bhtk,btkr->bthr", p, ckv_sel, precision=_HI)


# The Mosaic kernel reads whole tiles of the caches (`kernels.sparse_mla.tile_rows` rows), per
# query; it runs where that is at most MAX_TILE_READ times the selected rows: a short context
# (S <= 2K for bf16), where a top-K touches most tiles anyway. Beyond, a scattered selection
# would cost up to 16x the XLA path's gather (benchmarks/RESULTS.md "tpu_kernels"). And only for
# decode and verify calls (T <= MAX_KERNEL_QUERIES per row): a prefill chunk's queries share
# tiles that a per-query kernel would read once per query.
MAX_TILE_READ = 2.0
MAX_KERNEL_QUERIES = 16


def _latent_attention_sparse_tpu(q_lat, q_pe, c_kv, k_pe, idx, valid, layer, scale, impl):
    """`ô` by the Mosaic kernel (gradient: the XLA path's), on each device's rows and heads
    under a mesh; the XLA path where the mesh splits what a query needs whole (the cache's
    layers, sequence or latent), where the tiles it may read exceed `MAX_TILE_READ`x the
    selected rows, and for more than `MAX_KERNEL_QUERIES` queries per row."""
    k, rows = idx.shape[-1], sparse_mla.tile_rows(c_kv.dtype)
    tiles_read = min(k, -(-c_kv.shape[-2] // rows)) * rows
    if tiles_read > MAX_TILE_READ * k or q_lat.shape[1] > MAX_KERNEL_QUERIES:
        return _latent_attention_sparse(q_lat, q_pe, c_kv, k_pe, idx, valid, layer, scale)
    query, selection = ("batch", "seq", "act_heads", None), ("batch", "seq", None)
    stacks = ("layers", "batch", "cache_seq", "kv_lora"), ("layers", "batch", "cache_seq", None)
    return per_device_on_layer_stack(
        "sparse_mla", impl,
        functools.partial(sparse_mla.latent_attention_sparse_tpu, scale=scale, interpret=impl == "interpret_tpu"),
        lambda *a: _latent_attention_sparse(*a, scale),
        (q_lat, q_pe, c_kv, k_pe, idx, valid), (query, query, *stacks, selection, selection), query,
        layer=layer, whole=("layers", "cache_seq", "kv_lora"))
