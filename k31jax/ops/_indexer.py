"""The K3.1 lightning indexer (Gated DSA): scores and causal top-k. Spec architecture.md §10.

All index math is fp32. Scores only rank keys; they never enter a softmax at inference.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..kernels import runs_mosaic, sparse_mla
from ._impl import ImplChoice, kernel_or_reference, per_device_on_layer_stack, resolve_impl
from ._mla import key_document_ids, same_document
from ._norms import layer_norm

_HI = jax.lax.Precision.HIGHEST


def indexer_keys(
    x: Float[Array, "B S D"], wk: Float[Array, "D dI"], norm_w: Float[Array, "dI"],
    norm_b: Float[Array, "dI"], eps: float = 1e-6,
) -> Float[Array, "B S dI"]:
    """One LayerNorm'd 128-d index key per token, shared by all index heads."""
    return layer_norm(jnp.dot(x, wk, preferred_element_type=jnp.float32), norm_w, norm_b, eps)


def indexer_queries(
    c_q: Float[Array, "B T R"], wq_b: Float[Array, "R HdI"], x: Float[Array, "B T D"],
    weights_proj: Float[Array, "D HI"], n_heads: int,
) -> tuple[Float[Array, "B T HI dI"], Float[Array, "B T HI"]]:
    """Index queries from the MLA q-latent, and per-head weights `weights_proj(x) · HI^-½`."""
    q = jnp.dot(c_q, wq_b, preferred_element_type=jnp.float32)
    q = q.reshape(*q.shape[:-1], n_heads, -1)
    w = jnp.dot(x.astype(jnp.float32), weights_proj.astype(jnp.float32), precision=_HI)
    return q, w * n_heads ** -0.5


def indexer_scores(
    q: Float[Array, "B T HI dI"], w: Float[Array, "B T HI"], k: Float[Array, "B S dI"]
) -> Float[Array, "B T S"]:
    """`I_{t,s} = dI^-½ · Σ_j w_{t,j} · ReLU(q_{t,j} · k_s)` (no causal mask applied here)."""
    dots = jnp.einsum("btjd,bsd->btjs", q, k, precision=_HI)
    return jnp.einsum("btj,btjs->bts", w, jax.nn.relu(dots), precision=_HI) * q.shape[-1] ** -0.5


def select_topk(
    q: Float[Array, "B T HI dI"],
    w: Float[Array, "B T HI"],
    k: Float[Array, "B S dI"],
    q_pos: Int[Array, "T"],
    key_valid: Bool[Array, "B S"],
    top_k: int,
    key_block: int | None = None,
    *,
    impl: ImplChoice | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    layer: Int[Array, ""] | int | None = None,
) -> tuple[Int[Array, "B T K"], Bool[Array, "B T K"]]:
    """Causal top-min(k, S) selection per query, the query's own position included.

    Key s is a candidate for the query at absolute position `q_pos[t]` iff `s <= q_pos[t]` and
    `key_valid[b, s]`. Returns indices into the key axis and whether each slot holds a real
    candidate (early rows have fewer than k). With `key_block`, keys are streamed in blocks
    with a running top-k, so no `[T, S]` score matrix is ever built.
    impl (see `_impl.resolve_impl`): "xla" is this path; "pallas" / "interpret" fused masked
    scores from `k31jax.kernels.sparse_mla`, then `lax.top_k` — it builds `[B, T, S]` scores,
    so None / "auto" takes it on a GPU for decode (T = 1) only. The selection is discrete:
    no gradient flows through it on either path.

    segment_ids `[B, T]` / kv_segment_ids `[B, S]` (packed rows, 0 = padding; the keys' default
    to the queries' when S == T): a key is a candidate only in the query's own document, so a
    query `p` tokens into its document gets `min(k, p + 1)` valid slots and a padding query
    none. Always the XLA path (the kernel takes no segments).

    layer: `k` is the index keys of every MLA layer `[Lm, B, S, dI]` and this layer's are row
    `layer` (`nn.MLALayerCache`): the TPU kernel ("pallas" for a TPU, "interpret_tpu"; decode
    only, as it reads a row's keys once per query) reads them there, per device under a mesh
    that keeps the keys' layers and sequence whole; the other paths take the row sliced out.
    Keys may be bf16 (scores are fp32 either way).
    """
    impl = resolve_impl(impl, "indexer_topk", supported=q.shape[1] == 1)
    streamed = key_block is not None and key_block < k.shape[-2]
    if runs_mosaic(impl):
        # the TPU kernel reads a row's keys once per query: decode (T = 1) only
        if segment_ids is None and not streamed and q.shape[1] == 1:
            keys, selection = ("layers", "batch", "cache_seq", None), ("batch", "seq", None)
            q, w, k = jax.lax.stop_gradient((q, w, k))
            return per_device_on_layer_stack(
                "indexer_topk", impl,
                functools.partial(sparse_mla.indexer_topk_tpu, top_k=top_k, interpret=impl == "interpret_tpu"),
                lambda q_, w_, k_, p_, v_, row: select_topk(q_, w_, k_, p_, v_, top_k, impl="xla", layer=row),
                (q, w, k, q_pos, key_valid),
                (("batch", "seq", None, None), selection, keys, ("seq",), ("batch", "cache_seq")),
                (selection, selection), layer=layer, whole=("layers", "cache_seq"), grad=False)
        impl = "xla"  # where the TPU kernel does not run: the XLA path, never the Triton kernel below
    if layer is not None:
        k = jax.lax.dynamic_index_in_dim(k, layer, keepdims=False)
    key_docs = None
    if segment_ids is not None:
        key_docs = key_document_ids(segment_ids, kv_segment_ids, q.shape[:2], k.shape[1], "select_topk")
        impl = "xla"
    if impl != "xla":
        q, w, k = jax.lax.stop_gradient((q, w, k))
        return kernel_or_reference(
            "indexer_topk", impl,
            functools.partial(sparse_mla.select_topk, top_k=top_k, key_block=key_block, impl=impl),
            functools.partial(select_topk, top_k=top_k, key_block=key_block, impl="xla"),
            grad=False)(q, w, k, q_pos, key_valid)
    s_len = k.shape[1]
    kk = min(top_k, s_len)

    def own_document(docs, start, size):  # [B, T, size], or True without segments
        if docs is None:
            return True
        return same_document(segment_ids, jax.lax.dynamic_slice_in_dim(docs, start, size, axis=1))

    def block_scores(k_blk, start):
        size = k_blk.shape[1]
        pos = start + jnp.arange(size)
        ok = (pos[None, None, :] <= q_pos[None, :, None]) & jax.lax.dynamic_slice_in_dim(
            key_valid, start, size, axis=1)[:, None, :] & own_document(key_docs, start, size)
        return jnp.where(ok, indexer_scores(q, w, k_blk), -jnp.inf), pos

    if key_block is None or key_block >= s_len:
        scores, _ = block_scores(k, 0)
        vals, idx = jax.lax.top_k(scores, kk)
        return idx.astype(jnp.int32), vals > -jnp.inf

    n_blk = -(-s_len // key_block)
    pad = n_blk * key_block - s_len
    k_pad = jnp.pad(k, [(0, 0), (0, pad), (0, 0)])
    valid_pad = jnp.pad(key_valid, [(0, 0), (0, pad)])
    docs_pad = None if key_docs is None else jnp.pad(key_docs, [(0, 0), (0, pad)])
    b, t = q.shape[:2]
    init = (jnp.full((b, t, kk), -jnp.inf, jnp.float32), jnp.zeros((b, t, kk), jnp.int32))

    def merge(carry, i):
        start = i * key_block
        k_blk = jax.lax.dynamic_slice_in_dim(k_pad, start, key_block, axis=1)
        pos = start + jnp.arange(key_block)
        ok = (pos[None, None, :] <= q_pos[None, :, None]) & jax.lax.dynamic_slice_in_dim(
            valid_pad, start, key_block, axis=1)[:, None, :] & own_document(docs_pad, start, key_block)
        sc = jnp.where(ok, indexer_scores(q, w, k_blk), -jnp.inf)
        vals = jnp.concatenate([carry[0], sc], axis=-1)
        ids = jnp.concatenate([carry[1], jnp.broadcast_to(pos, sc.shape).astype(jnp.int32)], -1)
        top_vals, where = jax.lax.top_k(vals, kk)
        return (top_vals, jnp.take_along_axis(ids, where, axis=-1)), None

    (vals, idx), _ = jax.lax.scan(merge, init, jnp.arange(n_blk))
    return idx, vals > -jnp.inf


def selection_mask(idx: Int[Array, "B T K"], valid: Bool[Array, "B T K"], s_len: int) -> Bool[Array, "B T S"]:
    """Scatter a selection into a boolean `[B, T, S]` mask (for the MHA mask path)."""
    b, t, _ = idx.shape
    bi = jnp.arange(b)[:, None, None]
    ti = jnp.arange(t)[None, :, None]
    # add, not set: an invalid slot may repeat a valid slot's index and must not clear it
    return jnp.zeros((b, t, s_len), jnp.int32).at[bi, ti, idx].add(valid.astype(jnp.int32)) > 0
