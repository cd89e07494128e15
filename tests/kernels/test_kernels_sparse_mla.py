"""Sparse gated-MLA and indexer Pallas kernels in interpret mode (CPU) vs the XLA ops and float64.

Covers: prefill (T queries, each its own selection) and decode (T = 1, split-K with splits made
only of padding), fp32 and bf16 latent caches, heads / latent / pe widths padded in-kernel,
slots that are not candidates (and a query with none), duplicate indices, top-k > context
(k = 40 > S = 21), the dense equivalence (k ≥ S gives the absorbed causal attention), and the
indexer decode scores + top-k compared as sets with fragile rows skipped (attention.md §3).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax.kernels.sparse_mla import head_block, indexer_scores, mla_attention_sparse, select_topk
from k31jax.ops import _indexer, _mla
import refs as R


B, T, H, DN, DR, RK, DV, S, K = 2, 3, 4, 16, 8, 16, 16, 21, 8
HI, DI = 4, 16
SCALE = (DN + DR) ** -0.5


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def mla_inputs(seed, t=T):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q_nope, q_pe, c_kv, k_pe = f(B, t, H, DN), f(B, t, H, DR), f(B, S, RK), f(B, S, DR)
    w_uk, w_uv = f(RK, H, DN) * 0.3, f(RK, H, DV) * 0.3
    idx = rng.integers(0, S, (B, t, K)).astype(np.int32)
    idx[0, 0, :2] = 5  # a duplicated slot counts twice, in every path
    valid = rng.random((B, t, K)) > 0.3
    valid[1, 0] = False  # a query with no candidate: uniform over its K slots (the XLA rule)
    return q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, valid


def f64_sparse(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, valid):
    """attention.md §1.3 over the gathered rows, float64, one (b, t, h) at a time."""
    f = lambda a: np.asarray(a, np.float64)
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = map(f, (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    b_, t_, h_ = q_nope.shape[:3]
    out = np.zeros((b_, t_, h_, w_uv.shape[-1]))
    for b in range(b_):
        for t in range(t_):
            rows_c, rows_p = c_kv[b, idx[b, t]], k_pe[b, idx[b, t]]
            ok = valid[b, t]
            for h in range(h_):
                q_lat = w_uk[:, h] @ q_nope[b, t, h]  # W_UK_hᵀ q_nope: [r]
                logit = (rows_c @ q_lat + rows_p @ q_pe[b, t, h]) * SCALE
                if ok.any():
                    p = np.where(ok, np.exp(logit - logit[ok].max()), 0.0)
                else:  # no candidate: every slot's logit is the same floor -> uniform
                    p = np.ones_like(logit)
                out[b, t, h] = w_uv[:, h].T @ ((p / p.sum()) @ rows_c)
    return out


_kernel = jax.jit(mla_attention_sparse, static_argnames=("scale", "impl", "n_split"))
_xla = jax.jit(_mla.mla_attention_sparse, static_argnames="scale")


def test_head_block():
    assert [head_block(h) for h in (4, 16, 64, 96, 128)] == [16, 16, 64, 32, 64]


@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
def test_prefill_kernel(cache):
    a = list(mla_inputs(1))
    a[2], a[3] = (jnp.asarray(x, cache) for x in a[2:4])
    o = _kernel(*a, scale=SCALE, impl="interpret")
    o_x = _xla(*a, scale=SCALE)
    o_64 = f64_sparse(*a)
    tol = 1e-5 if cache == "float32" else 2e-2
    assert rel(o, o_x) < tol and rel(o, o_64) < tol


@pytest.mark.parametrize("n_split", [None, 3])
def test_decode_kernel_split_k(n_split):
    """T = 1; 3 splits of 32 slots over K = 8: two splits hold only padding."""
    a = mla_inputs(2, t=1)
    o = _kernel(*a, scale=SCALE, impl="interpret", n_split=n_split)
    assert rel(o, _xla(*a, scale=SCALE)) < 1e-5 and rel(o, f64_sparse(*a)) < 1e-5


def test_decode_bf16_cache_via_op_seam():
    a = list(mla_inputs(3, t=1))
    a[2], a[3] = (jnp.asarray(x, jnp.bfloat16) for x in a[2:4])
    o = jax.jit(lambda *x: _mla.mla_attention_sparse(*x, SCALE, impl="interpret"))(*a)
    assert rel(o, _xla(*a, scale=SCALE)) < 2e-2 and rel(o, f64_sparse(*a)) < 2e-2


def indexer_inputs(seed, t=1):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t, HI, DI)).astype(np.float32)
    w = rng.standard_normal((B, t, HI)).astype(np.float32)
    k = rng.standard_normal((B, S, DI)).astype(np.float32)
    key_valid = rng.random((B, S)) > 0.2
    return q, w, k, key_valid


def f64_scores(q, w, k, q_pos, key_valid):
    """I_{t,s} = dI^-½ Σ_j w_{t,j} ReLU(q_{t,j}·k_s), −inf where s > q_pos[t] or invalid."""
    f = lambda a: np.asarray(a, np.float64)
    sc = np.einsum("btj,btjs->bts", f(w), np.maximum(np.einsum("btjd,bsd->btjs", f(q), f(k)), 0))
    ok = (np.arange(k.shape[1])[None, None] <= np.asarray(q_pos)[None, :, None]) & key_valid[:, None]
    return np.where(ok, sc * q.shape[-1] ** -0.5, -np.inf)


@pytest.mark.parametrize("top_k,keys", [(8, "float32"), (40, "bfloat16")])
def test_indexer_decode_topk(top_k, keys):
    """Decode at position 15 of a 21-slot cache: 6 future slots and ~20% invalid keys; a bf16
    index-key cache is upcast (index math is fp32, attention.md §2)."""
    q, w, k, key_valid = indexer_inputs(4)
    k = jnp.asarray(k, keys)
    q_pos = jnp.array([15], jnp.int32)
    sc = indexer_scores(q, w, k, q_pos, key_valid, impl="interpret")
    sc_64 = f64_scores(q, w, k, q_pos, key_valid)
    np.testing.assert_array_equal(np.isinf(sc), np.isinf(sc_64))
    fin = np.isfinite(sc_64)
    np.testing.assert_allclose(np.asarray(sc)[fin], sc_64[fin], rtol=1e-5, atol=1e-5)
    sel = jax.jit(lambda *a: _indexer.select_topk(*a, top_k, impl="interpret"))
    idx, ok = sel(q, w, k, q_pos, key_valid)
    idx_x, ok_x = _indexer.select_topk(q, w, k, q_pos, key_valid, top_k)
    assert idx.shape == idx_x.shape == (B, 1, min(top_k, S))
    for b in range(B):
        n_cand = int(fin[b, 0].sum())
        kk = min(top_k, S)
        assert int(ok[b, 0].sum()) == min(kk, n_cand)
        srt = np.sort(sc_64[b, 0][fin[b, 0]])[::-1]
        if kk < n_cand and srt[kk - 1] - srt[kk] < 1e-5:
            continue  # fragile row: the k-th and (k+1)-th scores tie
        rows = np.full((S, S), -np.inf)  # the reference ranks query t over keys s <= t
        rows[15] = sc_64[b, 0]
        want = set(R.indexer_select(rows, kk)[15].nonzero()[0])
        got = set(np.asarray(idx[b, 0])[np.asarray(ok[b, 0])])
        assert got == want & set(np.nonzero(fin[b, 0])[0])
        assert got == set(np.asarray(idx_x[b, 0])[np.asarray(ok_x[b, 0])])


def test_topk_beyond_context_is_dense_absorbed():
    """k = 40 > S: the selection is every candidate and sparse == dense absorbed attention."""
    q, w, k, key_valid = indexer_inputs(5, t=T)
    key_valid[:, :T + 1] = True  # every query keeps at least its own position
    q_pos = jnp.arange(S - T, S, dtype=jnp.int32)
    idx, ok = select_topk(q, w, k, q_pos, key_valid, 40, impl="interpret")
    a = mla_inputs(6)
    o = _kernel(*a[:6], idx, ok, scale=SCALE, impl="interpret")
    mask = (np.arange(S)[None, None] <= np.asarray(q_pos)[None, :, None]) & key_valid[:, None]
    o_dense = _mla.mla_attention_absorbed(*a[:6], jnp.asarray(mask), SCALE)
    assert rel(o, o_dense) < 1e-5
