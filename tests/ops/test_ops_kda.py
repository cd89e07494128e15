"""Kimi Delta Attention ops and the KDAMixer module vs the float64 NumPy references (kda.md).

Covers: chunked == recurrent == `refs.kda_recurrent` (non-zero initial state, T not a
multiple of the chunk, C = 16 / 64, fp32 and bf16 inputs, channels at g = -30 with the
softplus gate), both gate forms, the L2-norm eps placement, the padding identity, the short
conv with history, and the whole mixer (full-rank / lower-bound and low-rank / softplus) vs
`refs.kda_layer`, including prefill 30 + decode 7 == the full 37-token forward.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.model import abstract, rel_err
from k31jax.config import ModelConfig
from k31jax.nn import KDALayerCache, KDAMixer
from k31jax.ops import _kda, _norms
import refs as R


def ref_batched(fn, *arrays, **kw):
    """Apply a single-sequence reference per batch row; stacks every output."""
    outs = [fn(*(a[b] for a in arrays), **kw) for b in range(arrays[0].shape[0])]
    if isinstance(outs[0], tuple):
        return tuple(np.stack(o) for o in zip(*outs))
    return np.stack(outs)


def kda_inputs(rng, b, t, h, dk, dv, *, state_scale=0.5):
    """Normalised q (scaled) / k, v, a lower-bounded log-decay g ∈ (-5, 0), β ∈ (0, 1) and a
    random initial state."""
    q = R.l2_normalize(rng.standard_normal((b, t, h, dk))) * dk ** -0.5
    k = R.l2_normalize(rng.standard_normal((b, t, h, dk)))
    v = rng.standard_normal((b, t, h, dv))
    g = -5.0 * R.sigmoid(rng.standard_normal((b, t, h, dk)) * 2.0)
    beta = R.sigmoid(rng.standard_normal((b, t, h)))
    s0 = rng.standard_normal((b, h, dk, dv)) * state_scale
    return [a.astype(np.float32) for a in (q, k, v, g, beta, s0)]


_chunked = jax.jit(_kda.kda_chunked, static_argnames="chunk_size")
_recurrent = jax.jit(_kda.kda_recurrent)


# ------------------------------------------------------------------ chunked vs recurrent vs f64


@pytest.mark.parametrize("t", [45, 130])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_recurrent_reference_fp32(t, chunk):
    rng = np.random.default_rng(100 + t + chunk)
    q, k, v, g, beta, s0 = kda_inputs(rng, 2, t, 2, 16, 12)
    g[:, :, 1, :3] = -30.0  # a few channels that forget everything each step
    o_ref, s_ref = ref_batched(R.kda_recurrent, q, k, v, g, beta, s0)
    o_c, s_c = _chunked(q, k, v, g, beta, s0, chunk_size=chunk)
    o_r, s_r = _recurrent(q, k, v, g, beta, s0)
    assert o_c.shape == o_ref.shape and s_c.shape == s_ref.shape
    assert s_c.dtype == jnp.float32 and s_r.dtype == jnp.float32
    for name, got, want in [("chunked o", o_c, o_ref), ("chunked S", s_c, s_ref),
                            ("recurrent o", o_r, o_ref), ("recurrent S", s_r, s_ref)]:
        assert rel_err(got, want) < 1e-5, (name, rel_err(got, want))
    assert rel_err(o_c, o_r) < 1e-5 and rel_err(s_c, s_r) < 1e-5


def test_initial_state_matters():
    """The non-zero initial state is actually consumed (guards the test above)."""
    rng = np.random.default_rng(7)
    q, k, v, g, beta, s0 = kda_inputs(rng, 2, 45, 2, 16, 12)
    # T < C: one chunk from a fresh (None) state, the case of the XLA:CPU zero-state miscompile
    o_with, _ = _chunked(q, k, v, g, beta, s0, chunk_size=64)
    o_without, _ = _chunked(q, k, v, g, beta, None, chunk_size=64)
    o_ref0, _ = ref_batched(R.kda_recurrent, q, k, v, g, beta)
    assert rel_err(o_without, o_ref0) < 1e-5
    assert rel_err(o_with, o_without) > 1e-2


@pytest.mark.parametrize("t,chunk", [(45, 16), (130, 64)])
def test_chunked_recurrent_bf16_inputs(t, chunk):
    rng = np.random.default_rng(11)
    arrs = kda_inputs(rng, 2, t, 2, 16, 12)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in arrs]
    rounded = [np.asarray(a, np.float64) for a in bf]
    o_c, s_c = _chunked(*bf, chunk_size=chunk)
    o_r, s_r = _recurrent(*bf)
    assert s_c.dtype == jnp.float32 and s_r.dtype == jnp.float32  # fp32 state (kda.md §6)
    # vs the exact float64 answer for the original fp32 inputs: bf16 input rounding only
    o_ref, s_ref = ref_batched(R.kda_recurrent, *arrs)
    for got in (o_c, o_r):
        assert rel_err(got, o_ref) < 2e-2
    for got in (s_c, s_r):
        assert rel_err(got, s_ref) < 2e-2
    # the math itself runs in fp32: vs float64 on the bf16-rounded inputs it is fp32-tight
    o_rr, s_rr = ref_batched(R.kda_recurrent, *rounded)
    assert rel_err(o_c, o_rr) < 1e-5 and rel_err(s_c, s_rr) < 1e-5
    assert rel_err(o_r, o_rr) < 1e-5 and rel_err(s_r, s_rr) < 1e-5


def test_softplus_gate_g_minus_30_no_overflow():
    """Softplus gate, large A_log: channels at g = -30 exactly (Γ = -1920 over a 64-chunk, so a
    factored e^{-Γ} would overflow fp32) and others below -100."""
    rng = np.random.default_rng(3)
    b, t, h, dk, dv = 2, 130, 2, 16, 12
    q, k, v, _, beta, s0 = kda_inputs(rng, b, t, h, dk, dv)
    u30 = np.log(np.expm1(1.0))  # softplus(u30) == 1
    a_log = np.array([np.log(30.0), np.log(3.0)], np.float32)
    dt_bias = np.full((h, dk), u30, np.float32)
    dt_bias[1] = rng.standard_normal(dk) * 2.0
    z = (rng.standard_normal((b, t, h, dk)) * 2.0).astype(np.float32)
    z[:, :, 0, :8] = 0.0  # head 0, channels 0..7: g == -30 exactly (exp(log 30) · softplus(u30))
    g = np.asarray(_kda.kda_gate(jnp.asarray(z), jnp.asarray(a_log), jnp.asarray(dt_bias), None))
    np.testing.assert_allclose(g[:, :, 0, :8], -30.0, rtol=1e-5)
    assert g[:, :, 0, 8:].min() < -100.0  # and some channels decay even harder
    o_ref, s_ref = ref_batched(R.kda_recurrent, q, k, v, g, beta, s0)
    for chunk in (16, 64):
        o_c, s_c = _chunked(q, k, v, g, beta, s0, chunk_size=chunk)
        assert np.isfinite(np.asarray(o_c)).all() and np.isfinite(np.asarray(s_c)).all()
        assert rel_err(o_c, o_ref) < 1e-5, rel_err(o_c, o_ref)
        assert rel_err(s_c, s_ref) < 1e-5, rel_err(s_c, s_ref)
    o_r, s_r = _recurrent(q, k, v, g, beta, s0)
    assert rel_err(o_r, o_ref) < 1e-5 and rel_err(s_r, s_ref) < 1e-5


# ------------------------------------------------------------------ gates, L2 norm


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_gate_vs_ref(lower_bound):
    rng = np.random.default_rng(21)
    b, t, h, dk = 2, 9, 3, 8
    z = rng.standard_normal((b, t, h, dk)).astype(np.float32) * 4.0
    z[0, 0, 0, :4] = [30.0, 21.0, -40.0, 19.5]  # both sides of the softplus threshold
    a_log = rng.uniform(-1.0, 2.5, 16).astype(np.float32)  # stored padded, per head [:h]
    dt_bias = rng.standard_normal((h * dk,)).astype(np.float32)
    got = np.asarray(_kda.kda_gate(jnp.asarray(z), jnp.asarray(a_log[:h]),
                                   jnp.asarray(dt_bias.reshape(h, dk)), lower_bound))
    want = ref_batched(lambda zz: R.kda_gate(zz, a_log, dt_bias, h, lower_bound), z)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    assert (got <= 0).all()
    if lower_bound is not None:
        assert (got >= lower_bound).all()
        # dt_bias goes in before the exp(A_log) scaling; the other order is a different gate
        a = np.exp(a_log[:h].astype(np.float64))[:, None]
        wrong = lower_bound * R.sigmoid(a * z + dt_bias.reshape(h, dk))
        assert np.max(np.abs(got - wrong)) > 1e-2


def test_l2_normalize_eps_inside_sqrt():
    x = np.zeros((3, 16), np.float32)
    x[0] = 1e-4                      # Σx² = 1.6e-7 < eps: eps dominates
    x[1, :3] = [3e-4, -2e-4, 5e-4]   # Σx² = 3.8e-7
    x[2] = np.random.default_rng(0).standard_normal(16)  # ordinary vector: ≈ unit norm
    got = np.asarray(_norms.l2_normalize(jnp.asarray(x)))
    want = R.l2_normalize(x, 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(got[2]), 1.0, rtol=1e-6)
    # F.normalize clamps the norm (max(||x||, eps)) and would return unit vectors here
    norm = np.linalg.norm(x.astype(np.float64), axis=-1, keepdims=True)
    clamp = x / np.maximum(norm, 1e-12)
    clamp6 = x / np.maximum(norm, 1e-6)
    assert np.linalg.norm(got[0]) < 0.4  # 4e-4 / sqrt(1.16e-6) ≈ 0.37
    assert np.max(np.abs(got[:2] - clamp[:2])) > 0.1
    assert np.max(np.abs(got[:2] - clamp6[:2])) > 0.1


# ------------------------------------------------------------------ padding identity


def test_padding_steps_leave_state_bit_identical():
    rng = np.random.default_rng(5)
    b, t, h, dk, dv = 2, 45, 2, 16, 12
    q, k, v, g, beta, s0 = kda_inputs(rng, b, t, h, dk, dv, state_scale=3.0)
    valid = np.zeros((b, t), bool)  # every step is padding, with random (non-zero) q, k, v
    gm, bm = _kda.kda_mask_padding(jnp.asarray(valid), jnp.asarray(g), jnp.asarray(beta))
    assert (np.asarray(gm) == 0).all() and (np.asarray(bm) == 0).all()
    _, s_r = _recurrent(q, k, v, gm, bm, s0)
    np.testing.assert_array_equal(np.asarray(s_r), s0)
    for chunk in (16, 64):
        _, s_c = _chunked(q, k, v, gm, bm, s0, chunk_size=chunk)
        np.testing.assert_array_equal(np.asarray(s_c), s0)
    # a mixed mask only blanks the invalid positions
    valid = rng.random((b, t)) < 0.6
    gm, bm = _kda.kda_mask_padding(jnp.asarray(valid), jnp.asarray(g), jnp.asarray(beta))
    np.testing.assert_array_equal(np.asarray(gm), np.where(valid[..., None, None], g, 0))
    np.testing.assert_array_equal(np.asarray(bm), np.where(valid[..., None], beta, 0))


def test_right_padding_matches_unpadded():
    """Real tokens then padded tail steps: same outputs at the real tokens, same final state."""
    rng = np.random.default_rng(6)
    b, n_real, n_pad, h, dk, dv = 2, 33, 12, 2, 16, 12
    q, k, v, g, beta, s0 = kda_inputs(rng, b, n_real + n_pad, h, dk, dv)
    valid = np.arange(n_real + n_pad)[None] < n_real
    gm, bm = _kda.kda_mask_padding(jnp.asarray(valid), jnp.asarray(g), jnp.asarray(beta))
    o_p, s_p = _chunked(q, k, v, gm, bm, s0, chunk_size=16)
    sl = slice(0, n_real)
    o_u, s_u = ref_batched(R.kda_recurrent, q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s0)
    assert rel_err(np.asarray(o_p)[:, sl], o_u) < 1e-5
    assert rel_err(s_p, s_u) < 1e-5


# ------------------------------------------------------------------ short conv


@pytest.mark.parametrize("t", [1, 2, 9])
def test_short_conv_with_history(t):
    rng = np.random.default_rng(30 + t)
    b, c, kk = 2, 11, 4
    x = rng.standard_normal((b, t, c)).astype(np.float32)
    w_hf = rng.uniform(-0.5, 0.5, (c, 1, kk)).astype(np.float32)  # HF [C, 1, K]
    w = w_hf[:, 0, :].T  # k31jax [K, C]
    hist = rng.standard_normal((b, kk - 1, c)).astype(np.float32)
    conv = jax.jit(_kda.short_conv)
    y, new_hist = conv(x, w, hist)
    want = ref_batched(lambda xx, hh: R.short_conv(xx, w_hf, hh), x, hist)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)
    full = np.concatenate([hist, x], axis=1)
    np.testing.assert_array_equal(np.asarray(new_hist), full[:, -(kk - 1):])
    # no history == zero history, and tap K-1 multiplies the current token
    y0, _ = conv(x, w, None)
    want0 = ref_batched(lambda xx: R.short_conv(xx, w_hf, None), x)
    np.testing.assert_allclose(np.asarray(y0), want0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y0)[:, 0], x[:, 0] * w[kk - 1], rtol=1e-6)


# ------------------------------------------------------------------ the KDAMixer module

LOW_RANK = dict(kda_full_rank_gate=False, kda_gate_lower_bound=None)


def kda_cfg(variant):
    cfg = ModelConfig.preset("tiny").replace(hidden_size=40, kda_num_heads=3, kda_head_dim=8,
                                             kda_chunk_size=16, dtype="float32")
    return cfg.replace(**LOW_RANK) if variant == "low_rank_softplus" else cfg


def randomise_kda(model, cfg, rng):
    """Fill every parameter with numpy randoms; return the HF-layout dict for refs.kda_layer."""
    h = cfg.kda_num_heads
    c = h * cfg.kda_head_dim
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    new = {}
    for name, val in pure.items():
        shape = val.shape
        if name.endswith("_conv"):
            arr = rng.uniform(-0.8, 0.8, shape)
        elif name == "a_log":
            arr = rng.uniform(-1.0, 1.5, shape)
            arr[h:] = 7.0  # padding entries must be ignored (only A_log[:H] is used)
        elif name == "dt_bias":
            arr = rng.standard_normal(shape) * 0.5
        elif name == "o_norm":
            arr = 1.0 + 0.3 * rng.standard_normal(shape)
        else:  # [in, out] linear
            arr = rng.standard_normal(shape) / np.sqrt(shape[0])
        new[name] = arr.astype(np.float32)
    assert set(new) >= {"q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj",
                        "q_conv", "k_conv", "v_conv", "a_log", "dt_bias", "o_norm"}
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, {kname: jnp.asarray(vv) for kname, vv in new.items()})
    nnx.update(model, state)
    hf = {}
    for name, arr in new.items():
        if name.endswith("_conv"):
            hf[name.replace("_conv", "_conv1d") + ".weight"] = arr.T[:, None, :]  # [K,C] -> [C,1,K]
        elif name == "a_log":
            hf["A_log"] = arr
        elif name == "dt_bias":
            hf["dt_bias"] = arr
        elif name == "o_norm":
            hf["o_norm.weight"] = arr
        else:
            hf[name + ".weight"] = arr.T
    assert hf["dt_bias"].shape == (c,) and hf["q_conv1d.weight"].shape == (c, 1, cfg.kda_conv_size)
    return hf


def ref_cfg(cfg):
    return dict(num_heads=cfg.kda_num_heads, head_dim=cfg.kda_head_dim,
                lower_bound=cfg.kda_gate_lower_bound, rms_norm_eps=cfg.rms_norm_eps)


@functools.lru_cache(maxsize=None)
def build_kda(variant):
    """(cfg, hf params, nnx state, fwd) with fwd(state, x, s, conv, valid) jitted.

    A fresh sequence is fed as an explicit zero state and zero conv window (what the module
    builds for None; the None paths are covered at op level), which keeps the number of
    compiled shapes small.
    """
    cfg = kda_cfg(variant)
    model = abstract(KDAMixer, cfg)
    hf = randomise_kda(model, cfg, np.random.default_rng(42 if variant == "full_rank_lb" else 43))
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(st, x, s, conv, valid=None):
        y, cache = nnx.merge(graphdef, st)(x, KDALayerCache(s, conv), valid)
        return y, cache.state, cache.conv

    return cfg, hf, state, fwd, graphdef


def zeros_cache(cfg, b):
    h, dk = cfg.kda_num_heads, cfg.kda_head_dim
    return (np.zeros((b, h, dk, dk), np.float32),
            np.zeros((b, 3, h * dk, cfg.kda_conv_size - 1), np.float32))


VARIANTS = ["full_rank_lb", "low_rank_softplus"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_kda_mixer_vs_reference(variant):
    cfg, hf, state, fwd, _ = build_kda(variant)
    if variant == "full_rank_lb":
        assert "g_proj.weight" in hf and "g_a_proj.weight" not in hf
    else:
        assert "g_a_proj.weight" in hf and "g_b_proj.weight" in hf and "g_proj.weight" not in hf
    rng = np.random.default_rng(1)
    b, t = 2, 37
    x = rng.standard_normal((b, t, cfg.hidden_size)).astype(np.float32)
    y, s, conv = fwd(state, x, *zeros_cache(cfg, b))
    for i in range(b):
        y_ref, s_ref, hist_ref = R.kda_layer(x[i], hf, ref_cfg(cfg))
        assert rel_err(y[i], y_ref) < 1e-5, rel_err(y[i], y_ref)
        assert rel_err(s[i], s_ref) < 1e-5, rel_err(s[i], s_ref)
        for j, br in enumerate("qkv"):  # conv cache [B, 3, C, K-1] holds pre-conv inputs
            np.testing.assert_allclose(np.asarray(conv[i, j]).T, hist_ref[br], rtol=1e-5, atol=1e-6)
    # continuing from a random state and conv window == the reference's continuation
    s0 = (rng.standard_normal(s.shape) * 0.5).astype(np.float32)
    conv0 = rng.standard_normal(conv.shape).astype(np.float32)
    y2, s2, _ = fwd(state, x[:, :7], s0, conv0)
    for i in range(b):
        hist = {br: conv0[i, j].T for j, br in enumerate("qkv")}
        y_ref, s_ref, _ = R.kda_layer(x[i, :7], hf, ref_cfg(cfg), conv_history=hist,
                                      initial_state=s0[i])
        assert rel_err(y2[i], y_ref) < 1e-5 and rel_err(s2[i], s_ref) < 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_kda_mixer_prefill_decode_matches_full(variant):
    cfg, _, state, fwd, _ = build_kda(variant)
    rng = np.random.default_rng(2)
    b, n_pre, n_dec = 2, 30, 7
    x = rng.standard_normal((b, n_pre + n_dec, cfg.hidden_size)).astype(np.float32)
    y_full, s_full, conv_full = fwd(state, x, *zeros_cache(cfg, b))
    y_pre, s, conv = fwd(state, x[:, :n_pre], *zeros_cache(cfg, b))
    s_pre, conv_pre = s, conv
    outs = [y_pre]
    for i in range(n_pre, n_pre + n_dec):  # T == 1: the recurrent decode step
        y_i, s, conv = fwd(state, x[:, i:i + 1], s, conv)
        outs.append(y_i)
    y_inc = np.concatenate([np.asarray(o) for o in outs], axis=1)
    assert rel_err(y_inc, y_full) < 1e-5, rel_err(y_inc, y_full)
    assert rel_err(s, s_full) < 1e-5
    np.testing.assert_allclose(np.asarray(conv), np.asarray(conv_full), rtol=1e-6, atol=1e-6)
    # prefill continuation with T > 1 (chunked path with state + conv window as left context)
    y_b, s_b, _ = fwd(state, x[:, n_pre:], s_pre, conv_pre)
    assert rel_err(y_b, y_full[:, n_pre:]) < 1e-5 and rel_err(s_b, s_full) < 1e-5


def test_kda_mixer_left_padding():
    """Left-padded rows (valid=False) behave exactly like the unpadded sequence."""
    cfg, _, state, fwd, _ = build_kda("full_rank_lb")
    rng = np.random.default_rng(4)
    n_pad, n = 7, 30
    x = rng.standard_normal((2, n, cfg.hidden_size)).astype(np.float32)
    junk = rng.standard_normal((2, n_pad, cfg.hidden_size)).astype(np.float32) * 10
    xp = np.concatenate([junk, x], axis=1)
    valid = np.repeat(np.arange(n_pad + n)[None] >= n_pad, 2, axis=0)
    y_p, s_p, c_p = fwd(state, xp, *zeros_cache(cfg, 2), valid)
    y_u, s_u, c_u = fwd(state, x, *zeros_cache(cfg, 2))
    assert rel_err(np.asarray(y_p)[:, n_pad:], y_u) < 1e-5
    assert rel_err(s_p, s_u) < 1e-5
    np.testing.assert_allclose(np.asarray(c_p), np.asarray(c_u), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sub", [16, 64])
def test_decayed_products_tiling_vs_float64(sub):
    """The tiled products (kda.md §6b) equal the explicit pairwise form in float64, with a
    softplus-scale gate whose Γ reaches -10^3 within the chunk (a whole-chunk factoring
    would overflow)."""
    rng = np.random.default_rng(7)
    b, h, c, d = 2, 3, 64, 8
    a, k = rng.standard_normal((b, h, c, d)), rng.standard_normal((b, h, c, d))
    gamma = np.cumsum(-np.abs(rng.standard_normal((b, h, c, d))) * 30.0, axis=2)
    want = np.einsum("bhid,bhjd,bhijd->bhij", a, k,
                     np.exp(np.where(np.tril(np.ones((c, c), bool))[..., None],
                                     gamma[:, :, :, None] - gamma[:, :, None], -np.inf)))
    (got,) = _kda.decayed_products((jnp.asarray(a, jnp.float32),), jnp.asarray(k, jnp.float32),
                                   jnp.asarray(gamma, jnp.float32), sub)
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)) and np.all(np.triu(got, 1) == 0)
    # Γ of magnitude ~10^3 in fp32 carries ~1e-4 absolute error into each exponent
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("c,sub", [(64, 16), (48, 16), (20, 20)])
def test_unit_lower_solve_vs_float64(c, sub):
    rng = np.random.default_rng(c)
    lower = np.tril(rng.standard_normal((2, 3, c, c)) * 0.3, -1)
    rhs = (rng.standard_normal((2, 3, c, 5)), rng.standard_normal((2, 3, c, 7)))
    got = _kda._unit_lower_solve(jnp.asarray(lower, jnp.float32), tuple(jnp.asarray(r, jnp.float32) for r in rhs), sub)
    full = np.linalg.solve(np.eye(c) + lower, np.concatenate(rhs, -1))
    want = (full[..., :5], full[..., 5:])
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.abs(np.asarray(g, np.float64) - w).max() <= 1e-4 * np.abs(w).max()


@pytest.mark.parametrize("variant", VARIANTS)
def test_kda_mixer_trail_is_every_positions_state(variant):
    """`trail=True` (a speculative verify step): the outputs are the reference's, and the state
    and conv window after token j are the float64 reference's after the first j + 1 tokens,
    continuing a random state and window."""
    cfg, hf, state, _, graphdef = build_kda(variant)
    rng = np.random.default_rng(3)
    b, t = 2, 5
    x = rng.standard_normal((b, t, cfg.hidden_size)).astype(np.float32)
    s0, conv0 = zeros_cache(cfg, b)
    s0 = (rng.standard_normal(s0.shape) * 0.5).astype(np.float32)
    conv0 = rng.standard_normal(conv0.shape).astype(np.float32)
    y, cache = nnx.merge(graphdef, state)(x, KDALayerCache(s0, conv0), trail=True)
    assert cache.state_trail.shape == (b, t) + s0.shape[1:] and cache.conv_trail.shape == (b, t) + conv0.shape[1:]
    np.testing.assert_array_equal(cache.state, cache.state_trail[:, -1])
    for i in range(b):
        hist = {br: conv0[i, j].T for j, br in enumerate("qkv")}
        y_ref, _, _ = R.kda_layer(x[i], hf, ref_cfg(cfg), conv_history=hist, initial_state=s0[i])
        assert rel_err(y[i], y_ref) < 1e-5
        for j in range(t):
            _, s_ref, hist_ref = R.kda_layer(x[i, :j + 1], hf, ref_cfg(cfg), conv_history=hist, initial_state=s0[i])
            assert rel_err(cache.state_trail[i, j], s_ref) < 1e-5
            for c, br in enumerate("qkv"):
                np.testing.assert_allclose(np.asarray(cache.conv_trail[i, j, c]).T, hist_ref[br], rtol=1e-5, atol=1e-6)
