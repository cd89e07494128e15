"""FP4 packing and the MXFP4 storage layouts (mx_formats.md §3, §7)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k31jax.quant import (
    dequantize,
    e8m0_from_safetensors,
    e8m0_to_safetensors,
    f4_from_safetensors,
    f4_to_safetensors,
    from_compressed_tensors,
    from_gpt_oss,
    interleave_rows,
    mxfp4_block_max_histogram,
    mxfp4_dequantize_packed,
    mxfp4_quantize_packed,
    mxfp4_unpack_to_e4m3,
    pack_fp4,
    quantize,
    split_interleaved_rows,
    stack_experts,
    to_compressed_tensors,
    to_gpt_oss,
    unpack_fp4,
    unstack_experts,
)

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def rand_packed(rng, *lead, n_in=64, scale_lo=100, scale_hi=150):
    packed = rng.integers(0, 256, (*lead, n_in // 2), dtype=np.uint8)
    scale = rng.integers(scale_lo, scale_hi, (*lead, n_in // 32), dtype=np.uint8)
    return packed, scale


def ref_decode_gpt_oss(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers-style gpt-oss decode in float64: LUT on low/high nibbles, interleave, ldexp."""
    lo = E2M1[blocks & 0x0F]
    hi = E2M1[blocks >> 4]
    vals = np.empty((*blocks.shape[:-1], 32))
    vals[..., 0::2] = lo
    vals[..., 1::2] = hi
    vals = np.ldexp(vals, scales.astype(np.int64)[..., None] - 127)
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


# ----------------------------------------------------------------------------
# Nibble order and pack/unpack
# ----------------------------------------------------------------------------


def test_nibble_order():
    b = np.array([0x21], np.uint8)
    assert unpack_fp4(b).tolist() == [0x1, 0x2]
    assert E2M1[unpack_fp4(b)].tolist() == [0.5, 1.0]
    assert pack_fp4(np.array([1, 2], np.uint8)).tolist() == [0x21]
    assert np.asarray(pack_fp4(jnp.array([1, 2], jnp.uint8))).tolist() == [0x21]
    # Same order as jax's u8 -> float4_e2m1fn bitcast: [..., 0] is the low nibble.
    v = jax.lax.bitcast_convert_type(jnp.asarray(b), jnp.float4_e2m1fn).astype(jnp.float32)
    assert np.asarray(v).tolist() == [[0.5, 1.0]]
    # And through the fast dequant path: a block of 16 bytes 0x21 at scale 1.0.
    out = mxfp4_dequantize_packed(np.full((1, 16), 0x21, np.uint8), np.array([[127]], np.uint8), jnp.float32)
    assert np.asarray(out).tolist() == [[0.5, 1.0] * 16]
    out = mxfp4_dequantize_packed(np.full((1, 16), 0xF9, np.uint8), np.array([[126]], np.uint8), jnp.float32)
    assert np.asarray(out).tolist() == [[-0.25, -3.0] * 16]


def test_packed_decode_of_every_byte():
    b = np.arange(256, dtype=np.uint8).reshape(16, 16)  # 16 blocks of 32 elements
    for byte, mult in [(127, 1.0), (0, 2.0**-127), (254, 2.0**127), (130, 8.0)]:
        s = np.full((16, 1), byte, np.uint8)
        got = np.asarray(mxfp4_dequantize_packed(b, s, jnp.float32)).astype(np.float64)
        want = np.stack([E2M1[b & 0xF], E2M1[b >> 4]], -1).reshape(16, 32) * mult
        with np.errstate(over="ignore"):
            want32 = want.astype(np.float32).astype(np.float64)
        tiny = (want != 0) & (np.abs(want) < 2.0**-126)  # flushed f32 subnormals
        np.testing.assert_array_equal(got[~tiny], want32[~tiny])
        assert (got[tiny] == 0).all() or (got[tiny] == want[tiny]).all()


@pytest.mark.parametrize("as_jax", [False, True])
def test_pack_unpack_roundtrip(as_jax):
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 5, 7), dtype=np.uint8)
    codes = rng.integers(0, 16, (3, 5, 14), dtype=np.uint8)
    if as_jax:
        packed, codes = jnp.asarray(packed), jnp.asarray(codes)
    u = unpack_fp4(packed)
    assert u.shape == (3, 5, 14) and isinstance(u, jax.Array) == as_jax
    np.testing.assert_array_equal(np.asarray(pack_fp4(u)), np.asarray(packed))
    np.testing.assert_array_equal(np.asarray(unpack_fp4(pack_fp4(codes))), np.asarray(codes))
    # Explicit element-by-element layout.
    p = np.asarray(packed)
    np.testing.assert_array_equal(np.asarray(u)[..., 0::2], p & 0xF)
    np.testing.assert_array_equal(np.asarray(u)[..., 1::2], p >> 4)


def test_pack_errors():
    with pytest.raises(ValueError, match="odd length"):
        pack_fp4(np.zeros(3, np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        pack_fp4(np.zeros(4, np.int32))


# ----------------------------------------------------------------------------
# Packed fast paths vs the general functions
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["floor", "rceil", "even"])
def test_quantize_packed_equals_quantize_then_pack(rule):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((2, 3, 96)) * np.exp2(rng.integers(-30, 30, (2, 3, 1)))).astype(np.float32)
    w[0, 0, :32] = 0.0
    packed, scale = mxfp4_quantize_packed(w, rule)
    codes, scale2 = quantize(w, "e2m1", rule=rule)
    assert packed.shape == (2, 3, 48) and scale.shape == (2, 3, 3)
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(pack_fp4(codes)))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(scale2))


def test_dequantize_packed_equals_dequantize():
    rng = np.random.default_rng(2)
    packed, scale = rand_packed(rng, 4, 3, n_in=96, scale_lo=0, scale_hi=256)
    scale[0, 0, 0] = 0xFF
    got = np.asarray(jax.jit(lambda p, s: mxfp4_dequantize_packed(p, s, jnp.float32))(packed, scale))
    want = np.asarray(dequantize(unpack_fp4(packed), scale, "e2m1"))
    np.testing.assert_array_equal(got, want)  # NaN-aware, exact
    assert np.isnan(got[0, 0, :32]).all() and not np.isnan(got[0, 0, 32:]).any()
    # bf16 (the model dtype) is exact too: every E2M1 x E8M0 product fits bf16.
    got16 = np.asarray(mxfp4_dequantize_packed(packed, scale)).astype(np.float32)
    np.testing.assert_array_equal(got16, want)


def test_e4m3_operand_times_scale_equals_dequantised_weights():
    rng = np.random.default_rng(3)
    packed, scale = rand_packed(rng, 2, 5, n_in=128, scale_lo=90, scale_hi=160)
    w8 = mxfp4_unpack_to_e4m3(packed)
    assert w8.dtype == jnp.float8_e4m3fn and w8.shape == (2, 5, 128)
    v = np.asarray(w8).astype(np.float64).reshape(2, 5, 4, 32)
    recon = (v * np.exp2(scale.astype(np.float64) - 127)[..., None]).reshape(2, 5, 128)
    np.testing.assert_array_equal(recon, np.asarray(mxfp4_dequantize_packed(packed, scale, jnp.float32)))


def test_block_max_histogram_diagnostic():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((64, 256)) * np.exp2(rng.integers(-8, 8, (64, 1)))).astype(np.float32)
    w[0] = 0.0
    for rule, allowed in [("floor", {0, 6, 7}), ("even", {0, 6, 7}), ("rceil", {0, 5, 6, 7})]:
        hist = np.asarray(mxfp4_block_max_histogram(mxfp4_quantize_packed(w, rule)[0]))
        assert hist.sum() == 64 * 8 and hist[0] == 8
        assert set(np.flatnonzero(hist)) == allowed, (rule, hist)


# ----------------------------------------------------------------------------
# Layout converters
# ----------------------------------------------------------------------------


def test_compressed_tensors_and_stacked_experts_roundtrip():
    rng = np.random.default_rng(5)
    experts = [rand_packed(rng, 6, n_in=64) for _ in range(3)]
    packed, scale = stack_experts(experts)
    assert isinstance(packed, np.ndarray) and packed.shape == (3, 6, 32) and scale.shape == (3, 6, 2)
    for (p, s), (p2, s2) in zip(experts, unstack_experts(packed, scale)):
        assert p2.tobytes() == p.tobytes() and s2.tobytes() == s.tobytes()
    # Mapping form with compressed-tensors names.
    dicts = [to_compressed_tensors(p, s) for p, s in experts]
    assert set(dicts[0]) == {"weight_packed", "weight_scale"}
    p3, s3 = stack_experts(dicts)
    assert p3.tobytes() == packed.tobytes() and s3.tobytes() == scale.tobytes()
    p4, s4 = from_compressed_tensors(*experts[1])
    assert p4.tobytes() == experts[1][0].tobytes() and s4.tobytes() == experts[1][1].tobytes()
    # jax in -> jax out, same bytes.
    pj, sj = stack_experts([(jnp.asarray(p), jnp.asarray(s)) for p, s in experts])
    assert isinstance(pj, jax.Array) and np.asarray(pj).tobytes() == packed.tobytes()
    # Stacked decode == per-expert decode.
    full = np.asarray(mxfp4_dequantize_packed(packed, scale, jnp.float32))
    for i, (p, s) in enumerate(experts):
        np.testing.assert_array_equal(full[i], np.asarray(mxfp4_dequantize_packed(p, s, jnp.float32)))


def test_converters_reject_bad_input_with_names():
    rng = np.random.default_rng(6)
    p, s = rand_packed(rng, 4, n_in=64)
    s_nan = s.copy()
    s_nan[2, 1] = 0xFF
    with pytest.raises(ValueError, match=r"expert 1 scale.*0xFF.*\(2, 1\)"):
        stack_experts([(p, s), (p, s_nan)])
    stack_experts([(p, s), (p, s_nan)], reject_nan=False)
    with pytest.raises(ValueError, match="expert 1 has shapes"):
        stack_experts([(p, s), (p[:2], s[:2])])
    with pytest.raises(ValueError, match="do not match"):
        from_compressed_tensors(p, s[:, :1])
    with pytest.raises(TypeError, match="uint8"):
        from_compressed_tensors(p.astype(np.int8), s)
    with pytest.raises(KeyError, match="weight_packed"):
        stack_experts([{"weight": p, "weight_scale": s}])
    with pytest.raises(ValueError, match="gpt-oss scales.*0xFF"):
        from_gpt_oss(p.reshape(4, 2, 16), s_nan)
    with pytest.raises(ValueError, match=r"\[..., n_blocks, 16\]"):
        from_gpt_oss(p.reshape(4, 4, 8), s)


def test_gpt_oss_roundtrip_and_same_values_as_compressed_tensors():
    rng = np.random.default_rng(7)
    E, out, n_in = 2, 6, 96
    w = (rng.standard_normal((E, out, n_in)) * np.exp2(rng.integers(-20, 20, (E, out, 3)).repeat(32, -1)))
    w = w.astype(np.float32)
    packed, scale = (np.asarray(a) for a in mxfp4_quantize_packed(w))  # compressed-tensors / k31jax
    blocks, scales = to_gpt_oss(packed, scale)                          # gpt-oss
    assert blocks.shape == (E, out, 3, 16) and scales.shape == (E, out, 3)
    p2, s2 = from_gpt_oss(blocks, scales)
    assert p2.tobytes() == packed.tobytes() and s2.tobytes() == scale.tobytes()
    ours = np.asarray(mxfp4_dequantize_packed(packed, scale, jnp.float32)).astype(np.float64)
    np.testing.assert_array_equal(ours, ref_decode_gpt_oss(blocks, scales))
    np.testing.assert_array_equal(np.asarray(mxfp4_dequantize_packed(p2, s2, jnp.float32)), ours)


def test_gate_up_interleave():
    rng = np.random.default_rng(8)
    p, s = rand_packed(rng, 2, 8, n_in=64)  # [E, 2*I, in/2]
    gp, up = split_interleaved_rows(p)
    gs, us = split_interleaved_rows(s)
    np.testing.assert_array_equal(gp, p[:, 0::2])
    np.testing.assert_array_equal(up, p[:, 1::2])
    np.testing.assert_array_equal(us, s[:, 1::2])
    assert interleave_rows(gp, up).tobytes() == p.tobytes()
    assert interleave_rows(gs, us).tobytes() == s.tobytes()
    gj, uj = split_interleaved_rows(jnp.asarray(p))
    assert np.asarray(interleave_rows(gj, uj)).tobytes() == p.tobytes()


def test_safetensors_f4_and_e8m0_bytes():
    rng = np.random.default_rng(9)
    packed, scale = rand_packed(rng, 3, 5, n_in=64)
    raw, shape = f4_to_safetensors(packed)
    assert shape == (3, 5, 64)  # header shape counts fp4 elements
    assert raw == packed.tobytes()  # same nibble order, byte for byte
    back = f4_from_safetensors(raw, shape)
    assert back.dtype == np.uint8 and back.shape == (3, 5, 32) and back.tobytes() == raw
    assert f4_from_safetensors(memoryview(raw), [3, 5, 64]).tobytes() == raw
    # The first logical elements of the F4 tensor are the low then the high nibble.
    assert [int(raw[0]) & 0xF, int(raw[0]) >> 4] == unpack_fp4(packed)[0, 0, :2].tolist()
    with pytest.raises(ValueError, match="even last dim"):
        f4_from_safetensors(raw, (3, 5, 63))
    with pytest.raises(ValueError, match="header shape needs 480"):
        f4_from_safetensors(raw[:-1], shape)

    sraw, sshape = e8m0_to_safetensors(scale)
    assert sshape == (3, 5, 2) and sraw == scale.tobytes()
    assert e8m0_from_safetensors(sraw, sshape).tobytes() == sraw
    assert e8m0_to_safetensors(scale.view(ml_dtypes.float8_e8m0fnu))[0] == sraw
    bad = bytearray(sraw)
    bad[4] = 0xFF
    with pytest.raises(ValueError, match="0xFF"):
        e8m0_from_safetensors(bytes(bad), sshape)
    assert e8m0_from_safetensors(bytes(bad), sshape, reject_nan=False).reshape(-1)[4] == 0xFF
    # Decoding the raw-byte tensors equals decoding the arrays.
    np.testing.assert_array_equal(
        np.asarray(mxfp4_dequantize_packed(back, e8m0_from_safetensors(sraw, sshape), jnp.float32)),
        np.asarray(mxfp4_dequantize_packed(packed, scale, jnp.float32)),
    )


def test_nan_check_is_skipped_under_jit():
    p, s = rand_packed(np.random.default_rng(10), 2, n_in=32)
    s[0, 0] = 0xFF
    pj, sj = jax.jit(lambda p, s: from_gpt_oss(*to_gpt_oss(p, s)))(p, s)
    assert np.asarray(sj)[0, 0] == 0xFF and np.asarray(pj).tobytes() == p.tobytes()
