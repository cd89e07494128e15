"""KDA Pallas kernels in interpret mode (CPU) vs the XLA ops and the float64 reference.

Covers the chunked forward (T not a multiple of the chunk, a head width padded to 16, a
non-zero initial state) for both gates — the lower-bounded one (factored diagonal sub-chunk
tiles) and the softplus one with channels at g = −30 (explicit diagonal tiles) — fp32 and bf16
inputs, the fused decode step (T = 1, and T = 3 scanned), and the op seam
(`ops.kda_chunked(impl=...)`). Tolerances as kda.md §5: fp32 outputs within 1e-5 of the
reference on the max(1, |ref|) scale; bf16 inputs compare against the same rounded inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax.kernels.kda_chunk import factor_diagonal, kda_chunked, kda_recurrent
from k31jax.ops import _kda
import refs as R


B, T, H, DK, DV, CHUNK = 1, 37, 2, 16, 8, 32  # T % CHUNK != 0; DV padded to 16 in-kernel


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all()
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0))


def f64_ref(q, k, v, g, beta, s0):
    outs = [R.kda_recurrent(*(np.asarray(a, np.float64)[b] for a in (q, k, v, g, beta, s0)))
            for b in range(q.shape[0])]
    return np.stack([o for o, _ in outs]), np.stack([s for _, s in outs])


def inputs(seed, gate, t=T):
    rng = np.random.default_rng(seed)
    q = R.l2_normalize(rng.standard_normal((B, t, H, DK))) * DK ** -0.5
    k = R.l2_normalize(rng.standard_normal((B, t, H, DK)))
    v = rng.standard_normal((B, t, H, DV))
    z = rng.standard_normal((B, t, H, DK)) * 2.0
    if gate == "lower_bound":
        g = -5.0 * R.sigmoid(z)
        g[:, :, 0, :4] = -4.999  # the bound's worst case: Γ spans ~80 inside a 16-row tile
    else:
        g = -np.exp(rng.uniform(-1, 2, (B, t, H, DK))) * R.softplus_torch(z)
        g[:, :, 1, :3] = -30.0  # Γ reaches −960 over a chunk: factoring e^{−Γ} would overflow
    beta = R.sigmoid(rng.standard_normal((B, t, H)))
    s0 = rng.standard_normal((B, H, DK, DV)) * 0.5
    return [np.asarray(a, np.float32) for a in (q, k, v, g, beta, s0)]


_kernel_chunked = jax.jit(kda_chunked, static_argnames=("chunk_size", "lower_bound", "impl"))
_xla_chunked = jax.jit(_kda.kda_chunked, static_argnames="chunk_size")


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_chunked_kernel_fp32(gate):
    q, k, v, g, beta, s0 = inputs(1, gate)
    lb = -5.0 if gate == "lower_bound" else None
    assert factor_diagonal(lb) == (gate == "lower_bound")
    o, s = _kernel_chunked(q, k, v, g, beta, s0, chunk_size=CHUNK, lower_bound=lb, impl="interpret")
    o_x, s_x = _xla_chunked(q, k, v, g, beta, s0, chunk_size=CHUNK)
    o_64, s_64 = f64_ref(q, k, v, g, beta, s0)
    assert rel_err(o, o_x) < 1e-5 and rel_err(s, s_x) < 1e-5
    assert rel_err(o, o_64) < 1e-5 and rel_err(s, s_64) < 1e-5


def test_chunked_kernel_bf16_inputs_and_seam():
    """bf16 q/k/v/g/β (upcast in both paths), through the op seam `ops.kda_chunked(impl=)`."""
    arrs = inputs(2, "lower_bound")
    q, k, v, g, beta = (jnp.asarray(a, jnp.bfloat16) for a in arrs[:5])
    s0 = arrs[5]
    seam = jax.jit(lambda *a: _kda.kda_chunked(*a, CHUNK, impl="interpret", lower_bound=-5.0))
    o, s = seam(q, k, v, g, beta, s0)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    o_x, s_x = _xla_chunked(q, k, v, g, beta, s0, chunk_size=CHUNK)
    o_64, s_64 = f64_ref(*(np.asarray(a, np.float32) for a in (q, k, v, g, beta)), s0)
    assert rel_err(o, o_x) < 1e-5 and rel_err(s, s_x) < 1e-5
    assert rel_err(o, o_64) < 1e-5 and rel_err(s, s_64) < 1e-5


_kernel_rec = jax.jit(kda_recurrent, static_argnames="impl")


@pytest.mark.parametrize("t", [1, 3])
def test_decode_step_kernel(t):
    q, k, v, g, beta, s0 = inputs(3, "lower_bound", t=t)
    o, s = _kernel_rec(q, k, v, g, beta, s0, impl="interpret")
    o_x, s_x = _kda.kda_recurrent(q, k, v, g, beta, s0)
    o_64, s_64 = f64_ref(q, k, v, g, beta, s0)
    assert rel_err(o, o_x) < 1e-6 and rel_err(s, s_x) < 1e-6
    assert rel_err(o, o_64) < 1e-5 and rel_err(s, s_64) < 1e-5


def test_decode_step_bf16_inputs_no_state():
    arrs = inputs(4, "softplus", t=1)
    q, k, v, g, beta = (jnp.asarray(a, jnp.bfloat16) for a in arrs[:5])
    o, s = _kda.kda_recurrent(q, k, v, g, beta, None, impl="interpret")
    o_x, s_x = _kda.kda_recurrent(q, k, v, g, beta, None)
    assert rel_err(o, o_x) < 1e-6 and rel_err(s, s_x) < 1e-6


def test_auto_impl_is_xla_on_cpu():
    from k31jax.ops import resolve_impl

    assert resolve_impl(None, "kda_chunk") == "xla"  # no GPU here, and no kernel verified on one yet
    with pytest.raises(ValueError):
        resolve_impl("triton", "kda_chunk")
