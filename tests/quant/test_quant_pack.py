"""FP4 packing and the packed MXFP4 paths (mx_formats.md §3, §7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax.quant import (
    dequantize,
    mxfp4_block_max_histogram,
    mxfp4_dequantize_packed,
    mxfp4_quantize_packed,
    mxfp4_unpack_to_e4m3,
    pack_fp4,
    quantize,
    unpack_fp4,
)

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def rand_packed(rng, *lead, n_in=64, scale_lo=100, scale_hi=150):
    packed = rng.integers(0, 256, (*lead, n_in // 2), dtype=np.uint8)
    scale = rng.integers(scale_lo, scale_hi, (*lead, n_in // 32), dtype=np.uint8)
    return packed, scale


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
# The tiled scale layout (accelerator inference)
def test_scale_tiles_rule():
    from k31jax.quant import scale_tiles

    assert scale_tiles(3584, 96, 8)       # K3.1 Pro's w_down on tensor=8: 12 blocks a device
    assert scale_tiles(3072, 112, 1)      # its w_gate / w_up with the intermediate whole
    assert not scale_tiles(3584, 96, 5)   # blocks not split evenly
    assert not scale_tiles(512, 256, 2)   # 128 blocks a device: already lane-wide
    assert not scale_tiles(100, 12, 1)    # 1,200 bytes: not whole (8, 128) tiles of uint16


@pytest.mark.parametrize("lead,out,blocks,splits", [((), 512, 4, 1), ((3, 5), 256, 24, 3), ((2,), 1024, 6, 2)])
def test_tiled_scales_hold_each_parts_bytes_in_order_and_give_them_back(lead, out, blocks, splits):
    """`tile_scales` then `scale_bytes` is the identity; part j of the tiled array is exactly
    the tiled bytes of the blocks a device j holds, so a device's shard is its own scales."""
    from k31jax.quant import scale_bytes, tile_scales

    scale = np.random.default_rng(blocks).integers(0, 256, (*lead, out, blocks), dtype=np.uint8)
    tiled = np.asarray(tile_scales(jnp.asarray(scale), splits))
    part = blocks // splits
    assert tiled.dtype == np.uint16 and tiled.shape == (*lead, splits, out * part // 256, 128)
    np.testing.assert_array_equal(np.asarray(scale_bytes(jnp.asarray(tiled), out)), scale)
    for j in range(splits):
        own = scale[..., j * part:(j + 1) * part]
        np.testing.assert_array_equal(tiled[..., j, :, :].view(np.uint8).reshape(own.shape), own)


@pytest.mark.parametrize("lead,out,k,splits", [((), 24, 384, 1), ((3,), 40, 384, 2), ((2, 5), 16, 1536, 3)])
def test_kernel_layout_round_trip_and_rows(lead, out, k, splits):
    """`kernel_layout` (words `[.., in/8, out]`, each part's scale blocks padded to a multiple of
    8 rows) gives the same codes and scales back through `MXFP4KernelWeight`, also at a layer
    row, from bytes or from the words / tiled layouts; `mxfp4_weight` tells the layouts apart."""
    from k31jax.quant import (MXFP4KernelWeight, MXFP4Weight, kernel_layout, kernel_scale_rows, mxfp4_weight,
                              words_view)

    rng = np.random.default_rng(k + out)
    packed = jnp.asarray(rng.integers(0, 256, (*lead, 7, out, k // 2)).astype(np.uint8))
    scale = jnp.asarray(rng.integers(0, 256, (*lead, 7, out, k // 32)).astype(np.uint8))
    words, rows = kernel_layout(packed, scale, splits)
    part = k // 32 // splits
    assert words.dtype == jnp.uint32 and words.shape == (*lead, 7, k // 8, out)
    assert rows.shape == (*lead, 7, splits, kernel_scale_rows(part), out)
    assert not np.asarray(rows[..., part:, :]).any()  # the padding rows are zero
    w = mxfp4_weight(words, rows)
    assert type(w) is MXFP4KernelWeight and type(mxfp4_weight(packed, scale)) is MXFP4Weight
    assert w.shape == (*lead, 7, out, k // 2)
    np.testing.assert_array_equal(w.codes(), packed)
    np.testing.assert_array_equal(w.scales(), scale)
    if lead:
        at = MXFP4KernelWeight(words.reshape(-1, *words.shape[-3:]), rows.reshape(-1, *rows.shape[-4:]), 1)
        layer = at.layer()
        assert type(layer) is MXFP4KernelWeight and at.shape == (7, out, k // 2)
        np.testing.assert_array_equal(layer.as_bytes().packed, packed.reshape(-1, 7, out, k // 2)[1])
        np.testing.assert_array_equal(layer.as_bytes().scale, scale.reshape(-1, 7, out, k // 32)[1])
    # from the accelerator layout's words along `in`
    again = kernel_layout(words_view(packed), scale, splits)
    np.testing.assert_array_equal(again[0], words)
