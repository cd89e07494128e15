"""Packed rows (`segment_ids`) are exact: every document computes what it would alone.

Checked against the per-document float64 references (`tests/refs`, `*_packed`: each document
run alone through the single-sequence references) and against the same JAX code run on each
document alone (one document per batch row, right-padded, without segment ids):
- the short conv: taps never reach into the previous document, the history continues only a
  document starting at t = 0, the returned history is the last document's own;
- the KDA recurrence and its chunked WY/UT form (chunk 16 and 64): documents of 1, 5, 63, 64,
  65 and 130 tokens starting mid-chunk and on a chunk boundary, leading / middle / trailing
  padding, different boundaries per batch row, a non-zero initial state, channels at g = -30;
- naive / absorbed / sparse MLA cores with a segment mask (and key ids that are not the
  queries'), the indexer top-k restricted to the query's own document (a top-k larger than a
  document selects all of its earlier tokens: `min(k, position in document + 1)` slots);
- the KDAMixer and the MLAMixer (dense, DSA on the mask and the gather path) on packed rows;
- gradients: finite, and packed == the sum of the per-document gradients;
- bad segment ids and segment ids with a cache are refused.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.model import abstract, rel_err
from k31jax.nn import KDALayerCache, MLALayerCache, MLAMixer
from k31jax.ops import Backends, _indexer, _kda, _mla
from refs import attention as RA, kda as RK
from test_ops_attention import (_indexer_setup, dsa_weights, fragile_rows, indexer_hf, mla_cfg,
                                selected, set_params, to_hf)
from test_ops_attention import ref_cfg as mla_ref_cfg
from test_ops_kda import VARIANTS, build_kda, kda_inputs
from test_ops_kda import ref_cfg as kda_ref_cfg


# ------------------------------------------------------------------ packed layouts


def packed_ids(*rows):
    """segment_ids [B, T]: each row is a list of run lengths, documents positive (ids 1, 2, ...
    in order), padding negative."""
    t = sum(abs(n) for n in rows[0])
    ids = np.zeros((len(rows), t), np.int32)
    for r, runs in enumerate(rows):
        assert sum(abs(n) for n in runs) == t, runs
        pos, doc = 0, 0
        for n in runs:
            if n > 0:
                doc += 1
                ids[r, pos:pos + n] = doc
            pos += abs(n)
    return ids


# chunk 64: boundaries mid-chunk (2, 65, 130, 131, 136, 199) and on one (64); every length
# of 1, 5, 63, 64, 65, 130; leading and trailing padding in row 0, none in row 1
KDA_IDS = packed_ids([-2, 63, 65, 1, 5, 63, -1], [64, 1, 5, 130])
# one-token documents, a document ending the row, padding between documents
SMALL_IDS = packed_ids([-1, 5, 1, 12, 6, -1], [9, 1, 16], [4, -2, 1, 3, 1, 15])


def documents(segment_ids):
    """[(row, start, end)] of every document of a packed batch."""
    return [(r, s, e) for r in range(len(segment_ids)) for s, e in RK.document_spans(segment_ids[r])]


def last_documents(docs, n_rows):
    """Index into `docs` of each row's last document."""
    return [max(i for i, d in enumerate(docs) if d[0] == r) for r in range(n_rows)]


def stack_documents(a, docs):
    """Every document of `a` [B, T, ...] as its own row, left-aligned and zero-padded to the
    longest; returns it and the valid mask [n_docs, L]."""
    length = max(e - s for _, s, e in docs)
    out = np.zeros((len(docs), length) + a.shape[2:], a.dtype)
    valid = np.zeros((len(docs), length), bool)
    for i, (r, s, e) in enumerate(docs):
        out[i, :e - s], valid[i, :e - s] = a[r, s:e], True
    return out, valid


def unstack_documents(y, docs, shape):
    """Per-document rows back into the packed layout (zeros at padding)."""
    out = np.zeros(shape, np.asarray(y).dtype)
    for i, (r, s, e) in enumerate(docs):
        out[r, s:e] = np.asarray(y)[i, :e - s]
    return out


def test_packed_references_are_per_document():
    """The packed references on one document == the plain ones, padding outputs zero."""
    assert RK.document_spans([0, 0, 3, 3, 1, 0, 1, 1, 0]) == [(2, 4), (4, 5), (6, 8)]
    assert RK.document_spans([0, 0]) == [] and RK.document_spans([2]) == [(0, 1)]
    rng = np.random.default_rng(0)
    q, k, v, g, beta, s0 = (a[0] for a in kda_inputs(rng, 1, 9, 2, 4, 3))
    ids = np.array([1] * 7 + [0] * 2)
    o, s = RK.kda_recurrent_packed(q, k, v, g, beta, ids, s0)
    o1, s1 = RK.kda_recurrent(q[:7], k[:7], v[:7], g[:7], beta[:7], s0)
    np.testing.assert_array_equal(o[:7], o1)
    np.testing.assert_array_equal(s, s1)
    assert (o[7:] == 0).all()
    o0, s_pad = RK.kda_recurrent_packed(q, k, v, g, beta, np.zeros(9, int), s0)
    assert (o0 == 0).all() and np.array_equal(s_pad, s0)


# ------------------------------------------------------------------ short conv


_conv = jax.jit(_kda.short_conv)


def test_short_conv_packed():
    ids = SMALL_IDS
    rng = np.random.default_rng(1)
    b, t = ids.shape
    c, kk = 7, 4
    x = rng.standard_normal((b, t, c)).astype(np.float32)
    w_hf = rng.uniform(-0.5, 0.5, (c, 1, kk)).astype(np.float32)
    w = w_hf[:, 0, :].T  # [K, C]
    hist = rng.standard_normal((b, kk - 1, c)).astype(np.float32)
    y, new_hist = _conv(x, w, hist, segment_ids=ids)
    for r in range(b):
        want_y, want_h = RK.short_conv_packed(x[r], w_hf, ids[r], hist[r])
        np.testing.assert_allclose(np.asarray(y[r]), want_y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(new_hist[r]), want_h, rtol=1e-6, atol=1e-7)
    assert (np.asarray(y)[ids == 0] == 0).all()
    # row 0 ends in padding, which does not shift the window: its last document's own inputs
    np.testing.assert_array_equal(np.asarray(new_hist[0]), x[0, 22:25])
    # the first document of rows 1 and 2 starts at t = 0 and continues `hist`; row 0 does not
    y0, _ = _conv(x, w, None, segment_ids=ids)
    np.testing.assert_array_equal(np.asarray(y0[0]), np.asarray(y[0]))
    assert np.abs(np.asarray(y0[1:, :2]) - np.asarray(y[1:, :2])).max() > 1e-2
    # without segments the taps cross documents: the comparison above is not vacuous
    y_plain, _ = _conv(x, w, hist)
    assert np.abs(np.asarray(y_plain)[ids != 0] - np.asarray(y)[ids != 0]).max() > 1e-2
    # a row of padding only keeps its history
    _, h_pad = _conv(x[:1], w, hist[:1], segment_ids=np.zeros((1, t), np.int32))
    np.testing.assert_array_equal(np.asarray(h_pad), hist[:1])


# ------------------------------------------------------------------ KDA recurrence


_chunked = jax.jit(_kda.kda_chunked, static_argnames="chunk_size")
_recurrent = jax.jit(_kda.kda_recurrent)


def kda_packed_inputs(seed, ids, h=2, dk=16, dv=12):
    q, k, v, g, beta, s0 = kda_inputs(np.random.default_rng(seed), *ids.shape, h, dk, dv)
    # head 0 remembers (g ∈ (-0.1, 0): e^Γ ≈ 0.05 after 64 steps, so a state leaking across a
    # document start would show); head 1 forgets fast, some of its channels everything at once
    g[:, :, 0] *= 0.02
    g[:, :, 1, :3] = -30.0
    return q, k, v, g, beta, s0


def kda_alone(q, k, v, g, beta, s0, ids, chunk):
    """Each document through `kda_chunked` on its own row, right-padded (identity steps); the
    document starting a row at t = 0 continues that row's initial state."""
    docs = documents(ids)
    stacked = [stack_documents(a, docs)[0] for a in (q, k, v, g, beta)]
    valid = stack_documents(q, docs)[1]
    gm, bm = _kda.kda_mask_padding(jnp.asarray(valid), stacked[3], stacked[4])
    s0_docs = np.stack([s0[r] if s == 0 else np.zeros_like(s0[r]) for r, s, _ in docs])
    o, s = _chunked(*stacked[:3], gm, bm, s0_docs, chunk_size=chunk)
    return unstack_documents(o, docs, q.shape[:3] + v.shape[-1:]), np.asarray(s)[last_documents(docs, len(ids))]


@pytest.mark.parametrize("chunk", [16, 64])
def test_kda_packed_equals_documents_alone(chunk):
    ids = KDA_IDS
    q, k, v, g, beta, s0 = kda_packed_inputs(chunk, ids)
    o_ref, s_ref = (np.stack(a) for a in zip(*(RK.kda_recurrent_packed(q[r], k[r], v[r], g[r], beta[r],
                                                                          ids[r], s0[r])
                                                for r in range(len(ids)))))
    o_c, s_c = _chunked(q, k, v, g, beta, s0, chunk_size=chunk, segment_ids=ids)
    o_r, s_r = _recurrent(q, k, v, g, beta, s0, segment_ids=ids)
    o_a, s_a = kda_alone(q, k, v, g, beta, s0, ids, chunk)
    for name, got, want in [("chunked o", o_c, o_ref), ("chunked S", s_c, s_ref),
                            ("recurrent o", o_r, o_ref), ("recurrent S", s_r, s_ref),
                            ("alone o", o_a, o_ref), ("alone S", s_a, s_ref),
                            ("chunked vs alone o", o_c, o_a), ("chunked vs alone S", s_c, s_a)]:
        assert rel_err(got, want) < 1e-5, (name, rel_err(got, want))
    assert (np.asarray(o_c)[ids == 0] == 0).all() and (np.asarray(o_r)[ids == 0] == 0).all()
    # not vacuous: without segments the state leaks across documents
    o_plain, _ = _chunked(q, k, v, g, beta, s0, chunk_size=chunk)
    assert rel_err(np.asarray(o_plain)[ids != 0], o_ref[ids != 0]) > 1e-2


def test_kda_degenerate_rows():
    """A row of one document is the unsegmented op; a row of padding leaves the state as is."""
    rng = np.random.default_rng(3)
    q, k, v, g, beta, s0 = kda_inputs(rng, 2, 45, 2, 16, 12, state_scale=3.0)
    ids = np.stack([np.ones(45, np.int32), np.zeros(45, np.int32)])
    for chunk in (16, 64):
        o, s = _chunked(q, k, v, g, beta, s0, chunk_size=chunk, segment_ids=ids)
        o_plain, s_plain = _chunked(q, k, v, g, beta, s0, chunk_size=chunk)
        np.testing.assert_allclose(np.asarray(o[0]), np.asarray(o_plain[0]), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(s[0]), np.asarray(s_plain[0]), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(s[1]), s0[1])
        assert (np.asarray(o[1]) == 0).all()
    o, s = _recurrent(q, k, v, g, beta, s0, segment_ids=ids)
    np.testing.assert_array_equal(np.asarray(s[1]), s0[1])
    assert rel_err(o[0], _recurrent(q, k, v, g, beta, s0)[0][0]) < 1e-6


# ------------------------------------------------------------------ MLA cores and the indexer


def latent_inputs(seed, b, t, h=3, dn=10, dr=6, dv=12, r=20):
    rng = np.random.default_rng(seed)
    f = lambda *sh: rng.standard_normal(sh).astype(np.float32)  # noqa: E731
    q_nope, q_pe, c_kv, k_pe = f(b, t, h, dn), f(b, t, h, dr), f(b, t, r), f(b, t, dr)
    w = (f(r, h * (dn + dv)) / np.sqrt(r)).reshape(r, h, dn + dv)
    return q_nope, q_pe, c_kv, k_pe, w[..., :dn], w[..., dn:], (dn + dr) ** -0.5


def core_reference(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, ids, allowed=None):
    """Per-document float64 MHA over the latents expanded by kv_b, for a packed batch."""
    k_nope = np.einsum("bsr,rhd->bshd", c_kv.astype(np.float64), w_uk)
    v = np.einsum("bsr,rhd->bshd", c_kv.astype(np.float64), w_uv)
    return np.stack([RA.mla_attention_core_packed(q_nope[r], q_pe[r], k_nope[r], k_pe[r], v[r], scale, ids[r],
                                                  None if allowed is None else allowed[r])
                     for r in range(len(ids))])


def test_mla_cores_packed():
    ids = SMALL_IDS
    b, t = ids.shape
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale = latent_inputs(0, b, t)
    k_nope = np.einsum("bsr,rhd->bshd", c_kv, w_uk)
    v = np.einsum("bsr,rhd->bshd", c_kv, w_uv)
    causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    want = core_reference(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, ids)
    naive = jax.jit(_mla.mla_attention, static_argnames="scale")(
        q_nope, q_pe, k_nope, k_pe, v, causal, scale=scale, segment_ids=ids)
    absorbed = jax.jit(_mla.mla_attention_absorbed, static_argnames="scale")(
        q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, causal, scale=scale, segment_ids=ids)
    for got in (naive, absorbed):
        assert rel_err(got, want) < 1e-5, rel_err(got, want)
        assert (np.asarray(got)[ids == 0] == 0).all()
    plain = _mla.mla_attention(q_nope, q_pe, k_nope, k_pe, v, causal, scale)
    assert rel_err(np.asarray(plain)[ids != 0], want[ids != 0]) > 1e-2
    # queries that are not the keys: the last 6 positions, with the keys' ids given apart
    rows = slice(t - 6, t)
    mask = causal[:, rows]
    tail = _mla.mla_attention_absorbed(q_nope[:, rows], q_pe[:, rows], c_kv, k_pe, w_uk, w_uv, mask, scale,
                                       segment_ids=ids[:, rows], kv_segment_ids=ids)
    assert rel_err(tail, want[:, rows]) < 1e-5


def test_mla_sparse_packed():
    """The sparse core drops selected keys of other documents by itself (the selection here is
    not segment-aware: a query's own position plus random earlier positions of any document)."""
    ids = SMALL_IDS
    b, t = ids.shape
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale = latent_inputs(1, b, t)
    rng = np.random.default_rng(2)
    kk = 6
    idx = np.zeros((b, t, kk), np.int32)
    valid = np.zeros((b, t, kk), bool)
    for bi in range(b):
        for ti in range(t):
            earlier = [s for s in rng.permutation(ti + 1) if s != ti][:kk - 1]
            n = 1 + len(earlier)
            idx[bi, ti, :n], valid[bi, ti, :n] = [ti, *earlier], rng.random(n) < 0.85
            valid[bi, ti, 0] = True
    allowed = selected(idx, valid, t)
    crossing = allowed & (ids[:, :, None] != ids[:, None, :])
    assert crossing[ids != 0].any()  # some selections reach into other documents
    got = jax.jit(_mla.mla_attention_sparse, static_argnames="scale")(
        q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, valid, scale=scale, segment_ids=ids)
    want = core_reference(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, ids, allowed)
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
    assert (np.asarray(got)[ids == 0] == 0).all()


_select = jax.jit(_indexer.select_topk, static_argnames=("top_k", "key_block"))


def packed_fragile(scores, topk, ids):
    """fragile_rows per document (its own block of the row's scores)."""
    out = np.zeros(len(ids), bool)
    for s, e in RK.document_spans(ids):
        out[s:e] = fragile_rows(scores[s:e, s:e], topk)
    return out


def position_in_document(ids):
    pos = np.zeros(ids.shape, np.int64)
    for r, s, e in documents(ids):
        pos[r, s:e] = np.arange(e - s)
    return pos


@pytest.mark.parametrize("key_block", [None, 5])
@pytest.mark.parametrize("topk", [4, 8, 50])
def test_select_topk_packed(topk, key_block):
    ids = SMALL_IDS
    b, t = ids.shape
    (q, w, k), scores = _indexer_setup(4, b=b, t=t)
    idx, valid = _select(q, w, k, jnp.arange(t), jnp.ones((b, t), bool), top_k=topk, key_block=key_block,
                         segment_ids=ids)
    n_valid = np.asarray(valid).sum(-1)
    want_n = np.where(ids != 0, np.minimum(topk, position_in_document(ids) + 1), 0)
    np.testing.assert_array_equal(n_valid, want_n)
    mask = selected(idx, valid, t)
    assert (mask.sum(-1) == n_valid).all()  # no duplicate valid slots
    assert not (mask & (ids[:, :, None] != ids[:, None, :])).any()
    checked = 0
    for r in range(b):
        want = RA.indexer_select_packed(scores[r], topk, ids[r])
        ok = ~packed_fragile(scores[r], topk, ids[r])
        assert ok.mean() > 0.8
        np.testing.assert_array_equal(mask[r][ok], want[ok])
        checked += ok.sum()
    if topk >= t:  # a top-k larger than every document: all of the document's earlier tokens
        same = (ids[:, :, None] == ids[:, None, :]) & (ids != 0)[:, :, None]
        np.testing.assert_array_equal(mask, same & np.tril(np.ones((t, t), bool)))
    assert checked > b * t // 2


# ------------------------------------------------------------------ mixers


def kda_mixer_fns(variant):
    """(cfg, hf, state, packed forward, per-document forward) for a randomised KDAMixer."""
    cfg, hf, state, _, graphdef = build_kda(variant)

    @jax.jit
    def packed(st, x, ids):
        y, cache = nnx.merge(graphdef, st)(x, segment_ids=ids)
        return y, cache.state, cache.conv

    @jax.jit
    def alone(st, x, valid):  # right-padded documents: identity steps after the end
        return nnx.merge(graphdef, st)(x, None, valid)

    return cfg, hf, state, packed, alone


KDA_MIXER_IDS = packed_ids([-2, 5, 1, 20, 9, -3], [17, 1, 22])  # chunk 16: starts mid-chunk


@pytest.mark.parametrize("variant", VARIANTS)
def test_kda_mixer_packed(variant):
    cfg, hf, state, packed, alone = kda_mixer_fns(variant)
    ids = KDA_MIXER_IDS
    x = np.random.default_rng(5).standard_normal(ids.shape + (cfg.hidden_size,)).astype(np.float32)
    y, s, conv = packed(state, x, ids)
    docs = documents(ids)
    x_docs, valid = stack_documents(x, docs)
    y_alone = unstack_documents(alone(state, x_docs, valid)[0], docs, y.shape)
    assert rel_err(y, y_alone) < 1e-5, rel_err(y, y_alone)
    assert (np.asarray(y)[ids == 0] == 0).all()
    for r in range(len(ids)):
        y_ref, s_ref, hist_ref = RK.kda_layer_packed(x[r], hf, kda_ref_cfg(cfg), ids[r])
        assert rel_err(y[r], y_ref) < 1e-5, rel_err(y[r], y_ref)
        assert rel_err(s[r], s_ref) < 1e-5, rel_err(s[r], s_ref)
        for j, br in enumerate("qkv"):  # conv cache [B, 3, C, K-1]: the last document's own
            np.testing.assert_allclose(np.asarray(conv[r, j]).T, hist_ref[br], rtol=1e-5, atol=1e-6)
    y_plain = nnx.merge(build_kda(variant)[4], state)(x)[0]
    assert rel_err(np.asarray(y_plain)[ids != 0], np.asarray(y)[ids != 0]) > 1e-2


MLA_KINDS = [("dense", "mask"), ("dsa", "mask"), ("dsa", "gather")]


@functools.lru_cache(maxsize=None)
def mla_mixer_fns(kind, form):
    """(cfg, params, state, packed forward, per-document forward) for a randomised MLAMixer:
    dense, or DSA with index_topk 8 (the DSA weights of test_ops_attention)."""
    pure = dsa_weights()
    cfg = mla_cfg(index_topk=8) if kind == "dsa" else mla_cfg()
    if kind == "dense":
        pure = {name: val for name, val in pure.items() if name != "indexer"}
    model = abstract(MLAMixer, cfg)
    set_params(model, pure)
    graphdef, state = nnx.split(model)
    backends = Backends(kernels="xla", sparse=form)

    @jax.jit
    def packed(st, x, ids):
        return nnx.merge(graphdef, st)(x, backends=backends, segment_ids=ids)[0]

    @jax.jit
    def alone(st, x, valid):  # right-padded documents: later keys are invalid
        return nnx.merge(graphdef, st)(x, key_valid=valid, backends=backends)[0]

    return cfg, pure, state, packed, alone


MLA_MIXER_IDS = packed_ids([-1, 5, 1, 12, 6, -1], [9, 1, 16])  # top-k 8: docs 5, 1, 6 dense


def mla_reference(cfg, pure, x, ids):
    """(y, fragile tokens) from refs.mla_layer_packed; fragile: DSA near-ties of the k-th key."""
    index = None
    fragile = np.zeros(ids.shape, bool)
    if cfg.index_topk is not None:
        index = (indexer_hf(pure), cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk)
    ys = []
    for r in range(len(ids)):
        ys.append(RA.mla_layer_packed(x[r], to_hf(pure), mla_ref_cfg(cfg), ids[r], index))
        if index is not None:
            for s, e in RK.document_spans(ids[r]):
                c_q = RA.mla_latents(x[r, s:e], to_hf(pure), mla_ref_cfg(cfg))["c_q"]
                scores = RA.indexer_scores(x[r, s:e], c_q, *index[:3])
                fragile[r, s:e] = fragile_rows(scores, cfg.index_topk)
    return np.stack(ys), fragile


@pytest.mark.parametrize("kind,form", MLA_KINDS)
def test_mla_mixer_packed(kind, form):
    cfg, pure, state, packed, alone = mla_mixer_fns(kind, form)
    ids = MLA_MIXER_IDS
    x = np.random.default_rng(6).standard_normal(ids.shape + (cfg.hidden_size,)).astype(np.float32)
    y = np.asarray(packed(state, x, ids))
    docs = documents(ids)
    x_docs, valid = stack_documents(x, docs)
    y_alone = unstack_documents(alone(state, x_docs, valid), docs, y.shape)
    want, fragile = mla_reference(cfg, pure, x, ids)
    assert fragile.mean() < 0.2
    ok = ~fragile
    assert rel_err(y[ok], want[ok]) < 1e-5, rel_err(y[ok], want[ok])
    assert rel_err(y[ok], y_alone[ok]) < 1e-5, rel_err(y[ok], y_alone[ok])
    assert (y[ids == 0] == 0).all()
    plain = np.asarray(alone(state, x, np.ones(ids.shape, bool)))  # the rows unsegmented
    assert rel_err(plain[ids != 0], y[ids != 0]) > 1e-2


# ------------------------------------------------------------------ gradients


GRAD_IDS = packed_ids([-1, 5, 1, 20, 17, -6], [16, 1, 33])  # chunk 16


def test_kda_chunked_grads_packed_equal_documents_alone():
    ids = GRAD_IDS
    q, k, v, g, beta, _ = kda_packed_inputs(7, ids)
    cot = np.random.default_rng(8).standard_normal(q.shape[:3] + v.shape[-1:]).astype(np.float32)
    docs = documents(ids)

    def loss_packed(*arrays):
        return jnp.sum(_kda.kda_chunked(*arrays, chunk_size=16, segment_ids=ids)[0] * cot)

    def loss_alone(*arrays):
        valid = jnp.asarray(stack_documents(q, docs)[1])
        qd, kd, vd, gd, bd = arrays
        gd, bd = _kda.kda_mask_padding(valid, gd, bd)
        return jnp.sum(_kda.kda_chunked(qd, kd, vd, gd, bd, chunk_size=16)[0] * stack_documents(cot, docs)[0])

    args = (q, k, v, g, beta)
    grads = jax.jit(jax.grad(loss_packed, argnums=tuple(range(5))))(*args)
    stacked = [stack_documents(a, docs)[0] for a in args]
    grads_alone = jax.jit(jax.grad(loss_alone, argnums=tuple(range(5))))(*stacked)
    for name, got, want in zip("q k v g beta".split(), grads, grads_alone):
        got = np.asarray(got)
        assert np.isfinite(got).all(), name
        assert (got[ids == 0] == 0).all(), name  # padding takes no part
        want = unstack_documents(want, docs, got.shape)
        assert np.abs(want).max() > 1e-3, name
        assert rel_err(got, want) < 1e-5, (name, rel_err(got, want))


def param_grads_close(got, want, tol=2e-5):
    leaves_got, leaves_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(leaves_got) == len(leaves_want) > 5
    for a, b in zip(leaves_got, leaves_want):
        assert np.isfinite(np.asarray(a)).all()
        assert rel_err(a, b) < tol, rel_err(a, b)
    assert max(float(np.abs(np.asarray(a)).max()) for a in leaves_want) > 1e-3


def test_kda_mixer_grads_packed_equal_sum_of_documents():
    cfg, _, state, _, _ = kda_mixer_fns("full_rank_lb")
    graphdef = build_kda("full_rank_lb")[4]
    ids = KDA_MIXER_IDS
    rng = np.random.default_rng(9)
    x = rng.standard_normal(ids.shape + (cfg.hidden_size,)).astype(np.float32)
    cot = rng.standard_normal(x.shape).astype(np.float32)
    docs = documents(ids)
    (x_docs, valid), cot_docs = stack_documents(x, docs), stack_documents(cot, docs)[0]
    packed = jax.jit(jax.grad(lambda st: jnp.sum(nnx.merge(graphdef, st)(x, segment_ids=ids)[0] * cot)))
    alone = jax.jit(jax.grad(lambda st: jnp.sum(nnx.merge(graphdef, st)(x_docs, None, valid)[0] * cot_docs)))
    param_grads_close(packed(state), alone(state))


@pytest.mark.parametrize("kind,form", [("dsa", "gather")])
def test_mla_mixer_grads_packed_equal_sum_of_documents(kind, form):
    cfg, pure, state, packed_fwd, alone_fwd = mla_mixer_fns(kind, form)
    ids = MLA_MIXER_IDS
    rng = np.random.default_rng(10)
    x = rng.standard_normal(ids.shape + (cfg.hidden_size,)).astype(np.float32)
    _, fragile = mla_reference(cfg, pure, x, ids)
    assert fragile.mean() < 0.2
    # a near-tie of the k-th key could flip a selection between the two runs: leave the
    # fragile tokens' outputs out of the loss
    cot = rng.standard_normal(x.shape).astype(np.float32) * ~fragile[..., None]
    docs = documents(ids)
    (x_docs, valid), cot_docs = stack_documents(x, docs), stack_documents(cot, docs)[0]
    packed = jax.jit(jax.grad(lambda st: jnp.sum(packed_fwd(st, x, ids) * cot)))
    alone = jax.jit(jax.grad(lambda st: jnp.sum(alone_fwd(st, x_docs, valid) * cot_docs)))
    param_grads_close(packed(state), alone(state))


# ------------------------------------------------------------------ errors


def test_bad_segment_ids_are_refused():
    x = np.zeros((2, 6, 3), np.float32)
    w = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match=r"short_conv: segment_ids must be an integer array of shape \(2, 6\)"):
        _kda.short_conv(x, w, segment_ids=np.ones((2, 5), np.int32))
    q = np.zeros((2, 6, 1, 4), np.float32)
    with pytest.raises(ValueError, match="kda_chunked: segment_ids must be an integer"):
        _kda.kda_chunked(q, q, q, q, q[..., 0], segment_ids=np.ones((2, 6), np.float32))
    with pytest.raises(ValueError, match="kda_recurrent: segment_ids"):
        _kda.kda_recurrent(q, q, q, q, q[..., 0], segment_ids=np.ones((6,), np.int32))
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale = latent_inputs(0, 2, 6)
    mask = np.ones((2, 3, 6), bool)
    tail = (q_nope[:, :3], q_pe[:, :3], c_kv, k_pe, w_uk, w_uv, mask, scale)
    with pytest.raises(ValueError, match="mla_attention_absorbed: 6 keys but 3 queries; pass kv_segment_ids"):
        _mla.mla_attention_absorbed(*tail, segment_ids=np.ones((2, 3), np.int32))
    with pytest.raises(ValueError, match=r"absorbed: kv_segment_ids must be an integer array of shape \(2, 6\)"):
        _mla.mla_attention_absorbed(*tail, segment_ids=np.ones((2, 3), np.int32),
                                    kv_segment_ids=np.ones((2, 5), np.int32))


def test_segment_ids_with_a_cache_are_refused():
    cfg, _, state, _, _ = kda_mixer_fns("full_rank_lb")
    kda = nnx.merge(build_kda("full_rank_lb")[4], state)
    x = np.zeros((1, 3, cfg.hidden_size), np.float32)
    ids = np.ones((1, 3), np.int32)
    h, dk = cfg.kda_num_heads, cfg.kda_head_dim
    with pytest.raises(ValueError, match="KDAMixer: segment_ids"):
        kda(x, KDALayerCache(np.zeros((1, h, dk, dk), np.float32),
                             np.zeros((1, 3, h * dk, cfg.kda_conv_size - 1), np.float32)), segment_ids=ids)
    mcfg, _, mstate, _, _ = mla_mixer_fns("dense", "mask")
    model = abstract(MLAMixer, mcfg)
    nnx.update(model, mstate)
    caches = (np.zeros((1, 8, mcfg.kv_lora_rank), np.float32), np.zeros((1, 8, mcfg.qk_rope_head_dim), np.float32))
    with pytest.raises(ValueError, match="MLAMixer: segment_ids"):
        model(np.zeros((1, 3, mcfg.hidden_size), np.float32), MLALayerCache(*caches, None),
              key_valid=np.ones((1, 8), bool), segment_ids=ids)
