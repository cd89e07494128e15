"""Gated NoPE MLA, the lightning indexer and DSA sparse attention vs float64 NumPy (attention.md).

Covers: MLAMixer vs `refs.mla_layer` (with / without q-LoRA and the output gate), naive ==
absorbed == float64 on random latents, indexer scores vs `refs.indexer_scores`, `select_topk`
== brute force as sets (with and without key-block streaming, top-k larger than the context,
absolute query positions, padded keys), DSA with index_topk >= T bitwise equal to dense on the
mask path, index_topk < T vs `refs.mla_layer(allowed=refs.indexer_select(...))`, the gather
path == the mask path, and prefill + decode through the latent / index caches == no cache.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.model import abstract, rel_err
from k31jax.config import ModelConfig
from k31jax.nn import MLALayerCache, MLAMixer
from k31jax.ops import Backends, _indexer, _mla
import refs as R


def fragile_rows(scores, topk, tol=1e-5):
    """Rows whose k-th and (k+1)-th best causal candidates are closer than tol (ties)."""
    out = np.zeros(scores.shape[0], bool)
    for t in range(scores.shape[0]):
        row = np.sort(scores[t][np.isfinite(scores[t])])[::-1]
        if len(row) > topk:
            out[t] = row[topk - 1] - row[topk] < tol * max(1.0, abs(row[topk - 1]))
    return out


# ------------------------------------------------------------------ module set-up

BASE = dict(hidden_size=40, num_attention_heads=3, q_lora_rank=24, kv_lora_rank=20,
            qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12, index_n_heads=3,
            index_head_dim=10, dtype="float32")

HF_NAMES = {"q_a_proj": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight",
            "q_b_proj": "q_b_proj.weight", "q_proj": "q_proj.weight",
            "kv_a_proj": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
            "kv_b_proj": "kv_b_proj.weight", "g_proj": "g_proj.weight", "o_proj": "o_proj.weight"}


def mla_cfg(**kw):
    return ModelConfig.preset("tiny").replace(**{**BASE, "index_topk": None, **kw})


def random_params(model, rng):
    """numpy randoms for every parameter of an MLAMixer (nested pure dict, [in, out] layout)."""
    def fill(tree):
        out = {}
        for name, val in tree.items():
            if isinstance(val, dict):
                out[name] = fill(val)
                continue
            shape = val.shape
            if name.endswith("norm") or name == "k_norm_weight":
                arr = 1.0 + 0.3 * rng.standard_normal(shape)
            elif name == "k_norm_bias":
                arr = 0.3 * rng.standard_normal(shape)
            else:
                gain = 1.5 if name in ("q_b_proj", "q_proj", "kv_b_proj", "wq_b", "wk") else 1.0
                arr = gain * rng.standard_normal(shape) / np.sqrt(shape[0])
            out[name] = arr.astype(np.float32)
        return out
    return fill(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def set_params(model, pure):
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(jnp.asarray, pure))
    nnx.update(model, state)


def to_hf(pure):
    hf = {}
    for name, arr in pure.items():
        if name == "indexer":
            continue
        hf[HF_NAMES[name]] = arr if arr.ndim == 1 else arr.T
    return hf


def indexer_hf(pure):
    ix = pure["indexer"]
    return dict(wq_b=ix["wq_b"].T, wk=ix["wk"].T, k_norm_weight=ix["k_norm_weight"],
                k_norm_bias=ix["k_norm_bias"], weights_proj=ix["weights_proj"].T)


def ref_cfg(cfg):
    return dict(num_heads=cfg.num_attention_heads, qk_nope_head_dim=cfg.qk_nope_head_dim,
                qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank)


class Built:
    """A randomised MLAMixer plus a jitted functional forward."""

    def __init__(self, cfg, pure=None, seed=0):
        model = abstract(MLAMixer, cfg)
        if pure is None:
            pure = random_params(model, np.random.default_rng(seed))
        set_params(model, pure)
        self.cfg, self.pure, self.hf = cfg, pure, to_hf(pure)
        graphdef, self.state = nnx.split(model)

        @functools.partial(jax.jit, static_argnames=("sparse_form",))
        def fwd(st, x, c_kv, k_pe, idx_cache, pos, key_valid, sparse_form):
            cache = None if c_kv is None else MLALayerCache(c_kv, k_pe, idx_cache)
            y, cache = nnx.merge(graphdef, st)(x, cache, pos=pos, key_valid=key_valid,
                                               backends=Backends(sparse=sparse_form))
            return (y, None, None, None) if cache is None else (y, cache.ckv, cache.kpe, cache.index_keys)

        self._fwd = fwd

    def __call__(self, x, caches=(None, None, None), pos=0, key_valid=None, sparse_form="mask"):
        if key_valid is None:  # always pass one (all True), so fewer shapes get compiled
            key_valid = np.ones(x.shape[:2], bool)
        return self._fwd(self.state, x, *caches, jnp.int32(pos), key_valid, sparse_form)


@functools.lru_cache(maxsize=None)
def dsa_weights():
    """One set of DSA weights (index_topk = 8) shared by the dense and DSA variants below."""
    cfg = mla_cfg(index_topk=8)
    return random_params(abstract(MLAMixer, cfg), np.random.default_rng(5))


@functools.lru_cache(maxsize=None)
def built(kind, topk=None):
    if kind == "dense":  # the DSA weights without the indexer
        pure = {k: v for k, v in dsa_weights().items() if k != "indexer"}
        return Built(mla_cfg(), pure)
    if kind == "dsa":
        return Built(mla_cfg(index_topk=topk), dsa_weights())
    q_lora, gate = kind
    return Built(mla_cfg(q_lora_rank=24 if q_lora else None, mla_use_output_gate=gate), seed=11)


def xs(seed, b, t, d=BASE["hidden_size"]):
    return np.random.default_rng(seed).standard_normal((b, t, d)).astype(np.float32)


# ------------------------------------------------------------------ MLA vs reference


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "nogate"])
def test_mla_mixer_vs_reference(q_lora, gate):
    m = built((q_lora, gate))
    assert ("q_a_proj.weight" in m.hf) == q_lora and ("q_proj.weight" in m.hf) != q_lora
    assert ("g_proj.weight" in m.hf) == gate
    x = xs(1, 2, 13)
    y = np.asarray(m(x)[0])  # T > 1: the naive (MHA) form
    wants = [R.mla_layer(x[b], m.hf, ref_cfg(m.cfg)) for b in range(2)]
    for b in range(2):
        assert rel_err(y[b], wants[b]) < 1e-5, rel_err(y[b], wants[b])
    # T == 1 with a cache: the absorbed (MQA) form over a latent cache filled from the reference
    # latents (post-norm c_kv, raw k_pe), 3 spare slots masked out by key_valid
    s_max, t = 16, 13
    lats = [R.mla_latents(x[b], m.hf, ref_cfg(m.cfg)) for b in range(2)]
    c_kv = np.zeros((2, s_max, m.cfg.kv_lora_rank), np.float32)
    k_pe = np.zeros((2, s_max, m.cfg.qk_rope_head_dim), np.float32)
    for b in range(2):
        c_kv[b, :t - 1], k_pe[b, :t - 1] = lats[b]["c_kv"][:-1], lats[b]["k_pe"][:-1]
        c_kv[b, t:], k_pe[b, t:] = 50.0, 50.0  # junk in unwritten slots
    key_valid = np.arange(s_max)[None].repeat(2, 0) < t
    y1, c_kv_out, k_pe_out, _ = m(x[:, t - 1:], (c_kv, k_pe, None), pos=t - 1, key_valid=key_valid)
    for b in range(2):
        assert rel_err(np.asarray(y1)[b, 0], wants[b][-1]) < 1e-5
        assert rel_err(np.asarray(c_kv_out)[b, t - 1], lats[b]["c_kv"][-1]) < 1e-5
        assert rel_err(np.asarray(k_pe_out)[b, t - 1], lats[b]["k_pe"][-1]) < 1e-5


def test_mla_output_gate_matters():
    """Guards the gate parametrisation: the gate weights really change the output."""
    m = built((True, True))
    x = xs(1, 2, 13)
    hf_nogate = {k: v for k, v in m.hf.items() if k != "g_proj.weight"}
    with_gate = R.mla_layer(x[0], m.hf, ref_cfg(m.cfg))
    without = R.mla_layer(x[0], hf_nogate, ref_cfg(m.cfg))
    assert rel_err(without, with_gate) > 1e-2
    assert rel_err(np.asarray(m(x)[0])[0], with_gate) < 1e-5


def _random_latent_attention(seed, b=2, t=5, s=11, h=3, dn=10, dr=6, dv=12, r=20):
    rng = np.random.default_rng(seed)
    f = lambda *sh: rng.standard_normal(sh).astype(np.float32)
    q_nope, q_pe = f(b, t, h, dn), f(b, t, h, dr)
    c_kv, k_pe = f(b, s, r), f(b, s, dr)
    w_kvb = f(r, h * (dn + dv)) / np.sqrt(r)
    w = w_kvb.reshape(r, h, dn + dv)
    w_uk, w_uv = w[..., :dn], w[..., dn:]
    pos = s - t + np.arange(t)  # queries are the last t positions
    mask = (np.arange(s)[None, None, :] <= pos[None, :, None]) & (rng.random((b, 1, s)) < 0.8)
    mask[..., 0] = True  # keep at least one key per row
    return q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, mask, (dn + dr) ** -0.5


def _f64_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, mask, scale):
    """Float64 MHA over the latents expanded by kv_b (per head k_nope = W_UK c, v = W_UV c)."""
    k_nope = np.einsum("bsr,rhd->bshd", c_kv, w_uk.astype(np.float64))
    v = np.einsum("bsr,rhd->bshd", c_kv, w_uv.astype(np.float64))
    logits = (np.einsum("bthd,bshd->bhts", q_nope, k_nope)
              + np.einsum("bthd,bsd->bhts", q_pe, k_pe.astype(np.float64))) * scale
    p = R.softmax(np.where(mask[:, None], logits, -np.inf), axis=-1)
    return np.einsum("bhts,bshd->bthd", p, v)


def test_absorbed_equals_naive_on_random_latents():
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, mask, scale = _random_latent_attention(0)
    k_nope = np.einsum("bsr,rhd->bshd", c_kv, w_uk)
    v = np.einsum("bsr,rhd->bshd", c_kv, w_uv)
    naive = np.asarray(jax.jit(_mla.mla_attention, static_argnames="scale")(
        q_nope, q_pe, k_nope, k_pe, v, mask, scale=scale))
    absorbed = np.asarray(jax.jit(_mla.mla_attention_absorbed, static_argnames="scale")(
        q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, mask, scale=scale))
    want = _f64_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, mask, scale)
    assert rel_err(naive, want) < 1e-5, rel_err(naive, want)
    assert rel_err(absorbed, want) < 1e-5, rel_err(absorbed, want)
    assert rel_err(absorbed, naive) < 1e-5
    # the mask matters (guards against an ignored mask)
    full = _f64_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, np.ones_like(mask), scale)
    assert rel_err(full, want) > 1e-2


def test_sparse_gather_equals_masked_absorbed_ops():
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, _, scale = _random_latent_attention(1)
    b, t, s = q_nope.shape[0], q_nope.shape[1], c_kv.shape[1]
    rng = np.random.default_rng(2)
    kk = 4
    idx = np.stack([np.stack([rng.permutation(s)[:kk] for _ in range(t)]) for _ in range(b)])
    valid = rng.random((b, t, kk)) < 0.8
    valid[..., 0] = True
    mask = np.asarray(_indexer.selection_mask(jnp.asarray(idx, jnp.int32), jnp.asarray(valid), s))
    want_mask = np.zeros((b, t, s), bool)
    for bi in range(b):
        for ti in range(t):
            want_mask[bi, ti, idx[bi, ti][valid[bi, ti]]] = True
    np.testing.assert_array_equal(mask, want_mask)
    sparse = jax.jit(_mla.mla_attention_sparse, static_argnames="scale")(
        q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, valid, scale=scale)
    want = _f64_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, mask, scale)
    assert rel_err(sparse, want) < 1e-5, rel_err(sparse, want)
    # the same layer as row 2 of a 3-layer stack (the model's cache), gathered in place: the
    # other rows are noise that a wrong row index would read
    stacks = [np.stack([rng.standard_normal(a.shape).astype(a.dtype), rng.standard_normal(a.shape).astype(a.dtype),
                        a]) for a in (c_kv, k_pe)]
    stacked = jax.jit(_mla.mla_attention_sparse, static_argnames="scale")(
        q_nope, q_pe, *stacks, w_uk, w_uv, idx, valid, scale=scale, layer=jnp.int32(2))
    np.testing.assert_allclose(stacked, sparse, rtol=1e-6, atol=1e-6)
    wrong = _mla.mla_attention_sparse(q_nope, q_pe, *stacks, w_uk, w_uv, idx, valid, scale=scale, layer=1)
    assert rel_err(wrong, want) > 1e-2


# ------------------------------------------------------------------ indexer


def _indexer_setup(seed, b=2, t=23):
    """Random x / c_q and indexer weights; (jax q, w, k), and per-row f64 reference scores."""
    rng = np.random.default_rng(seed)
    d, rq, hi, di = 40, 24, 3, 10
    x = rng.standard_normal((b, t, d)).astype(np.float32)
    c_q = rng.standard_normal((b, t, rq)).astype(np.float32)
    p = dict(wq_b=rng.standard_normal((rq, hi * di)) / np.sqrt(rq),
             wk=rng.standard_normal((d, di)) / np.sqrt(d),
             k_norm_weight=1.0 + 0.3 * rng.standard_normal(di),
             k_norm_bias=0.3 * rng.standard_normal(di),
             weights_proj=rng.standard_normal((d, hi)) / np.sqrt(d))
    p = {k: v.astype(np.float32) for k, v in p.items()}
    q, w = _indexer.indexer_queries(c_q, p["wq_b"], x, p["weights_proj"], hi)
    k = _indexer.indexer_keys(x, p["wk"], p["k_norm_weight"], p["k_norm_bias"])
    hf = dict(wq_b=p["wq_b"].T, wk=p["wk"].T, k_norm_weight=p["k_norm_weight"],
              k_norm_bias=p["k_norm_bias"], weights_proj=p["weights_proj"].T)
    ref = np.stack([R.indexer_scores(x[i], c_q[i], hf, hi, di) for i in range(b)])
    return (np.asarray(q), np.asarray(w), np.asarray(k)), ref


def test_indexer_scores_vs_reference():
    (q, w, k), ref = _indexer_setup(0)
    got = np.asarray(_indexer.indexer_scores(q, w, k))
    causal = np.tril(np.ones(ref.shape[1:], bool))[None]
    np.testing.assert_array_equal(np.isfinite(ref), np.broadcast_to(causal, ref.shape))
    scale = np.max(np.abs(ref[:, causal[0]]))
    err = np.max(np.abs(got - ref)[np.broadcast_to(causal, ref.shape)])
    assert err / scale < 1e-5, err / scale
    assert (ref[:, causal[0]] < 0).any() and (ref[:, causal[0]] > 0).any()  # signed scores


def selected(idx, valid, s_len):
    """The selection as a boolean [B, T, S] set built in NumPy from the valid slots only."""
    idx, valid = np.asarray(idx), np.asarray(valid)
    out = np.zeros(idx.shape[:2] + (s_len,), bool)
    bi, ti, ki = np.nonzero(valid)
    out[bi, ti, idx[bi, ti, ki]] = True
    return out


def _check_selection(sel_mask, ref_scores, topk, rows):
    """sel_mask [T', S] vs the brute-force selection for `rows` of the reference, as sets."""
    want = R.indexer_select(ref_scores, topk)[rows]
    fragile = fragile_rows(ref_scores, topk)[rows]
    assert fragile.mean() < 0.2  # the comparison is not vacuous
    ok = ~fragile
    np.testing.assert_array_equal(sel_mask[ok], want[ok])
    return ok.sum()


_select = jax.jit(_indexer.select_topk, static_argnames=("top_k", "key_block"))


@pytest.mark.parametrize("key_block", [None, 5, 7, 64], ids=["dense", "kb5", "kb7", "kb_big"])
def test_select_topk_vs_bruteforce(key_block):
    (q, w, k), ref = _indexer_setup(0)
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    topk = 8
    idx, valid = _select(q, w, k, jnp.arange(t), jnp.ones((b, s), bool), top_k=topk,
                         key_block=key_block)
    assert idx.shape == (b, t, topk)
    np.testing.assert_array_equal(np.asarray(valid).sum(-1),
                                  np.broadcast_to(np.minimum(np.arange(t) + 1, topk), (b, t)))
    mask = selected(idx, valid, s)
    assert (mask.sum(-1) == np.asarray(valid).sum(-1)).all()  # no duplicate valid slots
    for bi in range(b):
        assert _check_selection(mask[bi], ref[bi], topk, np.arange(t)) > t // 2
    # absolute query positions (the decode / continuation case): the last 4 rows only
    rows = np.arange(t - 4, t)
    idx2, valid2 = _select(q[:, rows], w[:, rows], k, jnp.asarray(rows), jnp.ones((b, s), bool),
                           top_k=topk, key_block=key_block)
    mask2 = selected(idx2, valid2, s)
    for bi in range(b):
        _check_selection(mask2[bi], ref[bi], topk, rows)
    # the library's own scatter agrees with the NumPy one
    np.testing.assert_array_equal(np.asarray(_indexer.selection_mask(idx, valid, s)), mask)


@pytest.mark.parametrize("key_block", [None, 5])
def test_select_topk_respects_key_valid(key_block):
    (q, w, k), ref = _indexer_setup(0)
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    topk = 8
    key_valid = np.ones((b, s), bool)
    key_valid[0, :4] = False           # left padding
    key_valid[1, [6, 7, 15]] = False   # holes
    idx, valid = _select(q, w, k, jnp.arange(t), key_valid, top_k=topk, key_block=key_block)
    mask = selected(idx, valid, s)
    for bi in range(b):
        sc = np.where(key_valid[bi][None, :], ref[bi], -np.inf)
        fragile = fragile_rows(sc, topk)
        assert fragile.mean() < 0.2
        for ti in range(t):
            cand = np.flatnonzero(np.isfinite(sc[ti]))
            want = set(cand[np.argsort(-sc[ti, cand], kind="stable")[:topk]])
            assert mask[bi, ti].sum() == np.asarray(valid)[bi, ti].sum() == min(topk, len(cand))
            assert not (mask[bi, ti] & ~key_valid[bi]).any()
            if not fragile[ti]:
                assert set(np.flatnonzero(mask[bi, ti])) == want, (bi, ti)


@pytest.mark.parametrize("key_block", [None, 5])
def test_topk_larger_than_context(key_block):
    (q, w, k), _ = _indexer_setup(0)
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    idx, valid = _select(q, w, k, jnp.arange(t), jnp.ones((b, s), bool), top_k=50,
                         key_block=key_block)
    assert idx.shape == (b, t, s)  # min(k, S) slots
    causal = np.broadcast_to(np.tril(np.ones((t, s), bool)), (b, t, s))
    np.testing.assert_array_equal(selected(idx, valid, s), causal)
    np.testing.assert_array_equal(np.asarray(_indexer.selection_mask(idx, valid, s)), causal)


def test_selection_mask_with_duplicate_invalid_slots():
    """Regression: an invalid slot repeating a valid slot's index must not clear it.

    select_topk(key_block=...) fills the empty slots of rows with < k candidates with index 0
    (its initial carry); a `.set(valid)` scatter then dropped key 0 from the first k-1 rows.
    """
    # minimal: slot 0 selects key 0; slots 1, 2 are empty but also carry index 0
    got = np.asarray(_indexer.selection_mask(jnp.array([[[0, 0, 0]]], jnp.int32),
                                             jnp.array([[[True, False, False]]]), 4))
    np.testing.assert_array_equal(got, [[[True, False, False, False]]])
    # as composed in practice: the streamed top-k followed by the scatter
    (q, w, k), _ = _indexer_setup(0)
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    idx, valid = _select(q, w, k, jnp.arange(t), jnp.ones((b, s), bool), top_k=8, key_block=5)
    np.testing.assert_array_equal(np.asarray(_indexer.selection_mask(idx, valid, s)),
                                  selected(idx, valid, s))


# ------------------------------------------------------------------ DSA at module level

T_DSA = 26


def test_dsa_topk_ge_T_is_bitwise_dense():
    x = xs(3, 2, T_DSA)
    dense = np.asarray(built("dense")(x)[0])
    # no cache, index_topk == T (the boundary case)
    y = np.asarray(built("dsa", T_DSA)(x, sparse_form="mask")[0])
    np.testing.assert_array_equal(y, dense)
    # ops level: the selection mask for top-k >= T is exactly causal, so the masked MLA is bitwise
    (q, w, k), _ = _indexer_setup(1, b=2, t=T_DSA)
    idx, valid = _indexer.select_topk(q, w, k, jnp.arange(T_DSA), jnp.ones((2, T_DSA), bool), T_DSA)
    causal = np.broadcast_to(np.tril(np.ones((T_DSA, T_DSA), bool)), (2, T_DSA, T_DSA))
    sel = causal & np.asarray(_indexer.selection_mask(idx, valid, T_DSA))
    np.testing.assert_array_equal(sel, causal)


def test_dsa_topk_ge_valid_keys_with_cache_is_bitwise_dense():
    """A 40-slot cache makes the selection path run (top-k 30 < 40 slots) on the mask path."""
    x = xs(4, 2, 20)
    s_max = 40
    key_valid = np.arange(s_max)[None].repeat(2, 0) < 20
    outs = {}
    for kind, topk in (("dense", None), ("dsa", 30)):
        m = built(kind, topk)
        caches = (np.zeros((2, s_max, m.cfg.kv_lora_rank), np.float32),
                  np.zeros((2, s_max, m.cfg.qk_rope_head_dim), np.float32),
                  np.zeros((2, s_max, m.cfg.index_head_dim), np.float32) if topk else None)
        outs[kind] = np.asarray(m(x, caches, pos=0, key_valid=key_valid, sparse_form="mask")[0])
    np.testing.assert_array_equal(outs["dsa"], outs["dense"])


def _dsa_reference(m, x_row, topk):
    lat = R.mla_latents(x_row, m.hf, ref_cfg(m.cfg))
    scores = R.indexer_scores(x_row, lat["c_q"], indexer_hf(m.pure), m.cfg.index_n_heads,
                              m.cfg.index_head_dim)
    allowed = R.indexer_select(scores, topk)
    return R.mla_layer(x_row, m.hf, ref_cfg(m.cfg), allowed=allowed), fragile_rows(scores, topk)


def test_dsa_sparse_vs_reference_and_differs_from_dense():
    m = built("dsa", 8)
    x = xs(6, 2, T_DSA)
    y = np.asarray(m(x, sparse_form="mask")[0])
    dense = np.asarray(built("dense")(x)[0])
    for b in range(2):
        want, fragile = _dsa_reference(m, x[b], 8)
        assert fragile.mean() < 0.2
        ok = ~fragile
        assert rel_err(y[b][ok], want[ok]) < 1e-5, rel_err(y[b][ok], want[ok])
        # rows 0..7 see every candidate (exactly dense); later rows are sparse and differ
        np.testing.assert_array_equal(y[b, :8], dense[b, :8])
        assert rel_err(y[b, 8:], dense[b, 8:]) > 1e-2
        dense_ref = R.mla_layer(x[b], m.hf, ref_cfg(m.cfg))
        assert rel_err(want, dense_ref) > 1e-2


def test_dsa_gather_path_equals_mask_path():
    m = built("dsa", 8)
    x = xs(6, 2, T_DSA)
    y_mask = np.asarray(m(x, sparse_form="mask")[0])
    y_gather = np.asarray(m(x, sparse_form="gather")[0])
    assert rel_err(y_gather, y_mask) < 1e-5, rel_err(y_gather, y_mask)


@pytest.mark.parametrize("kind", ["dense", "dsa"])
def test_mla_cache_prefill_decode_matches_no_cache(kind):
    """Prefill 20, a 3-token continuation, then 3 one-token decode steps through the caches."""
    m = built(kind, 8 if kind == "dsa" else None)
    cfg = m.cfg
    b, n, s_max, n_pad = 2, T_DSA, 40, 3
    x = xs(7, b, n)
    tok_valid = np.ones((b, n), bool)
    tok_valid[1, :n_pad] = False  # row 1 is left-padded
    y_ref = np.asarray(m(x, key_valid=tok_valid, sparse_form="mask")[0])
    caches = (np.zeros((b, s_max, cfg.kv_lora_rank), np.float32),
              np.zeros((b, s_max, cfg.qk_rope_head_dim), np.float32),
              np.zeros((b, s_max, cfg.index_head_dim), np.float32) if kind == "dsa" else None)
    outs, pos = [], 0
    for step in (20, 3, 1, 1, 1):
        key_valid = np.zeros((b, s_max), bool)
        key_valid[:, :pos + step] = tok_valid[:, :pos + step]  # written, non-padding slots
        # prefill chunks on the mask path; decode steps with "auto" (absorbed / gather for DSA)
        y, *caches = m(x[:, pos:pos + step], tuple(caches), pos=pos, key_valid=key_valid,
                       sparse_form="auto" if step == 1 else "mask")
        outs.append(np.asarray(y))
        pos += step
    y_inc = np.concatenate(outs, axis=1)
    assert pos == n
    assert np.isfinite(y_inc).all()
    keep = tok_valid  # padded query rows are junk by design
    assert rel_err(y_inc[keep], y_ref[keep]) < 1e-5, rel_err(y_inc[keep], y_ref[keep])
    # the caches hold the post-norm latent and the raw k_pe of every written token
    lat = R.mla_latents(x[0], m.hf, ref_cfg(cfg))
    assert rel_err(np.asarray(caches[0])[0, :n], lat["c_kv"]) < 1e-5
    assert rel_err(np.asarray(caches[1])[0, :n], lat["k_pe"]) < 1e-5
    assert (np.asarray(caches[0])[:, n:] == 0).all()
