"""MoE balancing: expert load, the sign bias update, the sequence-wise loss, metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax.ops import route
from k31jax.train._balance import (SignBiasUpdate, expert_load, load_metrics,
                                   sequence_balance_loss)
from refs import train as ref


def _routing(seed, lead, b, t, e, k):
    """Random distinct top-k ids and sigmoid scores, and a mask with one empty sequence."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(lead + (b, t, e))
    idx = np.argsort(-logits, axis=-1)[..., :k].astype(np.int32)
    scores = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    mask = (rng.random((b, t)) > 0.3).astype(np.float32)
    mask[-1] = 0.0
    return scores, idx, mask


def test_expert_load_layers_masked():
    _, idx, mask = _routing(0, (3,), 2, 7, 10, 3)
    got = expert_load(jnp.asarray(idx), jnp.asarray(mask), 10)
    assert got.shape == (3, 10)
    np.testing.assert_array_equal(np.asarray(got), ref.expert_load(idx, mask, 10))
    assert float(got.sum()) == 3 * 3 * mask.sum()  # padding tokens do not count


@pytest.mark.parametrize("shape", [(13, 4), (2, 5, 4)])
def test_expert_load_flat_and_single_layer(shape):
    rng = np.random.default_rng(1)
    idx = rng.integers(0, 9, shape).astype(np.int32)
    mask = (rng.random(shape[:-1]) > 0.5).astype(np.float32)
    got = expert_load(jnp.asarray(idx), jnp.asarray(mask), 9)
    np.testing.assert_array_equal(np.asarray(got), ref.expert_load(idx, mask, 9))
    np.testing.assert_array_equal(np.asarray(expert_load(jnp.asarray(idx), None, 9)),
                                  ref.expert_load(idx, None, 9))


def test_expert_load_errors():
    with pytest.raises(ValueError, match="mask must have the token shape"):
        expert_load(jnp.zeros((2, 3, 4), jnp.int32), jnp.ones((3, 2)), 8)
    with pytest.raises(ValueError, match="router_idx must be"):
        expert_load(jnp.zeros((4,), jnp.int32), None, 8)


def test_sign_bias_update_matches_reference():
    rng = np.random.default_rng(2)
    bias = rng.standard_normal((3, 8)).astype(np.float32) * 0.1
    load = rng.integers(0, 20, (3, 8)).astype(np.float32)
    load[1] = 5.0  # all at the mean: unchanged
    got = SignBiasUpdate(rate=1e-2)(jnp.asarray(bias), jnp.asarray(load))
    np.testing.assert_allclose(np.asarray(got), ref.sign_bias_update(bias, load, 1e-2), rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(np.asarray(got[1]), bias[1])


def test_sign_bias_update_balances_a_skewed_router():
    """route -> load -> update on a router with strong per-expert preferences (a constant
    input feature whose gate row is a large random offset): the load flattens out."""
    rng = np.random.default_rng(3)
    n, d, e, k, layers = 512, 16, 16, 4, 2
    x = np.concatenate([rng.standard_normal((n, d)), np.ones((n, 1))], axis=1).astype(np.float32)
    w_gate = np.concatenate([0.3 * rng.standard_normal((layers, d, e)),
                             2.0 * rng.standard_normal((layers, 1, e))], axis=1).astype(np.float32)
    x, w_gate = jnp.asarray(x), jnp.asarray(w_gate)
    rule = SignBiasUpdate(rate=1e-2)

    def loads(bias):
        idx = jax.vmap(lambda w, b: route(x, w, b, k)[0])(w_gate, bias)  # [L, N, K]
        return expert_load(idx[:, None], None, e)  # as [L, B=1, T=N, K]

    @jax.jit
    def balanced_bias():
        return jax.lax.fori_loop(0, 100, lambda i, b: rule(b, loads(b)), jnp.zeros((layers, e)))

    before = load_metrics(loads(jnp.zeros((layers, e))))
    after = load_metrics(loads(balanced_bias()))
    assert np.all(np.asarray(before["max_over_mean"]) > 2.5)
    assert np.all(np.asarray(after["max_over_mean"]) < 1.3)
    assert np.all(np.asarray(after["cv"]) < 0.3 * np.asarray(before["cv"]))
    assert np.all(np.asarray(after["dead_fraction"]) == 0.0)


@pytest.mark.parametrize("lead", [(), (3,)])
def test_sequence_balance_loss_matches_reference(lead):
    scores, idx, mask = _routing(4, lead, 3, 11, 12, 5)
    got = sequence_balance_loss(jnp.asarray(scores), jnp.asarray(idx), jnp.asarray(mask), alpha=0.01)
    np.testing.assert_allclose(float(got), ref.sequence_balance_loss(scores, idx, mask, 0.01), rtol=1e-5)


def test_sequence_balance_loss_is_alpha_when_uniform():
    """Every expert chosen equally often with uniform scores: Σ f P = 1."""
    e, k, t = 6, 2, 9  # 9 tokens x 2 picks cycle through all 6 experts 3 times
    idx = (np.arange(t * k).reshape(1, t, k) % e).astype(np.int32)
    scores = np.full((1, t, e), 0.3, np.float32)
    assert float(sequence_balance_loss(jnp.asarray(scores), jnp.asarray(idx), alpha=0.5)) == pytest.approx(0.5)


def test_sequence_balance_loss_gradient_matches_finite_differences():
    scores, idx, mask = _routing(5, (), 2, 6, 5, 2)
    grad = np.asarray(jax.grad(lambda s: sequence_balance_loss(s, jnp.asarray(idx), jnp.asarray(mask),
                                                               alpha=1.0))(jnp.asarray(scores)))
    s64, eps = scores.astype(np.float64), 1e-6
    for pos in [(0, 0, 1), (0, 3, 4), (1, 2, 0)]:
        up, down = s64.copy(), s64.copy()
        up[pos] += eps
        down[pos] -= eps
        fd = (ref.sequence_balance_loss(up, idx, mask, 1.0)
              - ref.sequence_balance_loss(down, idx, mask, 1.0)) / (2 * eps)
        assert grad[pos] == pytest.approx(fd, rel=1e-3, abs=1e-7), pos
    assert np.all(grad[1][mask[1] == 0] == 0.0)  # padding tokens get no gradient


def test_load_metrics_matches_reference():
    rng = np.random.default_rng(6)
    load = rng.integers(0, 5, (4, 9)).astype(np.float32)
    load[2] = 0.0  # a layer with no tokens
    got = load_metrics(jnp.asarray(load))
    want = ref.load_metrics(load)
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), want[key], rtol=1e-6, err_msg=key)
    assert float(got["max_over_mean"][2]) == 0.0 and float(got["dead_fraction"][2]) == 1.0
