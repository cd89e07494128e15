"""MXFP4 grouped-matmul Pallas kernel in interpret mode (CPU) vs the XLA op and float64.

Covers: experts with zero tokens (first, middle, last), one expert with all tokens, M not a
multiple of the row block (tiles that straddle group boundaries), rows outside every group
(zero, as `ragged_dot`), bf16 and f32 activations, the fused gate/up launch, special scale
bytes (0x00 → exact tiny products, 0xFF → NaN, mx_formats.md §5) and `routed_experts(kernels=)`.
The kernel multiplies exact E2M1 values and applies each block's power-of-two scale to the
fp32 partial product, so it agrees with dequantise-then-matmul to the accumulation order
(f32: ~1e-7; bf16: one output ulp), except where the dequantised weight would be an f32
subnormal (flushed by XLA, kept by the kernel: checked against float64).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mx

from k31jax.kernels.mxfp4_matmul import block_rows, grouped_matmul_gate_up
from k31jax.kernels.mxfp4_matmul.pallas_mxfp4_gmm import e2m1_values
from k31jax.ops import _moe
from k31jax.ops._moe import MXFP4Weight

E, N, K = 5, 32, 64
E2M1 = mx.E2M1


def weight(rng, e=E, n=N, k=K, lo=118, hi=136):
    packed = rng.integers(0, 256, (e, n, k // 2)).astype(np.uint8)
    scale = rng.integers(lo, hi, (e, n, k // 32)).astype(np.uint8)
    return MXFP4Weight(jnp.asarray(packed), jnp.asarray(scale))


def f64_weight(w):
    return mx.f64_weight(w.packed, w.scale)


def f64_gmm(x, w, sizes):
    return mx.f64_gmm(x, w.packed, w.scale, sizes)


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


_kernel = jax.jit(_moe.grouped_matmul, static_argnames=("impl",))  # the op, through its seam
_xla = jax.jit(_moe.grouped_matmul)
CASES = {"mixed": [0, 10, 0, 20, 7], "one_expert": [0, 0, 37, 0, 0]}  # M = 37, BM = 16


@pytest.mark.parametrize("case,dtype", [("mixed", "float32"), ("one_expert", "bfloat16")])
def test_grouped_matmul(case, dtype):
    rng = np.random.default_rng(len(case))
    sizes = CASES[case]
    assert block_rows(sum(sizes), E) == 16
    w = weight(rng)
    x = jnp.asarray(rng.standard_normal((sum(sizes), K)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    y = _kernel(x, w, gs, impl="interpret")
    assert y.dtype == x.dtype
    y_x = _xla(x, w, gs)
    tol = 1e-6 if dtype == "float32" else 1e-2
    assert rel(y, y_x) < tol and rel(y, f64_gmm(x, w, sizes)) < max(tol, 1e-6)


def test_gate_up_fused_bf16_rows_outside_groups():
    """One launch for gate and up; 7 trailing rows belong to no group and stay 0."""
    rng = np.random.default_rng(7)
    sizes = [12, 0, 0, 18, 0]
    w_g, w_u = weight(rng), weight(rng)
    x = jnp.asarray(rng.standard_normal((37, K)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    g, u = jax.jit(lambda *a: grouped_matmul_gate_up(*a, impl="interpret"))(x, w_g, w_u, gs)
    for y, w in ((g, w_g), (u, w_u)):
        y = np.asarray(y, np.float32)
        assert (y[30:] == 0).all()
        assert rel(y[:30], _xla(x, w, gs)[:30]) < 1e-2
        assert rel(y[:30], f64_gmm(x[:30], w, sizes)) < 1e-2


def test_e2m1_values_all_codes():
    codes = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)
    got = np.asarray(e2m1_values(codes & 0xF, jnp.float32))
    np.testing.assert_array_equal(got, np.tile(E2M1, 16).astype(np.float32))
    np.testing.assert_array_equal(np.signbit(got), np.signbit(np.tile(E2M1, 16)))


def test_special_scale_bytes():
    """Scale 0xFF makes its block NaN (mx_formats.md §5) in that expert's rows only; scale 0x00
    (2^-127) gives the exact products (the XLA path flushes its f32-subnormal weights).

    XLA:CPU's `ragged_dot` multiplies every group's weights by every row and masks, so a NaN
    block leaks into other experts' rows there; the kernel reads only each row's own expert,
    so NaN placement is checked against the spec, the 2^-127 block against float64, and the
    rest against XLA.
    """
    rng = np.random.default_rng(9)
    w = weight(rng, e=2, n=16, k=32)
    scale = np.asarray(w.scale).copy()
    scale[0, 1, 0] = 0xFF  # expert 0, output 1: NaN
    scale[1, 0, 0] = 0x00  # expert 1, output 0: 2^-127
    w = MXFP4Weight(w.packed, jnp.asarray(scale))
    x = rng.standard_normal((20, 32))
    x[10:] *= 1e30  # expert 1's rows: its 2^-127 weights give normal products
    x = jnp.asarray(x, jnp.float32)
    gs = jnp.asarray([10, 10], jnp.int32)
    y = np.asarray(_kernel(x, w, gs, impl="interpret"))
    want_nan = np.zeros_like(y, bool)
    want_nan[:10, 1] = True
    np.testing.assert_array_equal(np.isnan(y), want_nan)
    y_64 = f64_gmm(x, w, [10, 10])
    assert rel(y[10:, 0], y_64[10:, 0]) < 1e-6
    y_x = np.asarray(_xla(x, w, gs))
    fin = np.isfinite(y_x)  # excludes XLA's leaked NaN column in expert 1's rows
    fin[10:, 0] = False
    assert fin.sum() == 20 * 16 - 30  # 10 NaN + 10 leaked NaN + 10 subnormal-scale entries
    for rows in (slice(0, 10), slice(10, 20)):  # accumulation order only: norm-relative
        assert rel(y[rows][fin[rows]], y_x[rows][fin[rows]]) < 1e-6


def test_routed_experts_seam_mxfp4():
    """`routed_experts(kernels="interpret")` (fused gate/up + down kernels) == the ragged XLA path."""
    rng = np.random.default_rng(11)
    n_tok, top, d, f = 9, 2, 32, 32
    idx = np.stack([rng.choice(6, top, replace=False) for _ in range(n_tok)]).astype(np.int32)
    idx[:, 0] = np.where(np.arange(n_tok) < 6, 1, idx[:, 0])  # expert 1 crowded, others sparse
    idx[:, 1] = np.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % 6, idx[:, 1])
    wts = jnp.asarray(rng.random((n_tok, top)), jnp.float32)
    ws = (weight(rng, 6, f, d), weight(rng, 6, f, d), weight(rng, 6, d, f))
    x = jnp.asarray(rng.standard_normal((n_tok, d)) * 0.3, jnp.bfloat16)
    run = jax.jit(_moe.routed_experts, static_argnames=("form", "kernels"))
    y = run(x, jnp.asarray(idx), wts, *ws, kernels="interpret")
    y_x = run(x, jnp.asarray(idx), wts, *ws, form="ragged")
    assert rel(y, y_x) < 2e-2
