"""MoE router, routed experts, LatentMoE / DenseMLP, AttnRes mix, norms and GLUs vs float64 NumPy.

Spec: attention.md §7 (router), architecture.md §3-§4 and §7-§8.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from helpers.model import abstract, rel_err
from k31jax.config import ModelConfig
from k31jax.nn import DenseMLP, LatentMoE
from k31jax.ops import Backends, _activations, _attn_res, _moe, _norms, _router
import refs as R


def by_expert(idx, w):
    """Sort each token's (expert, weight) pairs by expert id, like the reference."""
    idx, w = np.asarray(idx), np.asarray(w)
    order = np.argsort(idx, axis=-1, kind="stable")
    return np.take_along_axis(idx, order, -1), np.take_along_axis(w, order, -1)


def router_fragile(x, w_gate_hf, bias, k, n_group=1, topk_group=1, tol=1e-5):
    """Tokens whose expert (or group) choice sits on a near-tie of the biased scores."""
    s = R.sigmoid(np.asarray(x, np.float64) @ np.asarray(w_gate_hf, np.float64).T)
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    n, e = s.shape
    frag = np.zeros(n, bool)
    if n_group > 1 and n_group > topk_group:
        grp = s.reshape(n, n_group, e // n_group)
        gs = np.sort(np.sort(grp, -1)[..., -2:].sum(-1), -1)[:, ::-1]
        frag |= gs[:, topk_group - 1] - gs[:, topk_group] < tol
        keep = np.argsort(-np.sort(grp, -1)[..., -2:].sum(-1), -1, kind="stable")[:, :topk_group]
        gmask = np.zeros((n, n_group), bool)
        np.put_along_axis(gmask, keep, True, -1)
        s = np.where(np.repeat(gmask, e // n_group, -1), s, -np.inf)
    srt = np.sort(s, -1)[:, ::-1]
    frag |= srt[:, k - 1] - srt[:, k] < tol
    return frag


# scaling stays a traced argument: one compile serves both scaling factors
_route = jax.jit(_router.route, static_argnames=("top_k", "renormalize", "activation", "n_group",
                                                 "topk_group"))


# ------------------------------------------------------------------ router


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)], ids=["g1", "g4k2"])
@pytest.mark.parametrize("use_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("scaling", [1.0, 2.446])
def test_route_vs_reference(groups, use_bias, scaling):
    n_group, topk_group = groups
    rng = np.random.default_rng(100 * n_group + 10 * use_bias + int(scaling * 1000))
    n, d, e, k = 37, 24, 16, 4
    x = rng.standard_normal((n, d)).astype(np.float32)
    w_hf = (rng.standard_normal((e, d)) * 2 / np.sqrt(d)).astype(np.float32)  # [E, D]
    bias = (rng.standard_normal(e) * 0.2).astype(np.float32) if use_bias else None
    idx, w = _route(x, w_hf.T, bias, top_k=k, renormalize=True, scaling=scaling,
                    n_group=n_group, topk_group=topk_group)
    idx, w = by_expert(idx, w)
    idx_ref, w_ref = R.route(x, w_hf, bias, k, True, scaling, n_group, topk_group)
    ok = ~router_fragile(x, w_hf, bias, k, n_group, topk_group)
    assert ok.mean() > 0.8
    np.testing.assert_array_equal(idx[ok], idx_ref[ok])
    np.testing.assert_allclose(w[ok], w_ref[ok], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(w.sum(-1), scaling, rtol=1e-5)
    assert all(len(set(r)) == k for r in idx)
    if n_group > 1:  # at most topk_group groups used, and the limit changes some choices
        assert (np.array([len(set(r // (e // n_group))) for r in idx]) <= topk_group).all()
        flat_idx, _ = R.route(x, w_hf, bias, k, True, scaling)
        assert (flat_idx != idx_ref).any(axis=1).sum() >= 3


def test_route_softmax_activation():
    rng = np.random.default_rng(9)
    n, d, e, k = 21, 16, 12, 3
    x = rng.standard_normal((n, d)).astype(np.float32)
    w_hf = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    idx, w = by_expert(*_route(x, w_hf.T, None, top_k=k, renormalize=False, scaling=1.0,
                               activation="softmax"))
    idx_ref, w_ref = R.route(x, w_hf, None, k, False, 1.0, activation="softmax")
    np.testing.assert_array_equal(idx, idx_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5)


def test_route_bias_only_for_selection():
    """A bias that changes the chosen set leaves the weights = renormalised UNBIASED scores."""
    rng = np.random.default_rng(10)
    n, d, e, k = 40, 24, 16, 4
    x = rng.standard_normal((n, d)).astype(np.float32)
    w_hf = (rng.standard_normal((e, d)) * 2 / np.sqrt(d)).astype(np.float32)
    bias = np.zeros(e, np.float32)
    bias[rng.permutation(e)[:5]] = 0.6  # favour 5 experts strongly
    for scaling in (1.0, 2.446):
        idx_b, w_b = by_expert(*_route(x, w_hf.T, bias, top_k=k, renormalize=True, scaling=scaling))
        idx_u, _ = by_expert(*_route(x, w_hf.T, None, top_k=k, renormalize=True, scaling=scaling))
        assert (idx_b != idx_u).any(axis=1).mean() > 0.5  # the bias flips most tokens' sets
        s = R.sigmoid(x.astype(np.float64) @ w_hf.T.astype(np.float64))
        s_sel = np.take_along_axis(s, idx_b, -1)
        np.testing.assert_allclose(w_b, s_sel / s_sel.sum(-1, keepdims=True) * scaling, rtol=1e-5)
        biased = np.take_along_axis(s + bias, idx_b, -1)  # the known-wrong bias-inclusive weights
        assert np.max(np.abs(w_b - biased / biased.sum(-1, keepdims=True) * scaling)) > 1e-2
        idx_ref, w_ref = R.route(x, w_hf, bias, k, True, scaling)
        ok = ~router_fragile(x, w_hf, bias, k)
        np.testing.assert_array_equal(idx_b[ok], idx_ref[ok])
        np.testing.assert_allclose(w_b[ok], w_ref[ok], rtol=1e-5)


def test_route_renorm_eps_and_flags():
    rng = np.random.default_rng(12)
    n, d, e, k = 6, 8, 16, 4
    x = np.ones((n, d), np.float32)
    w_hf = (-50.0 / d - rng.uniform(0, 0.3, (e, d))).astype(np.float32)  # logits ≈ -50..-52
    idx, w = by_expert(*_route(x, w_hf.T, None, top_k=k, renormalize=True, scaling=2.446))
    idx_ref, w_ref = R.route(x, w_hf, None, k, True, 2.446)
    np.testing.assert_array_equal(idx, idx_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-4)
    # Σ s ≈ 1e-21 is far below the 1e-20 eps: the weights do NOT sum to the scaling factor
    assert (w.sum(-1) < 0.5 * 2.446).all() and (w.sum(-1) > 0).all()
    # renormalize=False: the raw scores times the scaling
    xs = rng.standard_normal((n, d)).astype(np.float32)
    ws = (rng.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    for kk, renorm in ((k, False), (1, True)):  # top-1 is never renormalised
        idx, w = by_expert(*_route(xs, ws.T, None, top_k=kk, renormalize=renorm, scaling=2.446))
        s = R.sigmoid(xs.astype(np.float64) @ ws.T.astype(np.float64))
        np.testing.assert_allclose(w, np.take_along_axis(s, idx, -1) * 2.446, rtol=1e-5)
        idx_ref, w_ref = R.route(xs, ws, None, kk, renorm, 2.446)
        np.testing.assert_array_equal(idx, idx_ref)


# ------------------------------------------------------------------ routed experts


def expert_loop(x, idx, w, wg, wu, wd, act, b1, b2):
    """Per-token float64 loop: Σ_k w_k · W_down[e] act(W_gate[e] x, W_up[e] x)."""
    x = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], wd.shape[1]))
    for n in range(x.shape[0]):
        for e, p in zip(idx[n], w[n]):
            g, u = wg[e].astype(np.float64) @ x[n], wu[e].astype(np.float64) @ x[n]
            h = R.situ_glu(g, u, b1, b2) if act == "situ" else R.swiglu(g, u)
            out[n] += p * (wd[e].astype(np.float64) @ h)
    return out


ACTS = [("situ", 4.0, 25.0), ("situ", 4.0, None), ("silu", 4.0, None)]


@pytest.mark.parametrize("act", ACTS, ids=["situ", "situ_linear_up", "silu"])
@pytest.mark.parametrize("routing", ["random", "few_experts", "all_same"])
def test_routed_experts_forms_agree(act, routing):
    hidden_act, b1, b2 = act
    rng = np.random.default_rng(20)
    n, e, k, d, f = 13, 8, 3, 12, 10
    x = (rng.standard_normal((n, d)) * 2).astype(np.float32)
    if routing == "random":
        idx = np.stack([rng.permutation(e)[:k] for _ in range(n)])
    elif routing == "few_experts":  # experts 5..7 get zero tokens
        idx = np.stack([rng.permutation(5)[:k] for _ in range(n)])
    else:  # every token picks the same experts
        idx = np.tile(np.array([6, 1, 3]), (n, 1))
    idx = idx.astype(np.int32)
    w = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    wg = (rng.standard_normal((e, f, d)) * 2 / np.sqrt(d)).astype(np.float32)  # [E, out, in]
    wu = (rng.standard_normal((e, f, d)) * 2 / np.sqrt(d)).astype(np.float32)
    wd = (rng.standard_normal((e, d, f)) / np.sqrt(f)).astype(np.float32)
    want = expert_loop(x, idx, w, wg, wu, wd, hidden_act, b1, b2)
    run = jax.jit(_moe.routed_experts, static_argnames=("hidden_act", "beta_gate", "beta_up", "form"))
    outs = {form: np.asarray(run(x, idx, w, wg, wu, wd, hidden_act=hidden_act, beta_gate=b1,
                                 beta_up=b2, form=form)) for form in ("ragged", "gather")}
    for form, got in outs.items():
        assert rel_err(got, want) < 1e-5, (form, rel_err(got, want))
    assert rel_err(outs["ragged"], outs["gather"]) < 1e-5


def test_permute_combine_round_trip():
    rng = np.random.default_rng(21)
    n, k, e, d = 9, 2, 6, 5
    x = rng.standard_normal((n, d)).astype(np.float32)
    idx = np.stack([rng.permutation(4)[:k] for _ in range(n)]).astype(np.int32)  # 4, 5 unused
    xs, order, sizes = _moe.permute(jnp.asarray(x), jnp.asarray(idx), e)
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(idx.ravel(), minlength=e))
    flat = idx.ravel()[np.asarray(order)]
    assert (np.diff(flat) >= 0).all()  # rows sorted by expert
    np.testing.assert_array_equal(np.asarray(xs), x[np.asarray(order) // k])
    w = rng.uniform(size=(n, k)).astype(np.float32)
    y = np.asarray(_moe.combine(xs, order, jnp.asarray(w)))
    np.testing.assert_allclose(y, x * w.sum(-1, keepdims=True), rtol=1e-6)


# ------------------------------------------------------------------ LatentMoE / DenseMLP modules

LATENT = dict(hidden_size=40, num_experts=16, num_experts_per_token=4, moe_intermediate_size=12,
              routed_expert_hidden_size=20, num_shared_experts=2, dtype="float32")
KIMI_LINEAR = dict(LATENT, routed_expert_hidden_size=None, hidden_act="silu",
                   activation_situ_linear_beta=None, routed_scaling_factor=2.446,
                   num_shared_experts=1)


def moe_cfg(kind):
    return ModelConfig.preset("tiny").replace(**(LATENT if kind == "latent" else KIMI_LINEAR))


def randomise(model, rng):
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def fill(tree):
        out = {}
        for name, val in tree.items():
            if isinstance(val, dict):
                out[name] = fill(val)
            elif name == "gate_bias":
                out[name] = (rng.standard_normal(val.shape) * 0.1).astype(np.float32)
            elif name.endswith("norm"):
                out[name] = (1 + 0.3 * rng.standard_normal(val.shape)).astype(np.float32)
            else:
                fan_in = val.shape[-1] if name.startswith("w_") else val.shape[0]  # experts [E, out, in]
                gain = 2.0 if name in ("gate", "w_gate", "w_up") else 1.0
                out[name] = (gain * rng.standard_normal(val.shape) / np.sqrt(fan_in)).astype(np.float32)
        return out

    pure = fill(pure)
    set_params(model, pure)
    return pure


def set_params(model, pure):
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(jnp.asarray, pure))
    nnx.update(model, state)


def moe_hf(pure):
    p = dict(gate=pure["gate"].T, e_score_correction_bias=pure["gate_bias"],
             experts=[dict(w1=pure["w_gate"][i], w3=pure["w_up"][i], w2=pure["w_down"][i])
                      for i in range(pure["w_gate"].shape[0])])
    if "latent_down" in pure:
        p["routed_expert_down_proj"] = pure["latent_down"].T
        p["routed_expert_up_proj"] = pure["latent_up"].T
    if "latent_norm" in pure:
        p["routed_expert_norm"] = pure["latent_norm"]
    if "shared" in pure:
        p["shared_experts"] = {k: v.T for k, v in pure["shared"].items()}
    return p


def moe_ref_cfg(cfg):
    return dict(top_k=cfg.num_experts_per_token, renormalize=cfg.moe_renormalize,
                routed_scaling_factor=cfg.routed_scaling_factor, rms_norm_eps=cfg.rms_norm_eps,
                n_group=cfg.num_expert_group, topk_group=cfg.topk_group, act=cfg.hidden_act,
                beta1=cfg.activation_situ_beta, beta2=cfg.activation_situ_linear_beta)


@functools.lru_cache(maxsize=None)
def built_moe(kind):
    cfg = moe_cfg(kind)
    model = abstract(LatentMoE, cfg)
    pure = randomise(model, np.random.default_rng(30 if kind == "latent" else 31))
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames="form")
    def fwd(st, x, form):
        out = nnx.merge(graphdef, st)(x, backends=Backends(moe=form))
        return out.output, out.routing.experts, out.routing.weights

    return cfg, pure, state, fwd


@pytest.mark.parametrize("kind", ["latent", "kimi_linear"])
@pytest.mark.parametrize("form", ["ragged", "gather"])
def test_latent_moe_vs_reference(kind, form):
    cfg, pure, state, fwd = built_moe(kind)
    assert ("latent_down" in pure) == (kind == "latent")
    hf = moe_hf(pure)
    x = np.random.default_rng(3).standard_normal((2, 11, cfg.hidden_size)).astype(np.float32)
    y, idx, w = fwd(state, x, form)
    flat = x.reshape(-1, cfg.hidden_size)
    want = R.latent_moe(flat, hf, moe_ref_cfg(cfg))
    idx_ref, w_ref = R.route(flat, hf["gate"], hf["e_score_correction_bias"],
                             cfg.num_experts_per_token, True, cfg.routed_scaling_factor)
    ok = ~router_fragile(flat, hf["gate"], hf["e_score_correction_bias"], cfg.num_experts_per_token)
    assert ok.mean() > 0.8
    idx_s, w_s = by_expert(np.asarray(idx).reshape(flat.shape[0], -1),
                           np.asarray(w).reshape(flat.shape[0], -1))
    np.testing.assert_array_equal(idx_s[ok], idx_ref[ok])
    np.testing.assert_allclose(w_s[ok], w_ref[ok], rtol=1e-5)
    y = np.asarray(y).reshape(flat.shape)
    assert rel_err(y[ok], want[ok]) < 1e-5, rel_err(y[ok], want[ok])


@pytest.mark.parametrize("form", ["ragged", "gather"])
def test_latent_moe_adversarial_routing(form):
    """A huge bias on experts 0..k-1: every token picks them, every other expert gets 0 tokens."""
    cfg, pure, state, fwd = built_moe("latent")
    k = cfg.num_experts_per_token
    bias = np.zeros(cfg.num_experts, np.float32)
    bias[:k] = 1e3
    model = abstract(LatentMoE, cfg)
    set_params(model, dict(pure, gate_bias=bias))
    _, state = nnx.split(model)
    hf = dict(moe_hf(pure), e_score_correction_bias=bias)
    x = np.random.default_rng(4).standard_normal((2, 11, cfg.hidden_size)).astype(np.float32)
    y, idx, w = fwd(state, x, form)
    flat = x.reshape(-1, cfg.hidden_size)
    idx, w = by_expert(np.asarray(idx).reshape(22, k), np.asarray(w).reshape(22, k))
    np.testing.assert_array_equal(idx, np.tile(np.arange(k), (flat.shape[0], 1)))
    s = R.sigmoid(flat.astype(np.float64) @ hf["gate"].T.astype(np.float64))[:, :k]
    np.testing.assert_allclose(w, s / s.sum(-1, keepdims=True) * cfg.routed_scaling_factor,
                               rtol=1e-5)
    want = R.latent_moe(flat, hf, moe_ref_cfg(cfg))
    assert rel_err(np.asarray(y).reshape(flat.shape), want) < 1e-5


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_dense_mlp_vs_reference(act):
    over = dict(hidden_size=40, dtype="float32")
    if act == "silu":
        over.update(hidden_act="silu", activation_situ_linear_beta=None)
    cfg = ModelConfig.preset("tiny").replace(**over)
    model = abstract(DenseMLP, cfg, 28)
    pure = randomise(model, np.random.default_rng(5))
    x = np.random.default_rng(6).standard_normal((2, 7, 40)).astype(np.float32) * 3
    y = np.asarray(nnx.jit(lambda m, xx: m(xx))(model, x))
    want = R.dense_mlp(x.reshape(-1, 40), {k: v.T for k, v in pure.items()}, act,
                       cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    assert rel_err(y.reshape(-1, 40), want) < 1e-5


# ------------------------------------------------------------------ AttnRes mix


@pytest.mark.parametrize("num_blocks", [0, 1, 2, 4])
def test_attn_res_mix_vs_reference(num_blocks):
    rng = np.random.default_rng(40 + num_blocks)
    b, t, n_slots, d = 2, 5, 4, 24
    blocks = (rng.standard_normal((b, t, n_slots, d)) * rng.uniform(0.5, 3, (1, 1, n_slots, 1)))
    blocks[:, :, num_blocks:] = 1e4  # unused slots hold (finite) junk: they must be masked
    prefix = rng.standard_normal((b, t, d)) * 2
    w_norm = 1 + 0.5 * rng.standard_normal(d)
    w_proj = rng.standard_normal(d)
    blocks, prefix, w_norm, w_proj = (a.astype(np.float32) for a in (blocks, prefix, w_norm, w_proj))
    mix = jax.jit(_attn_res.attn_res_mix, static_argnames="eps")
    got = np.asarray(mix(blocks, jnp.int32(num_blocks), prefix, w_norm, w_proj, eps=1e-5))
    cands = [blocks[:, :, i] for i in range(num_blocks)] + [prefix]
    want = R.attn_res_mix(cands, w_norm, w_proj[None], eps=1e-5)
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
    if num_blocks == 0:
        np.testing.assert_array_equal(got, prefix)  # no snapshot: the prefix itself
    else:  # the mix is not a plain mean / not just the prefix
        assert rel_err(got, prefix) > 1e-2
        assert rel_err(got, np.mean(cands, axis=0)) > 1e-2
    # bf16 activations: fp32 inside, cast back to the activation dtype
    got_bf = mix(jnp.asarray(blocks, jnp.bfloat16), jnp.int32(num_blocks),
                 jnp.asarray(prefix, jnp.bfloat16), w_norm, w_proj, eps=1e-5)
    assert got_bf.dtype == jnp.bfloat16
    cands_bf = [np.asarray(jnp.asarray(c, jnp.bfloat16), np.float64) for c in cands]
    want_bf = R.attn_res_mix(cands_bf, w_norm, w_proj[None], eps=1e-5)
    assert rel_err(got_bf, want_bf) < 1e-2


# ------------------------------------------------------------------ norms and activations


def test_rms_norm_fp32():
    rng = np.random.default_rng(50)
    x = (rng.standard_normal((3, 7, 33)) * 5 + 1).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(33)).astype(np.float32)
    for eps in (1e-5, 1e-6):
        got = np.asarray(_norms.rms_norm(jnp.asarray(x), jnp.asarray(w), eps))
        np.testing.assert_allclose(got, R.rms_norm(x, w, eps), rtol=2e-6, atol=1e-7)
    tiny = np.full((1, 33), 1e-4, np.float32)  # eps placement: mean(x²) + eps under the rsqrt
    got = np.asarray(_norms.rms_norm(jnp.asarray(tiny), jnp.ones(33, jnp.float32), 1e-5))
    np.testing.assert_allclose(got, 1e-4 / np.sqrt(1e-8 + 1e-5), rtol=1e-5)


def test_rms_norm_bf16_casts_before_weight():
    rng = np.random.default_rng(51)
    bf16 = ml_dtypes.bfloat16
    x = (rng.standard_normal((64, 48)) * 3).astype(bf16)
    w = (1 + 0.5 * rng.standard_normal(48)).astype(bf16)
    got = _norms.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5)
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got).astype(np.float32)
    xf = x.astype(np.float32)
    normed = xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + np.float32(1e-5))
    cast_first = (normed.astype(bf16).astype(np.float32) * w.astype(np.float32)).astype(bf16)
    weight_first = (normed * w.astype(np.float32)).astype(bf16)
    cast_first, weight_first = cast_first.astype(np.float32), weight_first.astype(np.float32)
    differ = cast_first != weight_first
    assert differ.mean() > 0.05  # the two orders really differ in bf16
    # the op matches the cast-then-weight order (up to rare 1-ulp f32 rsqrt differences)
    assert (got == cast_first).mean() > 0.99
    assert (got[differ] == cast_first[differ]).mean() > 0.95
    np.testing.assert_allclose(got, cast_first, rtol=2 ** -7)


def test_layer_norm_vs_reference():
    rng = np.random.default_rng(52)
    x = (rng.standard_normal((4, 6, 19)) * 3 + 5).astype(np.float32)
    w, b = rng.standard_normal(19).astype(np.float32), rng.standard_normal(19).astype(np.float32)
    for eps in (1e-6, 1e-2):
        got = np.asarray(_norms.layer_norm(jnp.asarray(x), w, b, eps))
        np.testing.assert_allclose(got, R.layer_norm(x, w, b, eps), rtol=1e-5, atol=2e-6)
    got_bf = _norms.layer_norm(jnp.asarray(x, jnp.bfloat16), w, b, 1e-6)
    assert got_bf.dtype == jnp.float32  # fp32 out (the indexer keys)


def test_glu_activations_vs_reference():
    rng = np.random.default_rng(53)
    g = (rng.standard_normal((5, 40)) * 6).astype(np.float32)
    u = (rng.standard_normal((5, 40)) * 30).astype(np.float32)
    g[0, :4] = [1e4, -1e4, 80.0, -80.0]
    u[0, :4] = [1e4, 1e4, -1e4, 3.0]
    for b2 in (25.0, None):
        got = np.asarray(_activations.situ_glu(jnp.asarray(g), jnp.asarray(u), 4.0, b2))
        want = R.situ_glu(g, u, 4.0, b2)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.isfinite(got).all()
    assert np.abs(np.asarray(_activations.situ_glu(jnp.asarray(g), jnp.asarray(u), 4.0, 25.0))).max() <= 100.0
    got = np.asarray(_activations.swiglu(jnp.asarray(g), jnp.asarray(u)))
    np.testing.assert_allclose(got, R.swiglu(g, u), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(_activations.glu(g, u, "silu")), got, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(_activations.glu(g, u, "situ", 4.0, 25.0)),
                               R.situ_glu(g, u, 4.0, 25.0), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="hidden_act"):
        _activations.glu(g, u, "gelu")
    out_bf = _activations.situ_glu(jnp.asarray(g, jnp.bfloat16), jnp.asarray(u, jnp.bfloat16), 4.0, 25.0)
    assert out_bf.dtype == jnp.bfloat16
    want_bf = R.situ_glu(np.asarray(jnp.asarray(g, jnp.bfloat16), np.float64),
                         np.asarray(jnp.asarray(u, jnp.bfloat16), np.float64), 4.0, 25.0)
    np.testing.assert_allclose(np.asarray(out_bf, np.float64), want_bf, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("form", ["ragged", "blocked", "gather", "auto"])
@pytest.mark.parametrize("tokens", [1, 13])
def test_expert_adapters_beside_packed_experts(form, tokens):
    """LoRA factors beside packed MXFP4 experts (`adapters`): `W x + a (b x)` per weight equals
    the float64 loop over the experts with `dequant(W) + a @ b` merged in (spec: the adapters
    are a low-rank delta of each expert's weight), in every form that takes them; a token
    picking an expert twice and experts with no tokens included. "selected" refuses them."""
    from k31jax.quant import MXFP4Weight, mxfp4_dequantize_packed, mxfp4_quantize_packed

    rng = np.random.default_rng(31)
    n, e, k, d, f, r = tokens, 6, 3, 64, 32, 3
    x = rng.standard_normal((n, d)).astype(np.float32)
    idx = np.stack([rng.choice(4, k) for _ in range(n)]).astype(np.int32)  # repeats; experts 4, 5 idle
    w = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    packed = [mxfp4_quantize_packed(jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-1]), jnp.float32))
              for shape in ((e, f, d), (e, f, d), (e, d, f))]
    adapters = [_moe.ExpertAdapter(jnp.asarray(rng.standard_normal((e, out, r)) * 0.3, jnp.float32),
                                   jnp.asarray(rng.standard_normal((e, r, inp)) * 0.3, jnp.float32))
                for out, inp in ((f, d), (f, d), (d, f))]
    merged = [np.asarray(mxfp4_dequantize_packed(p, s, dtype=jnp.float32), np.float64)
              + np.asarray(ad.a, np.float64) @ np.asarray(ad.b, np.float64) for (p, s), ad in zip(packed, adapters)]
    want = expert_loop(x, idx, w, *merged, "situ", 4.0, 25.0)
    got = jax.jit(functools.partial(_moe.routed_experts, form=form))(
        x, idx, w, *(MXFP4Weight(p, s) for p, s in packed), adapters=tuple(adapters))
    assert rel_err(np.asarray(got), want) < 1e-5, rel_err(np.asarray(got), want)
    plain = np.asarray(_moe.routed_experts(x, idx, w, *(MXFP4Weight(p, s) for p, s in packed), form=form))
    assert rel_err(plain, want) > 1e-2  # the adapters matter at this size
    with pytest.raises(ValueError, match="selected"):
        _moe.routed_experts(x, idx, w, *(MXFP4Weight(p, s) for p, s in packed), form="selected",
                            adapters=tuple(adapters))
