"""MX element/scale encodings, quantisation rules and dequantisation (mx_formats.md §1-§2, §5, §7).

The references below are float64 NumPy transcriptions of the spec, written
independently of k31jax.quant (no integer-bit tricks): ``frexp`` for floor, the
smallest ``e`` with ``amax <= max_elem * 2**e`` for rceil, a rounded mantissa for
even, and ml_dtypes' RNE casts for the elements.
"""

import math
import zlib

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k31jax.quant import (
    compute_scales,
    decode_elements,
    dequantize,
    quantize,
    quantize_with_scales,
)

FMTS = ("e2m1", "e4m3", "e5m2")
RULES = ("floor", "rceil", "even")
# name -> (emax_elem, max_elem, mantissa bits, ml_dtypes element type)
SPEC = {
    "e2m1": (2, 6.0, 1, ml_dtypes.float4_e2m1fn),
    "e4m3": (8, 448.0, 3, ml_dtypes.float8_e4m3fn),
    "e5m2": (15, 57344.0, 2, ml_dtypes.float8_e5m2),
}
E2M1_TABLE = {
    0x0: 0.0, 0x1: 0.5, 0x2: 1.0, 0x3: 1.5, 0x4: 2.0, 0x5: 3.0, 0x6: 4.0, 0x7: 6.0,
    0x8: -0.0, 0x9: -0.5, 0xA: -1.0, 0xB: -1.5, 0xC: -2.0, 0xD: -3.0, 0xE: -4.0, 0xF: -6.0,
}
MIN_NORMAL = 2.0**-126


# ----------------------------------------------------------------------------
# float64 references (from the spec)
# ----------------------------------------------------------------------------


def ref_shared_exp(amax: float, fmt: str, rule: str):
    """Shared exponent e (clamped to [-127, 127]); None for a NaN/Inf block."""
    emax, maxv, mbits, _ = SPEC[fmt]
    if not math.isfinite(amax):
        return None
    if amax == 0.0:
        return -127
    if rule == "floor":
        _, ex = np.frexp(amax)  # amax = m * 2**ex, m in [0.5, 1)
        e = (int(ex) - 1) - emax
    elif rule == "rceil":  # ceil(log2(amax / max)): smallest e with amax <= max * 2**e
        e = int(np.ceil(np.log2(amax / maxv)))
        while np.ldexp(maxv, e) < amax:
            e += 1
        while np.ldexp(maxv, e - 1) >= amax:
            e -= 1
    elif rule == "even":  # round amax to `mbits` mantissa bits (ties up), then floor
        m, ex = np.frexp(amax)
        r = np.floor(m * 2.0 ** (mbits + 1) + 0.5) / 2.0 ** (mbits + 1)  # in [0.5, 1]
        e = (int(ex) - 1 + (1 if r >= 1.0 else 0)) - emax
    else:
        raise AssertionError(rule)
    return int(np.clip(e, -127, 127))


def ref_encode(scaled: np.ndarray, fmt: str) -> np.ndarray:
    """Clamp to +-max, then ml_dtypes' RNE cast; uint8 codes (fp4: low nibble)."""
    _, maxv, _, mldt = SPEC[fmt]
    return np.clip(scaled, -maxv, maxv).astype(mldt).view(np.uint8)


def ref_quantize(x: np.ndarray, fmt: str, rule: str, axis: int = -1, block: int = 32):
    """Returns (codes, scale bytes, nonfinite-block mask) in x's layout."""
    x64 = np.moveaxis(x.astype(np.float64), axis, -1)
    xb = x64.reshape(*x64.shape[:-1], -1, block)
    amax = np.max(np.abs(xb), axis=-1)
    exps = np.vectorize(lambda a: ref_shared_exp(float(a), fmt, rule), otypes=[object])(amax)
    bad = np.vectorize(lambda e: e is None, otypes=[bool])(exps)
    e = np.where(bad, 0, exps).astype(np.int64)
    scale = np.where(bad, 255, e + 127).astype(np.uint8)
    with np.errstate(invalid="ignore"):
        codes = ref_encode(xb / np.exp2(e)[..., None], fmt)
    codes = np.moveaxis(codes.reshape(x64.shape), -1, axis)
    return codes, np.moveaxis(scale, -1, axis), np.moveaxis(bad, -1, axis)


def elem_table(fmt: str) -> np.ndarray:
    """float64 value of every code (16 for e2m1, 256 for fp8)."""
    if fmt == "e2m1":
        return np.array([E2M1_TABLE[c] for c in range(16)], np.float64)
    return np.arange(256, dtype=np.uint8).view(SPEC[fmt][3]).astype(np.float64)


def mx_data(rng, shape, axis=-1, block=32, tiny=True) -> np.ndarray:
    """Awkward f32 data: per-block exponents from 2**-125 to 2**125, RNE ties,
    values just below powers of two, zero blocks and zero elements. f32 subnormals
    are flushed (quantisation treats them as zero, see k31jax.quant._mx)."""
    x = np.moveaxis(np.empty(shape, np.float32), axis, -1)
    nb = x.size // block
    kinds = rng.integers(0, 5, nb)
    lo = -125 if tiny else -100
    k = rng.integers(lo, 120, nb).astype(np.float64)
    kinds[-1], k[-1] = 0, 118  # always cover the huge-scale range
    out = np.empty((nb, block), np.float64)
    for i in range(nb):
        if kinds[i] == 0:  # gaussian
            v = rng.standard_normal(block)
        elif kinds[i] == 1:  # few-bit mantissas: exact ties for every element format
            v = rng.integers(-64, 65, block) / 8.0
        elif kinds[i] == 2:  # dyadic values near the top of a binade
            v = rng.choice([1.0, -1.0], block) * (2.0 - 2.0 ** -rng.integers(1, 24, block))
            v *= np.exp2(rng.integers(-12, 2, block))
        elif kinds[i] == 3:  # heavy dynamic range within a block
            v = rng.standard_normal(block) * np.exp2(rng.integers(-30, 1, block))
        else:  # zero block or sparse block
            v = np.zeros(block)
            if rng.random() < 0.5:
                v[rng.integers(0, block, 3)] = rng.standard_normal(3)
        out[i] = v * 2.0 ** k[i]
    if tiny:  # make sure the subnormal-scale range (bytes 0..2 for e2m1) is hit
        out[: max(1, nb // 8)] = rng.standard_normal((max(1, nb // 8), block)) * 2.0**-124
    out = out.astype(np.float32)
    out[np.abs(out) < MIN_NORMAL] = 0.0
    return np.moveaxis(out.reshape(x.shape), -1, axis)


# ----------------------------------------------------------------------------
# Randomised agreement with the references
# ----------------------------------------------------------------------------

SHAPES = [((3, 5, 64), -1), ((96, 7), 0)]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape,axis", SHAPES)
def test_quantize_matches_reference(fmt, rule, shape, axis):
    rng = np.random.default_rng(zlib.crc32(repr((fmt, rule, shape)).encode()))
    x = mx_data(rng, shape, axis)
    codes, scale = quantize(x, fmt, rule=rule, axis=axis)
    rc, rs, bad = ref_quantize(x, fmt, rule, axis)
    assert codes.dtype == np.uint8 and scale.dtype == np.uint8
    assert codes.shape == x.shape
    np.testing.assert_array_equal(np.asarray(scale), rs)
    np.testing.assert_array_equal(np.asarray(codes), rc)
    np.testing.assert_array_equal(np.asarray(compute_scales(x, fmt, rule=rule, axis=axis)), rs)
    assert not bad.any()
    # Coverage of what the test is meant to exercise.
    assert (rs <= 2).any() and (rs >= 200).any()


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_with_given_scales_matches_ml_dtypes(fmt):
    """Elements for *given* scale bytes (incl. 0x00..0x02 and 0xFE) == ml_dtypes RNE cast."""
    rng = np.random.default_rng(7)
    _, maxv, _, _ = SPEC[fmt]
    b = rng.integers(0, 255, (40, 3)).astype(np.uint8)
    b[0] = [0, 1, 2]
    b[1] = [254, 253, 127]
    # Values around max * scale so that every part of the grid and the clamp is hit.
    v = rng.uniform(-1.3, 1.3, (40, 3, 32)) * maxv
    v[:, :, :8] = rng.integers(-64, 65, (40, 3, 8)) * (maxv / 64)  # ties
    f32max = float(np.finfo(np.float32).max)
    x = np.clip(v * np.exp2(b.astype(np.float64) - 127)[..., None], -f32max, f32max).astype(np.float32)
    x[np.abs(x) < MIN_NORMAL] = 0.0
    x = x.reshape(40, 96)
    codes = quantize_with_scales(x, b, fmt)
    want = ref_encode(x.reshape(40, 3, 32).astype(np.float64) / np.exp2(b.astype(np.float64) - 127)[..., None], fmt)
    np.testing.assert_array_equal(np.asarray(codes), want.reshape(40, 96))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rule", RULES)
def test_scale_rules_at_boundaries(fmt, rule):
    """compute_scales vs ref_shared_exp at powers of two, max*2**k, M/2*2**k, 1.75*2**k, +-1 ulp."""
    _, maxv, mbits, _ = SPEC[fmt]
    bases = [1.0, maxv, maxv / 2, 1.5, 1.75, 2 - 2.0 ** -(mbits + 1), 1 + 2.0**-mbits]
    amaxes = []
    for k in range(-126, 127, 3):
        for base in bases:
            a = np.float32(np.ldexp(base, k - int(np.floor(np.log2(base)))))
            if np.isfinite(a) and a >= MIN_NORMAL:
                amaxes += [a, np.nextafter(a, np.float32(np.inf)), np.nextafter(a, np.float32(0))]
    amaxes += [np.finfo(np.float32).max, np.float32(MIN_NORMAL), np.float32(0)]
    amax = np.array(amaxes, np.float32)
    rng = np.random.default_rng(1)
    x = (rng.uniform(-1, 1, (amax.size, 32)) * amax[:, None]).astype(np.float32)
    x[:, 5] = amax * np.where(rng.random(amax.size) < 0.5, -1, 1)
    x[np.abs(x) < MIN_NORMAL] = 0.0
    got = np.asarray(compute_scales(x, fmt, rule=rule))[:, 0]
    want = np.array([ref_shared_exp(float(a), fmt, rule) + 127 for a in amax], np.uint8)
    np.testing.assert_array_equal(got, want)


def test_bf16_input_matches_f32():
    rng = np.random.default_rng(3)
    x = mx_data(rng, (4, 64), tiny=False)
    xb = jnp.asarray(x, jnp.bfloat16)
    for fmt in FMTS:
        a = quantize(xb, fmt)
        b = quantize(np.asarray(xb.astype(jnp.float32)), fmt)
        np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
        np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


# ----------------------------------------------------------------------------
# Hand-written edge cases (expected bytes written out)
# ----------------------------------------------------------------------------


def _block(*vals, fill=0.0):
    x = np.full(32, fill, np.float32)
    x[: len(vals)] = vals
    return x


def _q(x, fmt, rule="floor"):
    c, s = quantize(np.asarray(x, np.float32), fmt, rule=rule)
    return np.asarray(c).tolist(), np.asarray(s).tolist()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rule", RULES)
def test_zero_block(fmt, rule):
    codes, scale = _q(np.zeros(32), fmt, rule)
    assert scale == [0x00] and codes == [0] * 32
    neg_zero = 0x8 if fmt == "e2m1" else 0x80
    codes, scale = _q(-np.zeros(32), fmt, rule)
    assert scale == [0x00] and codes == [neg_zero] * 32
    out = np.asarray(dequantize(np.zeros(32, np.uint8), np.zeros(1, np.uint8), fmt))
    assert (out == 0).all()


def test_rne_decision_points_e2m1():
    pts = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = _block(*pts, *[-p for p in pts], 4.0)
    codes, scale = _q(x, "e2m1")
    assert scale == [0x7F]  # amax 5 -> floor(log2 5) - 2 = 0
    assert codes[:15] == [0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6,
                          0x8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE, 0x6]
    # Same points at a block scale of 2**-3.
    codes, scale = _q(x * 2.0**-3, "e2m1")
    assert scale == [0x7C] and codes[:15] == [0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6,
                                              0x8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE, 0x6]


def test_rne_ties_fp8():
    # e4m3, amax 256 -> e = 0: 1.0625 ties to 1.0 (0x38), 1.1875 ties to 1.25 (0x3A).
    codes, scale = _q(_block(256.0, 1.0625, 1.1875, -1.0625), "e4m3")
    assert scale == [0x7F] and codes[:4] == [0x78, 0x38, 0x3A, 0xB8]
    # e5m2, amax 32768 -> e = 0: 1.125 ties to 1.0 (0x3C), 1.375 ties to 1.5 (0x3E).
    codes, scale = _q(_block(32768.0, 1.125, 1.375), "e5m2")
    assert scale == [0x7F] and codes[:3] == [0x78, 0x3C, 0x3E]


def test_block_max_power_of_two():
    x = _block(4.0, 1.0, 0.5, -2.0)
    for rule in RULES:  # floor: 2-2=0; rceil: ceil(log2(4/6))=0; even: 0
        assert _q(x, "e2m1", rule) == ([0x6, 0x2, 0x1, 0xC] + [0] * 28, [0x7F])
    x = _block(8.0, 1.0)
    for rule in RULES:  # floor: 3-2=1; rceil: ceil(log2(8/6))=1; even: 1
        assert _q(x, "e2m1", rule) == ([0x6, 0x1] + [0] * 30, [0x80])
    for rule in RULES:  # e4m3, amax 1: floor 0-8; rceil ceil(log2(1/448)) = -8
        assert _q(_block(1.0, 0.5), "e4m3", rule) == ([0x78, 0x70] + [0] * 30, [0x77])
    # amax exactly max_elem: all rules keep e = 0 for e2m1 (6 = 1.5 * 2**2).
    for rule in RULES:
        assert _q(_block(6.0, -3.0), "e2m1", rule) == ([0x7, 0xD] + [0] * 30, [0x7F])
    # One ulp above 6: rceil moves to e = 1 (6.0000005 / 2 -> 3 = 0x5); floor/even clip to 6.
    up = float(np.nextafter(np.float32(6), np.float32(7)))
    assert _q(_block(up), "e2m1", "rceil") == ([0x5] + [0] * 31, [0x80])
    assert _q(_block(up), "e2m1", "floor") == ([0x7] + [0] * 31, [0x7F])
    assert _q(_block(up), "e2m1", "even") == ([0x7] + [0] * 31, [0x7F])


def test_values_beyond_max_are_clamped_before_the_cast():
    below8 = float(np.nextafter(np.float32(8), np.float32(0)))
    x = _block(7.5, -below8, 1.0)
    assert _q(x, "e2m1", "floor") == ([0x7, 0xF, 0x2] + [0] * 29, [0x7F])
    assert _q(x, "e2m1", "rceil") == ([0x6, 0xE, 0x1] + [0] * 29, [0x80])
    assert _q(x, "e2m1", "even") == ([0x6, 0xE, 0x1] + [0] * 29, [0x80])
    # e4m3 has no saturation in the cast (500 -> NaN): the clamp must give 448 = 0x7E.
    assert _q(_block(500.0, 460.0, -449.0), "e4m3") == ([0x7E, 0x7E, 0xFE] + [0] * 29, [0x7F])
    # e5m2 would overflow to Inf (0x7C): clamp to 57344 = 0x7B.
    assert _q(_block(60000.0, 61440.0, -65000.0), "e5m2") == ([0x7B, 0x7B, 0xFB] + [0] * 29, [0x7F])


def test_subnormal_range_scales():
    x = np.concatenate([
        _block(2.0**-125, 1.5 * 2.0**-126, -(2.0**-126)),  # e = -127 -> byte 0x00
        _block(2.0**-124, 2.0**-126),                     # e = -126 -> byte 0x01
        _block(2.0**-123, 2.0**-126),                     # e = -125 -> byte 0x02
        _block(2.0**-126),                                # e = -128 clamps to -127
    ])
    codes, scale = quantize(x, "e2m1")
    assert np.asarray(scale).tolist() == [0x00, 0x01, 0x02, 0x00]
    c = np.asarray(codes).reshape(4, 32)[:, :3].tolist()
    assert c == [[0x6, 0x5, 0xC], [0x6, 0x2, 0x0], [0x6, 0x1, 0x0], [0x4, 0x0, 0x0]]
    # All of these products are normal f32: dequantisation is exact.
    np.testing.assert_array_equal(np.asarray(dequantize(codes, scale, "e2m1")), x)
    # e4m3: amax 2**-120 -> e = -128 -> clamp -127; scaled 2**7 -> 0x70.
    codes, scale = quantize(_block(2.0**-120, 2.0**-126), "e4m3")
    assert np.asarray(scale).tolist() == [0x00]
    assert np.asarray(codes)[:2].tolist() == [0x70, 0x40]  # 128 and 2.0


@pytest.mark.parametrize("fmt", FMTS)
def test_nan_and_inf_blocks(fmt):
    x = np.concatenate([
        _block(1.0, np.nan),
        _block(1.0, 2.0),
        _block(np.inf, 1.0),
        _block(-np.inf),
    ])
    # amax 2 -> e = 1 - emax under every rule: e2m1 -1, e4m3 -7, e5m2 -14.
    finite_byte = {"e2m1": 0x7E, "e4m3": 0x78, "e5m2": 0x71}[fmt]
    for rule in RULES:
        codes, scale = quantize(x, fmt, rule=rule)
        assert np.asarray(scale).tolist() == [0xFF, finite_byte, 0xFF, 0xFF]
        out = np.asarray(dequantize(codes, scale, fmt)).reshape(4, 32)
        assert np.isnan(out[[0, 2, 3]]).all()
        np.testing.assert_array_equal(out[1], x[32:64])


# ----------------------------------------------------------------------------
# Dequantisation
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
def test_decode_every_code_times_every_scale_byte(fmt):
    """All codes x all 256 scale bytes under jit vs a float64 table.

    Documented behaviour: exact wherever the product is 0 or a normal f32 (bytes
    0..2 included), +-Inf above the f32 range, NaN for byte 0xFF (and for fp8 NaN
    codes), and +-0 (XLA flush-to-zero) or the exact value for f32-subnormal
    products.
    """
    table = elem_table(fmt)
    n = table.size
    codes = np.tile(np.arange(n, dtype=np.uint8), (256, 32 // n if n < 32 else 1))
    codes = codes.reshape(256, -1)
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], codes.shape[1] // 32, axis=1)
    got = np.asarray(jax.jit(lambda c, s: dequantize(c, s, fmt))(codes, scales)).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        exact = table[codes] * np.exp2(np.arange(256, dtype=np.float64) - 127)[:, None]
        want = exact.astype(np.float32).astype(np.float64)
    want[255] = np.nan
    subnormal = (np.abs(exact) < MIN_NORMAL) & (exact != 0)
    normal = ~subnormal
    np.testing.assert_array_equal(got[normal], want[normal])  # NaN == NaN here
    assert np.all((got[subnormal] == 0) | (got[subnormal] == exact[subnormal]))
    assert np.all(np.signbit(got[subnormal]) == np.signbit(exact[subnormal]))
    # Spot checks written out.
    if fmt == "e2m1":  # the only flushed e2m1 products: |code| 0.5/1/1.5 at byte 0, 0.5 at byte 1
        flushed = {(int(b), int(codes[b, j])) for b, j in zip(*np.nonzero(subnormal))}
        assert flushed == {(0, 1), (0, 2), (0, 3), (0, 9), (0, 10), (0, 11), (1, 1), (1, 9)}
        assert got[0, 6] == 2.0**-125 and got[0, 4] == 2.0**-126 and got[0, 7] == 1.5 * 2.0**-125
        assert got[1, 1] in (0.0, 2.0**-127) and got[2, 1] == 2.0**-126
        assert got[254, 3] == 1.5 * 2.0**127 and got[254, 4] == np.inf and got[254, 12] == -np.inf
        assert np.isnan(got[255]).all()
    # bf16 output: same values (every MX element fits bf16's mantissa).
    got16 = np.asarray(dequantize(codes, scales, fmt, dtype=jnp.bfloat16)).astype(np.float64)
    np.testing.assert_array_equal(got16[normal], want[normal])


def test_dequantize_accepts_element_and_e8m0_dtypes():
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 256, (4, 64), dtype=np.uint8)
    codes = np.where(np.isfinite(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)), codes, 0).astype(np.uint8)
    scale = rng.integers(100, 150, (4, 2), dtype=np.uint8)
    a = dequantize(codes, scale, "e4m3")
    b = dequantize(jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale.view(ml_dtypes.float8_e8m0fnu)), "e4m3")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c4 = (codes & 0xF).astype(np.uint8)
    np.testing.assert_array_equal(
        np.asarray(dequantize(c4, scale, "e2m1")),
        np.asarray(dequantize(jnp.asarray(c4.view(ml_dtypes.float4_e2m1fn)), scale, "e2m1")),
    )
    np.testing.assert_array_equal(np.asarray(decode_elements(c4, "e2m1")), elem_table("e2m1")[c4])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rule", RULES)
def test_decode_encode_roundtrip_for_representable_values(fmt, rule):
    rng = np.random.default_rng(11)
    table = elem_table(fmt)
    finite = np.flatnonzero(np.isfinite(table))
    codes = rng.choice(finite, (6, 128)).astype(np.uint8)
    # Bytes for which every product is a normal, finite f32.
    scale = rng.integers(20, 236, (6, 4)).astype(np.uint8)
    scale[0] = [20, 21, 234, 235]
    x = np.asarray(dequantize(codes, scale, fmt))
    assert np.isfinite(x).all()
    want = expected_requant(x, fmt, rule)
    c2, s2 = quantize(x, fmt, rule=rule)
    np.testing.assert_array_equal(np.asarray(dequantize(c2, s2, fmt)), want)
    # Along another axis too.
    c3, s3 = quantize(x.T, fmt, rule=rule, axis=0)
    np.testing.assert_array_equal(np.asarray(dequantize(c3, s3, fmt, axis=0)), want.T)
    if fmt == "e4m3" and rule != "rceil":
        assert (want != x).any()  # the exception below is exercised


def expected_requant(x: np.ndarray, fmt: str, rule: str) -> np.ndarray:
    """dequantize(quantize(x)) for MX-representable x.

    Identity, except for e4m3 under floor/even: the top e4m3 binade has no
    mantissa 1.875 (S.1111.111 is NaN), so an element equal to 1.875 * 2**E,
    where 2**E is the block max's binade, scales to 480 and clamps to 448:
    it comes back as 1.75 * 2**E.
    """
    if fmt != "e4m3" or rule == "rceil":
        return x
    xb = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    _, ex = np.frexp(np.max(np.abs(xb), axis=-1, keepdims=True))
    top = np.ldexp(1.875, ex - 1)
    out = np.where(np.abs(xb) == top, np.sign(xb) * np.ldexp(1.75, ex - 1), xb)
    return out.reshape(x.shape).astype(np.float32)


def test_e4m3_floor_clips_top_mantissa_but_rceil_does_not():
    x = _block(1.875, 1.0, -1.875)
    # floor: e = 0 - 8 -> 1.875 * 256 = 480 -> clamp 448 (0x7E); 1.0 -> 256 (0x78).
    assert _q(x, "e4m3", "floor") == ([0x7E, 0x78, 0xFE] + [0] * 29, [0x77])
    assert _q(x, "e4m3", "even") == ([0x7E, 0x78, 0xFE] + [0] * 29, [0x77])
    # rceil: e = ceil(log2(1.875 / 448)) = -7 -> 240 (0x77), 128 (0x70).
    assert _q(x, "e4m3", "rceil") == ([0x77, 0x70, 0xF7] + [0] * 29, [0x78])


def test_composes_with_jit_and_vmap():
    rng = np.random.default_rng(12)
    x = mx_data(rng, (3, 4, 64), tiny=False)
    f = jax.jit(jax.vmap(lambda v: dequantize(*quantize(v, "e4m3", rule="rceil"), "e4m3")))
    np.testing.assert_array_equal(
        np.asarray(f(x)), np.asarray(dequantize(*quantize(x, "e4m3", rule="rceil"), "e4m3"))
    )


def test_non_last_axis_matches_transposed_last_axis():
    rng = np.random.default_rng(2)
    x = mx_data(rng, (64, 3, 5), axis=0, tiny=False)
    c0, s0 = quantize(x, "e2m1", axis=0)
    c1, s1 = quantize(np.moveaxis(x, 0, -1), "e2m1")
    np.testing.assert_array_equal(np.moveaxis(np.asarray(c0), 0, -1), np.asarray(c1))
    np.testing.assert_array_equal(np.moveaxis(np.asarray(s0), 0, -1), np.asarray(s1))
    assert s0.shape == (2, 3, 5)


# ----------------------------------------------------------------------------
# Property test: error <= half an E2M1 step times the block scale
# ----------------------------------------------------------------------------

# |x| <= 2**126: nearer to the f32 max, rceil/even may round a block max up to
# 4 * 2**126 = 2**128, which dequantises to Inf in f32 (documented overflow).
_F32 = st.floats(-(2.0**126), 2.0**126, width=32, allow_subnormal=False)
_BLOCK_EXP = st.integers(-125, 100)


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(
    mant=hnp.arrays(np.float32, (2, 32), elements=st.floats(-8, 8, width=32, allow_subnormal=False)),
    raw=hnp.arrays(np.float32, (1, 32), elements=_F32),
    exps=st.tuples(_BLOCK_EXP, _BLOCK_EXP),
    rule=st.sampled_from(RULES),
)
def test_e2m1_error_within_half_step(mant, raw, exps, rule):
    x = np.concatenate([mant[:1] * np.float32(2.0 ** exps[0]), mant[1:] * np.float32(2.0 ** exps[1]), raw])
    x = x.reshape(3, 32)
    x[np.abs(x) < MIN_NORMAL] = 0.0
    codes, scale = quantize(x, "e2m1", rule=rule)
    xq = np.asarray(dequantize(codes, scale, "e2m1")).astype(np.float64)
    s = np.exp2(np.asarray(scale).astype(np.float64) - 127)  # [3, 1]
    a = np.abs(x.astype(np.float64)) / s
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    err = np.abs(xq - x)
    inside = a <= 6
    assert np.all(err[inside] <= 0.5 * (step * s)[inside])
    assert np.all(np.abs(xq[~inside]) == (6 * s * np.ones_like(a))[~inside])  # clipped (floor/even)
    if rule == "rceil":
        assert inside.all()


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------


def test_errors_are_descriptive():
    x = np.zeros((4, 48), np.float32)
    with pytest.raises(ValueError, match="multiple of block=32"):
        quantize(x, "e2m1")
    with pytest.raises(ValueError, match="unknown MX element format"):
        quantize(np.zeros(32, np.float32), "e3m2")
    with pytest.raises(ValueError, match="unknown MX scale rule"):
        quantize(np.zeros(32, np.float32), "e2m1", rule="ceil")
    with pytest.raises(ValueError, match="scale shape"):
        dequantize(np.zeros((4, 64), np.uint8), np.zeros((4, 3), np.uint8), "e2m1")
    with pytest.raises(TypeError, match="uint8"):
        dequantize(np.zeros((4, 64), np.int32), np.zeros((4, 2), np.uint8), "e4m3")
