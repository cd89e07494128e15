"""Chunked next-token cross entropy vs a float64 reference and the full-vocabulary loss."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax.train._loss import bits_per_byte, chunked_cross_entropy, full_cross_entropy
from refs import train as ref


def _inputs(seed, b, t, d, v, dtype=np.float32, ignore_some=True):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((b, t, d)).astype(dtype)
    lm_head = (rng.standard_normal((d, v)) / math.sqrt(d) * 3.0).astype(dtype)
    targets = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = (rng.random((b, t)) > 0.25).astype(np.float32)
    if ignore_some:
        # ignored positions may carry an out-of-range id (e.g. -100): they must not matter
        targets = np.where(mask == 0, -100, targets).astype(np.int32)
    return hidden, lm_head, targets, mask


def _grads(fn, hidden, lm_head, targets, mask, **kw):
    def loss(h, w):
        return fn(h, w, targets, mask, **kw)[0]

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, lm_head)


@pytest.mark.parametrize("v, chunk", [(97, 16), (96, 32), (50, 4096), (131, 1)])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_chunked_matches_float64_reference(v, chunk, z_loss):
    hidden, lm_head, targets, mask = _inputs(0, 2, 7, 12, v)
    want = ref.cross_entropy(hidden, lm_head, targets, mask, z_loss)
    loss, stats = jax.jit(lambda *a: chunked_cross_entropy(*a, vocab_chunk=chunk, z_loss=z_loss))(
        hidden, lm_head, targets, mask)
    np.testing.assert_allclose(float(loss), want["loss"], rtol=1e-5)
    np.testing.assert_allclose(float(stats["nll_sum"]), want["nll_sum"], rtol=1e-5)
    np.testing.assert_allclose(float(stats["z_loss_sum"]), want["z_loss_sum"], rtol=1e-5, atol=1e-7)
    assert float(stats["tokens"]) == want["tokens"]
    assert float(stats["correct"]) == want["correct"]
    (_, (d_h, d_w)) = _grads(chunked_cross_entropy, hidden, lm_head, targets, mask,
                             vocab_chunk=chunk, z_loss=z_loss)
    np.testing.assert_allclose(np.asarray(d_h), want["d_hidden"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(d_w), want["d_lm_head"], rtol=1e-4, atol=1e-5)


def test_full_matches_float64_reference():
    hidden, lm_head, targets, mask = _inputs(1, 3, 5, 8, 61)
    want = ref.cross_entropy(hidden, lm_head, targets, mask, 1e-3)
    loss, stats = full_cross_entropy(hidden, lm_head, targets, mask, z_loss=1e-3)
    np.testing.assert_allclose(float(loss), want["loss"], rtol=1e-5)
    assert float(stats["correct"]) == want["correct"]


def test_chunked_equals_full_and_reference_in_float64():
    """With x64 on (float64 operands keep float64 logits), the chunked pass, the autodiff of
    the full loss and the NumPy reference agree to float64 precision."""
    with jax.enable_x64(True):
        hidden, lm_head, targets, mask = _inputs(2, 2, 9, 16, 203, dtype=np.float64)
        want = ref.cross_entropy(hidden, lm_head, targets, mask, 3e-3)
        full_v, full_g = _grads(full_cross_entropy, hidden, lm_head, targets, mask, z_loss=3e-3)
        chunk_v, chunk_g = _grads(chunked_cross_entropy, hidden, lm_head, targets, mask,
                                  vocab_chunk=37, z_loss=3e-3)
        assert chunk_v.dtype == jnp.float64 and chunk_g[0].dtype == jnp.float64
        for value in (chunk_v, full_v):
            np.testing.assert_allclose(float(value), want["loss"], rtol=1e-12)
        for grads in (chunk_g, full_g):
            np.testing.assert_allclose(np.asarray(grads[0]), want["d_hidden"], rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(np.asarray(grads[1]), want["d_lm_head"], rtol=1e-10, atol=1e-12)


def test_bf16_inputs_give_f32_loss_close_to_reference():
    hidden, lm_head, targets, mask = _inputs(3, 2, 6, 32, 77)
    h16, w16 = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(lm_head, jnp.bfloat16)
    want = ref.cross_entropy(np.asarray(h16, np.float64), np.asarray(w16, np.float64), targets, mask)
    loss, _ = chunked_cross_entropy(h16, w16, targets, mask, vocab_chunk=20)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), want["loss"], rtol=1e-4)
    _, (d_h, d_w) = _grads(chunked_cross_entropy, h16, w16, targets, mask, vocab_chunk=20)
    assert d_h.dtype == jnp.bfloat16 and d_w.dtype == jnp.bfloat16
    scale = np.abs(want["d_lm_head"]).max()
    assert np.abs(np.asarray(d_w, np.float64) - want["d_lm_head"]).max() < 2e-2 * scale


def test_stats_are_differentiable_consistently():
    """Differentiating a stat (not just the loss) goes through the same custom VJP."""
    hidden, lm_head, targets, mask = _inputs(4, 1, 8, 8, 40)
    want = ref.cross_entropy(hidden, lm_head, targets, mask, 0.0)

    def nll_only(h):
        return chunked_cross_entropy(h, lm_head, targets, mask, vocab_chunk=16, z_loss=0.5)[1]["nll_sum"]

    np.testing.assert_allclose(np.asarray(jax.grad(nll_only)(hidden)), want["d_hidden"], rtol=1e-4, atol=1e-5)


def test_bits_per_byte():
    assert float(bits_per_byte(jnp.float32(math.log(2.0) * 300.0), 100)) == pytest.approx(3.0, rel=1e-6)


def test_bad_shapes_are_named():
    hidden, lm_head, targets, mask = _inputs(5, 2, 3, 4, 10)
    with pytest.raises(ValueError, match="lm_head must be"):
        chunked_cross_entropy(hidden, lm_head.T, targets, mask)
    with pytest.raises(ValueError, match="mask must be"):
        chunked_cross_entropy(hidden, lm_head, targets, mask[:, :2])
    with pytest.raises(ValueError, match="targets must be integer"):
        chunked_cross_entropy(hidden, lm_head, targets.astype(np.float32), mask)
    with pytest.raises(ValueError, match="vocab_chunk"):
        chunked_cross_entropy(hidden, lm_head, targets, mask, vocab_chunk=0)


def _intermediate_shapes(closed_jaxpr) -> set[tuple[int, ...]]:
    """Shapes of every value produced inside a jaxpr, sub-jaxprs (scan bodies) included."""
    shapes = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            shapes.update(tuple(getattr(var.aval, "shape", ())) for var in eqn.outvars)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(closed_jaxpr.jaxpr)
    return shapes


def test_chunked_never_materialises_the_logits():
    """V = 32768, B·T = 256, D = 64: the full loss+grad holds [256, 32768] fp32 blocks; the
    chunked one only [256, 4096] chunks (plus the [D, V] gradient of lm_head itself)."""
    b, t, d, v = 2, 128, 64, 32768
    hidden = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    lm_head = jax.ShapeDtypeStruct((d, v), jnp.float32)
    targets = jnp.zeros((b, t), jnp.int32)
    mask = jnp.ones((b, t), jnp.float32)

    def loss_and_grad(fn, **kw):
        return jax.value_and_grad(lambda h, w: fn(h, w, targets, mask, **kw)[0], argnums=(0, 1))

    full = loss_and_grad(full_cross_entropy)
    chunked = loss_and_grad(chunked_cross_entropy, vocab_chunk=4096)
    assert max(map(math.prod, _intermediate_shapes(jax.make_jaxpr(full)(hidden, lm_head)))) >= b * t * v
    chunked_shapes = _intermediate_shapes(jax.make_jaxpr(chunked)(hidden, lm_head))
    assert (b * t, 4096) in chunked_shapes  # the walk does reach the per-chunk logits
    assert max(map(math.prod, chunked_shapes - {(d, v)})) <= b * t * 4096

    full_mem = jax.jit(full).lower(hidden, lm_head).compile().memory_analysis()
    chunked_mem = jax.jit(chunked).lower(hidden, lm_head).compile().memory_analysis()
    if full_mem is not None and full_mem.temp_size_in_bytes > 0:
        # full: >= one [256, 32768] fp32 buffer (32 MiB); chunked: a few 4 MiB chunk buffers
        assert full_mem.temp_size_in_bytes >= b * t * v * 4
        assert chunked_mem.temp_size_in_bytes < full_mem.temp_size_in_bytes / 3
