"""The grouped-matmul forms agree: ragged_dot, blocked (CPU) and gather."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax.ops import MXFP4Weight, blocked_rows, grouped_matmul, grouped_matmul_blocked, permute, routed_experts
from k31jax.quant import mxfp4_quantize_packed


def _case(n, k, e, d, i, routing, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    if routing == "one_expert":  # every token's first choice is expert e-1; experts 0.. idle
        idx = np.stack([np.r_[e - 1, rng.choice(e - 1, k - 1, replace=False)] for _ in range(n)])
    else:
        idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    w = jnp.asarray(rng.uniform(0.1, 1, (n, k)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in ((e, i, d), (e, i, d), (e, d, i))]
    return x, jnp.asarray(idx, jnp.int32), w, ws


def _loop_reference(x, idx, w, ws):
    x, idx, w = np.asarray(x, np.float64), np.asarray(idx), np.asarray(w, np.float64)
    wg, wu, wd = (np.asarray(a, np.float64) for a in ws)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(idx[t]):
            g, u = wg[e] @ x[t], wu[e] @ x[t]
            h = 4 * np.tanh(g / 4) / (1 + np.exp(-g)) * 25 * np.tanh(u / 25)
            out[t] += w[t, j] * (wd[e] @ h)
    return out


@pytest.mark.parametrize("routing", ["random", "one_expert"])
@pytest.mark.parametrize("n", [1, 7, 45])
def test_forms_agree_with_loop(n, routing):
    x, idx, w, ws = _case(n, 3, 12, 64, 32, routing)
    ref = _loop_reference(x, idx, w, ws)
    fn = jax.jit(routed_experts, static_argnames=("form",))
    for form in ("ragged", "blocked", "gather"):
        np.testing.assert_allclose(fn(x, idx, w, *ws, form=form), ref, rtol=2e-5, atol=2e-5, err_msg=form)


def test_blocked_with_packed_mxfp4_equals_ragged():
    x, idx, w, ws = _case(33, 4, 8, 64, 32, "random", seed=3)
    packed = [MXFP4Weight(*mxfp4_quantize_packed(a)) for a in ws]
    fn = jax.jit(routed_experts, static_argnames=("form",))
    a = fn(x, idx, w, *packed, form="blocked")
    b = fn(x, idx, w, *packed, form="ragged")
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(a - fn(x, idx, w, *ws, form="ragged")).max()) > 0  # quantisation is real


@pytest.mark.parametrize("block", [32, 64, 256])
def test_blocked_block_sizes_equal_ragged(block):
    """Every block size `blocked_rows` picks, on groups of every kind: an expert with no rows,
    one with a row from every token, groups shorter and longer than the block, and tokens
    that chose the same expert twice."""
    x, idx, _, ws = _case(301, 4, 12, 64, 32, "one_expert", seed=5)
    idx = jnp.where(idx == 0, 1, idx)  # expert 0 idle; some tokens now hold expert 1 twice
    xs, _, sizes = permute(x, idx, 12)
    assert int(sizes[0]) == 0 and int(sizes.max()) > block and bool(jnp.any(sizes % block))
    got = jax.jit(grouped_matmul_blocked, static_argnames="block")(xs, ws[0], sizes, block=block)
    np.testing.assert_allclose(got, grouped_matmul(xs, ws[0], sizes), rtol=1e-5, atol=1e-5)


def test_blocked_rows_grows_with_rows_per_expert():
    assert [blocked_rows(n * 4, 64) for n in (1, 512, 2048, 16384)] == [32, 32, 64, 256]
