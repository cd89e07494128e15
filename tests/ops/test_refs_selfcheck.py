"""Sanity checks of the float64 NumPy references in tests/refs (no JAX needed)."""

import numpy as np
import pytest

import refs as R

RNG = np.random.default_rng(0)


def rn(*shape, scale=1.0):
    return RNG.standard_normal(shape) * scale


# ---------------------------------------------------------------- norms, activations


def test_rms_norm_constant_vector():
    x = np.full((3, 8), 2.5)
    w = rn(8)
    np.testing.assert_allclose(R.rms_norm(x, w, 1e-5), np.broadcast_to(2.5 / np.sqrt(6.25 + 1e-5) * w, x.shape), rtol=1e-14)


def test_layer_norm_moments():
    y = R.layer_norm(rn(5, 16) * 3 + 1, np.ones(16), np.zeros(16), 0.0)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-13)
    np.testing.assert_allclose((y ** 2).mean(-1), 1, rtol=1e-12)


def test_l2_normalize_eps_inside_sqrt():
    x = np.full(4, 1e-4)  # sum x^2 = 4e-8, well below eps
    np.testing.assert_allclose(R.l2_normalize(x), x / np.sqrt(4e-8 + 1e-6), rtol=1e-14)
    u = R.l2_normalize(rn(7, 32))
    np.testing.assert_allclose(np.linalg.norm(u, axis=-1), 1, atol=1e-5)


def test_situ_limits():
    g, u = rn(100, scale=3), rn(100, scale=3)
    np.testing.assert_allclose(R.situ_glu(g, u, 1e6, 1e6), R.swiglu(g, u), rtol=1e-9)
    np.testing.assert_allclose(R.situ_glu(g, u, 4.0, None), 4 * np.tanh(g / 4) * R.sigmoid(g) * u)
    big = R.situ_glu(np.array([1e4, -1e4]), np.array([1e4, 1e4]), 4.0, 25.0)
    assert np.all(np.abs(big) <= 100.0)


# ---------------------------------------------------------------- AttnRes


def test_attn_res_zero_query_is_uniform_mean():
    cands = [rn(3, 5, 16) for _ in range(4)]
    out = R.attn_res_mix(cands, rn(16), np.zeros((1, 16)))
    np.testing.assert_allclose(out, np.mean(cands, axis=0), rtol=1e-13)


def test_attn_res_mixes_raw_candidates_with_scale_free_scores():
    a, b = rn(4, 16), rn(4, 16)
    wn, wp = rn(16), rn(1, 16)
    out1 = R.attn_res_mix([a, b], wn, wp, eps=0.0)
    out2 = R.attn_res_mix([10 * a, b], wn, wp, eps=0.0)
    # 10a and a get the same score, so alpha is unchanged and out2 - out1 = 9 alpha_a a per token
    alpha_a = (out2 - out1) / (9 * a)
    np.testing.assert_allclose(alpha_a, np.broadcast_to(alpha_a[:, :1], alpha_a.shape), rtol=1e-9)
    assert np.all((alpha_a > 0) & (alpha_a < 1))
    np.testing.assert_allclose(out1, alpha_a * a + (1 - alpha_a) * b, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(R.attn_res_mix([a], wn, wp), a)


# ---------------------------------------------------------------- short conv


def test_short_conv_impulse_and_history():
    C, K, T = 3, 4, 9
    w = rn(C, 1, K)
    x = np.zeros((T, C))
    x[2] = 1.0
    y = R.short_conv(x, w)
    for j in range(K):  # impulse at t=2 reaches y_{2+K-1-j} through tap j
        np.testing.assert_allclose(y[2 + K - 1 - j], w[:, 0, j])
    x = rn(T, C)
    full = R.short_conv(x, w)
    second = R.short_conv(x[5:], w[:, 0, :], history=x[5 - (K - 1):5])
    np.testing.assert_allclose(second, full[5:], rtol=1e-13)


# ---------------------------------------------------------------- KDA


def test_kda_gate_forms():
    T, H, dk = 5, 3, 4
    z = rn(T, H, dk, scale=5)
    A_log = np.concatenate([rn(H), 99 * np.ones(dk - H)])  # padding must be ignored
    dt = rn(H * dk)
    g = R.kda_gate(z, A_log, dt, H, -5.0)
    assert np.all((g < 0) & (g > -5))
    expect = -5 / (1 + np.exp(-np.exp(A_log[:H])[None, :, None] * (z + dt.reshape(H, dk))))
    np.testing.assert_allclose(g, expect, rtol=1e-12)
    gs = R.kda_gate(z, A_log.reshape(1, 1, -1, 1), dt, H, None)
    u = z + dt.reshape(H, dk)
    sp = np.where(u > 20, u, np.log1p(np.exp(u)))
    np.testing.assert_allclose(gs, -np.exp(A_log[:H])[None, :, None] * sp, rtol=1e-12)
    big = R.kda_gate(np.full((1, 1, 1), 30.0), np.zeros(1), np.zeros(1), 1, None)
    assert big[0, 0, 0] == -30.0  # threshold branch


def _kda_inputs(T, H, dk, dv):
    q = R.l2_normalize(rn(T, H, dk)) * dk ** -0.5
    k = R.l2_normalize(rn(T, H, dk))
    return q, k, rn(T, H, dv), -np.abs(rn(T, H, dk)), R.sigmoid(rn(T, H))


def test_kda_beta_zero_only_decays():
    T, H, dk, dv = 6, 2, 4, 3
    q, k, v, g, _ = _kda_inputs(T, H, dk, dv)
    S0 = rn(H, dk, dv)
    o, S = R.kda_recurrent(q, k, v, g, np.zeros((T, H)), S0)
    np.testing.assert_allclose(S, np.exp(g.sum(0))[:, :, None] * S0, rtol=1e-12)
    St = np.exp(np.cumsum(g, 0))[..., None] * S0[None]
    np.testing.assert_allclose(o, np.einsum("thkv,thk->thv", St, q), rtol=1e-12)


def test_kda_closed_form_and_split():
    T, H, dk, dv = 7, 2, 4, 5
    q, k, v, g, beta = _kda_inputs(T, H, dk, dv)
    S0 = rn(H, dk, dv)
    o, S = R.kda_recurrent(q, k, v, g, beta, S0)
    Sc = S0.copy()
    for t in range(T):
        for h in range(H):
            A = np.eye(dk) - beta[t, h] * np.outer(k[t, h], k[t, h])
            Sc[h] = A @ np.diag(np.exp(g[t, h])) @ Sc[h] + beta[t, h] * np.outer(k[t, h], v[t, h])
    np.testing.assert_allclose(S, Sc, rtol=1e-12, atol=1e-13)
    o1, S1 = R.kda_recurrent(q[:3], k[:3], v[:3], g[:3], beta[:3], S0)
    o2, S2 = R.kda_recurrent(q[3:], k[3:], v[3:], g[3:], beta[3:], S1)
    np.testing.assert_allclose(np.concatenate([o1, o2]), o, rtol=1e-13)
    np.testing.assert_allclose(S2, S, rtol=1e-13)


def test_kda_exact_recall_with_unit_beta():
    dk, dv = 4, 3
    k = np.zeros((1, 1, dk)); k[0, 0, 1] = 1.0
    v = rn(1, 1, dv)
    o, S = R.kda_recurrent(k, k, v, np.zeros((1, 1, dk)), np.ones((1, 1)), rn(1, dk, dv))
    np.testing.assert_allclose(S[0].T @ k[0, 0], v[0, 0], rtol=1e-13)
    np.testing.assert_allclose(o[0, 0], v[0, 0], rtol=1e-13)


def _kda_params(D, H, dk, K, full_rank):
    C = H * dk
    p = {n: rn(C, D, scale=D ** -0.5) for n in ("q_proj", "k_proj", "v_proj")}
    p.update({f"{b}_conv1d": rn(C, 1, K, scale=0.5) for b in "qkv"})
    p.update(f_a_proj=rn(dk, D, scale=D ** -0.5), f_b_proj=rn(C, dk, scale=dk ** -0.5),
             b_proj=rn(H, D, scale=D ** -0.5), A_log=np.concatenate([rn(H, scale=0.3), np.zeros(dk - H)]),
             dt_bias=rn(C), o_norm=1 + rn(dk, scale=0.1), o_proj=rn(D, C, scale=C ** -0.5))
    if full_rank:
        p["g_proj"] = rn(C, D, scale=D ** -0.5)
    else:
        p.update(g_a_proj=rn(dk, D, scale=D ** -0.5), g_b_proj=rn(C, dk, scale=dk ** -0.5))
    return p


@pytest.mark.parametrize("lb,full_rank", [(-5.0, True), (None, False)])
def test_kda_layer_prefill_then_decode_matches_full(lb, full_rank):
    D, H, dk, K, T = 24, 2, 8, 4, 11
    p = _kda_params(D, H, dk, K, full_rank)
    cfg = dict(num_heads=H, head_dim=dk, lower_bound=lb, rms_norm_eps=1e-5)
    x = rn(T, D)
    y, S, hist = R.kda_layer(x, p, cfg)
    assert y.shape == (T, D) and S.shape == (H, dk, dk) and hist["q"].shape == (K - 1, H * dk)
    np.testing.assert_allclose(hist["v"], x[-(K - 1):] @ p["v_proj"].T, rtol=1e-13)
    y1, S1, h1 = R.kda_layer(x[:6], p, cfg)
    ys = [y1]
    for t in range(6, T):  # decode one token at a time
        yt, S1, h1 = R.kda_layer(x[t:t + 1], p, cfg, conv_history=h1, initial_state=S1)
        ys.append(yt)
    np.testing.assert_allclose(np.concatenate(ys), y, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(S1, S, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- MLA and indexer


def _mla(D=32, H=3, nope=6, pe=4, dv=5, r_kv=8, r_q=12, gate=True):
    cfg = dict(num_heads=H, qk_nope_head_dim=nope, qk_rope_head_dim=pe, v_head_dim=dv,
               kv_lora_rank=r_kv, q_lora_rank=r_q)
    p = dict(kv_a_proj_with_mqa=rn(r_kv + pe, D, scale=D ** -0.5), kv_a_layernorm=1 + rn(r_kv, scale=0.1),
             kv_b_proj=rn(H * (nope + dv), r_kv, scale=r_kv ** -0.5), o_proj=rn(D, H * dv, scale=0.3))
    if r_q is None:
        p["q_proj"] = rn(H * (nope + pe), D, scale=D ** -0.5)
    else:
        p.update(q_a_proj=rn(r_q, D, scale=D ** -0.5), q_a_layernorm=1 + rn(r_q, scale=0.1),
                 q_b_proj=rn(H * (nope + pe), r_q, scale=r_q ** -0.5))
    if gate:
        p["g_proj"] = rn(H * dv, D, scale=D ** -0.5)
    return p, cfg


@pytest.mark.parametrize("r_q,gate", [(12, True), (None, False)])
def test_mla_matches_absorbed_form_and_is_causal(r_q, gate):
    T, D = 9, 32
    p, cfg = _mla(D=D, r_q=r_q, gate=gate)
    H, nope, pe, dv = 3, 6, 4, 5
    x = rn(T, D)
    y = R.mla_layer(x, p, cfg)
    lat = R.mla_latents(x, p, cfg)
    q_src = x @ p["q_proj"].T if r_q is None else lat["c_q"] @ p["q_b_proj"].T
    q = q_src.reshape(T, H, nope + pe)
    Wkvb = p["kv_b_proj"].reshape(H, nope + dv, -1)
    kappa = np.concatenate([lat["c_kv"], lat["k_pe"]], axis=1)  # [T, r_kv + pe]
    o = np.zeros((T, H, dv))
    for t in range(T):
        for h in range(H):
            qt = np.concatenate([Wkvb[h, :nope].T @ q[t, h, :nope], q[t, h, nope:]])
            pr = R.softmax(kappa[:t + 1] @ qt / np.sqrt(nope + pe))
            o[t, h] = Wkvb[h, nope:] @ (pr @ lat["c_kv"][:t + 1])
    o = o.reshape(T, H * dv)
    if gate:
        o = o * R.sigmoid(x @ p["g_proj"].T)
    np.testing.assert_allclose(y, o @ p["o_proj"].T, rtol=1e-11, atol=1e-13)
    x2 = x.copy()
    x2[5:] = rn(T - 5, D)
    np.testing.assert_allclose(R.mla_layer(x2, p, cfg)[:5], y[:5], rtol=1e-13)


def _indexer(D=32, r_q=12, HI=3, dI=4):
    return dict(wq_b=rn(HI * dI, r_q), wk=rn(dI, D), k_norm_weight=1 + rn(dI, scale=0.1),
                k_norm_bias=rn(dI, scale=0.1), weights_proj=rn(HI, D))


def test_indexer_scores_formula_and_mask():
    T, D, HI, dI = 6, 32, 3, 4
    p, cfg = _mla(D=D)
    ip = _indexer(D=D, HI=HI, dI=dI)
    x = rn(T, D)
    c_q = R.mla_latents(x, p, cfg)["c_q"]
    I = R.indexer_scores(x, c_q, ip, HI, dI)
    assert np.all(np.isneginf(I[np.triu_indices(T, 1)])) and np.all(np.isfinite(I[np.tril_indices(T)]))
    qI = (c_q @ ip["wq_b"].T).reshape(T, HI, dI)
    kr = x @ ip["wk"].T
    kI = (kr - kr.mean(-1, keepdims=True)) / np.sqrt(kr.var(-1, keepdims=True) + 1e-6)
    kI = kI * ip["k_norm_weight"] + ip["k_norm_bias"]
    w = x @ ip["weights_proj"].T
    expect = np.einsum("tj,tjs->ts", w, np.maximum(np.einsum("tjd,sd->tjs", qI, kI), 0)) / np.sqrt(HI * dI)
    np.testing.assert_allclose(I[np.tril_indices(T)], expect[np.tril_indices(T)], rtol=1e-12)


def test_indexer_select_counts_and_dense_equivalence():
    T, D, k = 12, 32, 4
    p, cfg = _mla(D=D)
    x = rn(T, D)
    I = R.indexer_scores(x, R.mla_latents(x, p, cfg)["c_q"], _indexer(D=D), 3, 4)
    causal = np.tril(np.ones((T, T), bool))
    assert np.array_equal(R.indexer_select(I, T), causal)
    assert np.array_equal(R.indexer_select(I, 10 * T), causal)
    sel = R.indexer_select(I, k)
    assert not np.any(sel & ~causal)
    np.testing.assert_array_equal(sel.sum(1), np.minimum(k, np.arange(T) + 1))
    for t in range(T):  # every selected score >= every unselected causal score
        s_in, s_out = I[t][sel[t]], I[t][causal[t] & ~sel[t]]
        assert s_out.size == 0 or s_in.min() >= s_out.max()
    assert np.array_equal(R.mla_layer(x, p, cfg, allowed=R.indexer_select(I, T)), R.mla_layer(x, p, cfg))
    ys = R.mla_layer(x, p, cfg, allowed=sel)
    assert not np.allclose(ys, R.mla_layer(x, p, cfg))


# ---------------------------------------------------------------- router and MoE


@pytest.mark.parametrize("scaling", [1.0, 2.446])
def test_route_renorm_sum_and_bias_only_for_selection(scaling):
    N, D, E, K = 20, 16, 12, 3
    x, W = rn(N, D), rn(E, D)
    bias = rn(E, scale=0.5)
    idx, w = R.route(x, W, bias, K, True, scaling)
    assert np.all(np.diff(idx, axis=1) > 0)
    np.testing.assert_allclose(w.sum(1), scaling, rtol=1e-12)
    s = R.sigmoid(x @ W.T)
    for n in range(N):
        chosen = np.sort(np.argsort(-(s[n] + bias))[:K])
        assert np.array_equal(idx[n], chosen)
        np.testing.assert_allclose(w[n], scaling * s[n, chosen] / s[n, chosen].sum(), rtol=1e-12)
    idx0, _ = R.route(x, W, None, K, True, scaling)
    assert not np.array_equal(idx0, idx)  # the bias does change the choice here
    _, wr = R.route(x, W, bias, K, False, scaling)
    np.testing.assert_allclose(wr, scaling * np.take_along_axis(s, idx, 1), rtol=1e-12)


def test_route_group_limiting():
    E, G = 8, 4
    s_target = np.array([0.9, 0.1, 0.8, 0.7, 0.2, 0.95, 0.3, 0.3])
    W = np.diag(np.log(s_target / (1 - s_target)))  # sigmoid(ones @ W^T) = s_target
    x = np.ones((1, E))
    idx, _ = R.route(x, W, None, 2, True, 1.0, n_group=G, topk_group=2)
    # group top-2 sums [1.0, 1.5, 1.15, 0.6] -> groups 1, 2 -> experts {2, 3, 4, 5} -> {5, 2}
    assert np.array_equal(idx[0], [2, 5])
    idx1, _ = R.route(x, W, None, 2, True, 1.0, n_group=1, topk_group=1)
    assert np.array_equal(idx1[0], [0, 5])


def _moe(D=16, L=8, I=6, E=5, latent=True):
    p = dict(gate=rn(E, D), e_score_correction_bias=rn(E, scale=0.1),
             experts=[dict(w1=rn(I, L if latent else D), w2=rn(L if latent else D, I),
                           w3=rn(I, L if latent else D)) for _ in range(E)],
             shared_experts=dict(gate_proj=rn(10, D), up_proj=rn(10, D), down_proj=rn(D, 10)))
    if latent:
        p.update(routed_expert_down_proj=rn(L, D), routed_expert_norm=1 + rn(L, scale=0.1),
                 routed_expert_up_proj=rn(D, L))
    return p


def test_latent_moe_matches_manual_and_is_scale_invariant():
    N, D = 4, 16
    p = _moe(D=D)
    cfg = dict(top_k=2, renormalize=True, routed_scaling_factor=1.0, rms_norm_eps=1e-5, n_group=1,
               topk_group=1, act="situ", beta1=4.0, beta2=25.0)
    x = rn(N, D)
    y = R.latent_moe(x, p, cfg)
    idx, w = R.route(x, p["gate"], p["e_score_correction_bias"], 2, True, 1.0)
    for n in range(N):
        u_in = p["routed_expert_down_proj"] @ x[n]
        u = sum(wk * (p["experts"][e]["w2"] @ R.situ_glu(p["experts"][e]["w1"] @ u_in, p["experts"][e]["w3"] @ u_in, 4.0, 25.0))
                for e, wk in zip(idx[n], w[n]))
        ref = p["routed_expert_up_proj"] @ R.rms_norm(u, p["routed_expert_norm"], 1e-5)
        ref = ref + R.dense_mlp(x[n:n + 1], p["shared_experts"], "situ", 4.0, 25.0)[0]
        np.testing.assert_allclose(y[n], ref, rtol=1e-12)
    y2 = R.latent_moe(x, p, dict(cfg, routed_scaling_factor=2.5, renormalize=False))
    np.testing.assert_allclose(y2, y, rtol=1e-3)  # one RMSNorm after the sum: only eps breaks invariance


def test_plain_moe_silu_without_latent_or_shared():
    N, D = 3, 16
    p = _moe(D=D, latent=False)
    p["shared_experts"] = None
    cfg = dict(top_k=2, renormalize=True, routed_scaling_factor=2.446, rms_norm_eps=1e-5, act="silu")
    x = rn(N, D)
    y = R.latent_moe(x, p, cfg)
    idx, w = R.route(x, p["gate"], p["e_score_correction_bias"], 2, True, 2.446)
    for n in range(N):
        ref = sum(wk * (p["experts"][e]["w2"] @ R.swiglu(p["experts"][e]["w1"] @ x[n], p["experts"][e]["w3"] @ x[n]))
                  for e, wk in zip(idx[n], w[n]))
        np.testing.assert_allclose(y[n], ref, rtol=1e-12)
