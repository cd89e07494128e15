"""QAT fake-quant with a straight-through estimator and the export round trip (mx_formats.md §6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax.quant import (
    dequantize,
    fake_quant,
    mx_fake_quant_activations,
    mxfp4_dequantize_packed,
    mxfp4_quantize_packed,
    quantize,
)

FMTS = ("e2m1", "e4m3", "e5m2")
RULES = ("floor", "rceil", "even")
HALF_MAX = {"e2m1": 3.0, "e4m3": 224.0, "e5m2": 28672.0}  # max_elem / 2


def weights(seed, shape=(6, 128), dtype=np.float32):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 4, (*shape[:-1], shape[-1] // 32))).repeat(32, -1)
    w[0, :32] = 0.0
    return jnp.asarray(w, dtype)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rule", RULES)
def test_forward_is_dequantize_of_quantize(fmt, rule):
    w = weights(0)
    got = fake_quant(w, fmt, rule)
    want = dequantize(*quantize(w, fmt, rule=rule), fmt)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Along axis 0 (e.g. for the backward GEMM's contraction axis).
    got0 = fake_quant(w.T, fmt, rule, axis=0)
    want0 = dequantize(*quantize(w.T, fmt, rule=rule, axis=0), fmt, axis=0)
    np.testing.assert_array_equal(np.asarray(got0), np.asarray(want0))


def test_forward_keeps_bf16_and_is_exact():
    w = weights(1, dtype=jnp.bfloat16)
    got = fake_quant(w)
    assert got.dtype == jnp.bfloat16
    want = dequantize(*quantize(w, "e2m1"), "e2m1", dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want))


@pytest.mark.parametrize("fmt,rule", [("e2m1", "floor"), ("e2m1", "rceil"), ("e4m3", "rceil")])
def test_ste_gradient_is_identity(fmt, rule):
    w = weights(2)
    c = jnp.asarray(np.random.default_rng(3).standard_normal(w.shape), jnp.float32)
    # Make sure clipping happens in the forward (floor clips the (6, 8) band) ...
    w = w.at[1, 0].set(7.9 * 2.0**3).at[1, 1].set(1.0)
    loss = lambda w: jnp.sum(fake_quant(w, fmt, rule) * c)
    g = jax.jit(jax.grad(loss))(w)
    assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))  # ... STE has no clip mask
    # Forward mode and vmap work too (custom_jvp with identity tangent).
    t = jnp.ones_like(w)
    _, tan = jax.jvp(lambda w: fake_quant(w, fmt, rule), (w,), (t,))
    np.testing.assert_array_equal(np.asarray(tan), np.asarray(t))
    gv = jax.vmap(jax.grad(loss))(jnp.stack([w, 2 * w]))
    np.testing.assert_array_equal(np.asarray(gv), np.broadcast_to(np.asarray(c), gv.shape))


def test_ste_gradient_bf16_master_weights():
    w = weights(4, dtype=jnp.bfloat16)
    c = jnp.asarray(np.random.default_rng(5).standard_normal(w.shape), jnp.bfloat16)
    g = jax.grad(lambda w: jnp.sum((fake_quant(w) * c).astype(jnp.float32)))(w)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))


def test_activation_fake_quant():
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((2, 3, 96)) * 10, jnp.float32)
    got = mx_fake_quant_activations(x)
    want = dequantize(*quantize(x, "e4m3", rule="rceil"), "e4m3")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(x))
    g = jax.grad(lambda x: jnp.sum(mx_fake_quant_activations(x) ** 2 / 2))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(got))  # d/dx fq(x)^2/2 = fq(x) * 1


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rule", RULES)
def test_requantising_dequantised_weights_gives_identical_bytes(fmt, rule):
    """Export after QAT: unchanged weights round-trip to the identical bytes.

    Holds exactly for floor and even. For rceil, a block whose max element lands on
    max_elem / 2 (3 for e2m1) is re-encoded one scale step finer with all codes
    doubled: the same values, different bytes. The second round trip is stable.
    """
    w = weights(7, (16, 256))
    codes, scale = quantize(w, fmt, rule=rule)
    w1 = dequantize(codes, scale, fmt)
    codes2, scale2 = quantize(w1, fmt, rule=rule)
    np.testing.assert_array_equal(np.asarray(dequantize(codes2, scale2, fmt)), np.asarray(w1))
    np.testing.assert_array_equal(np.asarray(fake_quant(w1, fmt, rule)), np.asarray(w1))
    c1, s1, c2, s2 = (np.asarray(a) for a in (codes, scale, codes2, scale2))
    if rule != "rceil":
        np.testing.assert_array_equal(c2, c1)
        np.testing.assert_array_equal(s2, s1)
        return
    bmax = np.abs(np.asarray(w1, np.float64)).reshape(16, 8, 32).max(-1)
    half = bmax == HALF_MAX[fmt] * np.exp2(s1.astype(np.float64) - 127)
    assert half.any() and not half.all()  # the exception is exercised
    np.testing.assert_array_equal(s2[~half], s1[~half])
    np.testing.assert_array_equal(s2[half], s1[half] - 1)
    same = np.repeat(~half, 32, axis=-1)
    np.testing.assert_array_equal(c2[same], c1[same])
    codes3, scale3 = quantize(dequantize(codes2, scale2, fmt), fmt, rule=rule)
    np.testing.assert_array_equal(np.asarray(codes3), c2)
    np.testing.assert_array_equal(np.asarray(scale3), s2)


@pytest.mark.parametrize("rule", RULES)
def test_export_bytes_are_what_the_forward_saw(rule):
    w = weights(8, (2, 8, 128))
    packed, scale = mxfp4_quantize_packed(w, rule)
    np.testing.assert_array_equal(
        np.asarray(mxfp4_dequantize_packed(packed, scale, jnp.float32)), np.asarray(fake_quant(w, "e2m1", rule))
    )


def test_errors():
    with pytest.raises(TypeError, match="floating"):
        fake_quant(jnp.zeros((2, 32), jnp.int32))
    with pytest.raises(ValueError, match="multiple of block"):
        fake_quant(jnp.zeros((2, 48)))
    with pytest.raises(ValueError, match="unknown MX scale rule"):
        fake_quant(jnp.zeros((2, 32)), rule="nearest")
