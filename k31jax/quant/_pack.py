"""FP4 nibble packing and the packed MXFP4 fast paths used by the model.

Spec: ``mx_formats.md`` §3 (nibble order, layouts) and §4 (in-graph unpack).

Nibble order (universal): byte j holds element 2j in bits 0-3 and element 2j+1
in bits 4-7, so ``0x21 -> codes [1, 2] -> values [0.5, 1.0]``. This is the
order of ``jax.lax.bitcast_convert_type(u8 -> float4_e2m1fn)``, compressed-
tensors, gpt-oss, torch ``float4_e2m1fn_x2`` and safetensors ``F4``.

``pack_fp4`` / ``unpack_fp4`` accept NumPy or jax arrays and return the same
kind (host-side converters stay in NumPy); the ``mxfp4_*`` functions are jitted
jnp code.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k31jax.quant._formats import DEFAULT_BLOCK, FORMATS, check_rule
from k31jax.quant._mx import (
    _as_u8_scale,
    apply_scale_blocks,
    block_scale_bytes,
    encode_elements,
    scale_blocks,
)


class MXFP4Weight(NamedTuple):
    """A stacked MXFP4 expert weight `[E, out, in]` held packed: E2M1 codes two per byte
    (low nibble = even element) `[E, out, in/2]` and E8M0 scale bytes `[E, out, in/32]`.

    Two inference layouts of the same bytes, for accelerator programs:
    - `packed` may be uint32 `[E, out, in/8]`, four code bytes per word (little-endian, so the
      same byte order). XLA:TPU retiles uint8 arrays that a loop reads (a copy of the whole
      stack in every call); 32-bit words keep their layout (`words_view`).
    - `scale` may be uint16 `[E, splits, rows, 128]` (`tile_scales`): each device's scale bytes
      `[out, in/32 / splits]` as whole 256-byte rows. XLA:TPU lays out a uint8 stack whose
      last axis is a dozen blocks wide (a split `w_down`) with that axis outside the experts,
      and re-tiles the whole stack for a loop that slices one expert (a copy of every layer's
      scales per call); rows of 128 uint16, a multiple of 8 of them, it reads in place.
      `scales()` gives the `[E, out, in/32]` bytes back.
    - `row` set: `packed` / `scale` are a whole layer stack `[L, E, ...]` and this weight is
      its row `row`. Code that reads one expert (`one_expert` in `k31jax.ops`) slices
      `[row, e]` straight from the stack; everything else takes `layer()`. A row of a stack
      handed to a loop as its own array is a copy of the layer's experts in every call.
    """

    packed: jax.Array
    scale: jax.Array
    row: jax.Array | None = None

    def layer(self) -> MXFP4Weight:
        """This layer's arrays (`row` None; the codes kept as stored, bytes or words)."""
        if self.row is None:
            return self
        return MXFP4Weight(self.packed[self.row], self.scale[self.row])

    def as_bytes(self) -> MXFP4Weight:
        """This layer with uint8 codes `[E, out, in/2]` and scale bytes `[E, out, in/32]`, for
        code that reads bytes (kernels)."""
        w = self.layer()
        return MXFP4Weight(code_bytes(w.codes()), w.scales())

    def codes(self) -> jax.Array:
        """The codes along `in` per output row: uint8 `[..., out, in/2]` or uint32 words
        `[..., out, in/8]` as held (`mxfp4_dequantize_packed` reads both)."""
        return self.packed

    def scales(self) -> jax.Array:
        """The E8M0 scale bytes `[..., out, in/32]`, from either scale layout."""
        return scale_bytes(self.scale, self.packed.shape[-2])

    def with_arrays(self, packed, scale, row=None) -> MXFP4Weight:
        """The same layout (this class) holding other arrays (a slice, a gather)."""
        return type(self)(packed, scale, row)

    @property
    def shape(self) -> tuple[int, ...]:
        """The byte-code shape of one layer, `[E, out, in/2]`."""
        shape = tuple(self.packed.shape[1:] if self.row is not None else self.packed.shape)
        return shape[:-1] + (shape[-1] * (4 if self.packed.dtype == jnp.uint32 else 1),)


class MXFP4KernelWeight(MXFP4Weight):
    """`MXFP4Weight` in the layout of the Pallas TPU grouped matmul (`kernel_layout`): codes as
    uint32 words `[..., E, in/8, out]` and scale bytes `[..., E, splits, rows, out]`, output
    columns minor in both. XLA:TPU keeps both in its default layout (it stores `[E, out,
    in/8]` words with `out` minor whenever in/8 is not a multiple of 128, and moves a dozen-wide
    scale axis outside the experts), so the kernel reads the stacks where they lie. `splits`:
    the parts the scale blocks are split into over devices, each padded to `rows` (a multiple of
    8: one sublane tile) with zero rows the kernel never reads. The XLA paths read it through
    `codes()` / `scales()` (transposes: a fallback, not a fast path)."""

    __slots__ = ()

    def layer(self) -> MXFP4KernelWeight:
        if self.row is None:
            return self
        return MXFP4KernelWeight(self.packed[self.row], self.scale[self.row])

    def codes(self) -> jax.Array:
        words = jnp.swapaxes(self.packed, -1, -2)
        return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(*words.shape[:-1], 4 * words.shape[-1])

    def scales(self) -> jax.Array:
        *lead, splits, rows, out = self.scale.shape
        part = self.packed.shape[-2] // 4 // splits
        blocks = self.scale[..., :part, :].reshape(*lead, splits * part, out)
        return jnp.swapaxes(blocks, -1, -2)

    @property
    def shape(self) -> tuple[int, ...]:
        """The byte-code shape of one layer, `[E, out, in/2]`."""
        shape = tuple(self.packed.shape[1:] if self.row is not None else self.packed.shape)
        return shape[:-2] + (shape[-1], 4 * shape[-2])


def kernel_scale_rows(blocks: int) -> int:
    """Rows of one part of the kernel layout's scales: its blocks rounded up to a multiple of 8."""
    return -(-blocks // 8) * 8


def kernel_layout(packed: jax.Array, scale: jax.Array, splits: int = 1) -> tuple[jax.Array, jax.Array]:
    """`MXFP4KernelWeight`'s arrays from codes `[..., out, in/2]` (bytes or words) and scale
    bytes `[..., out, in/32]` (bytes or tiled): words `[..., in/8, out]`, and the blocks in
    `splits` equal parts (as devices hold them), each padded to `kernel_scale_rows` rows:
    `[..., splits, rows, out]`."""
    codes = code_bytes(packed)
    *lead, out, half = codes.shape
    words = jax.lax.bitcast_convert_type(codes.reshape(*lead, out, half // 4, 4), jnp.uint32)
    sb = scale_bytes(scale, out)
    blocks = sb.shape[-1]
    part = blocks // splits
    if blocks % splits or half % 4:
        raise ValueError(f"kernel_layout: codes {tuple(codes.shape)} / scale blocks {blocks} do not split "
                         f"into {splits} parts of whole words")
    parts = jnp.swapaxes(sb, -1, -2).reshape(*lead, splits, part, out)
    pad = kernel_scale_rows(part) - part
    if pad:
        parts = jnp.pad(parts, [(0, 0)] * (len(lead) + 1) + [(0, pad), (0, 0)])
    return jnp.swapaxes(words, -1, -2), parts


def mxfp4_weight(packed, scale, row=None) -> MXFP4Weight:
    """The `MXFP4Weight` (or `MXFP4KernelWeight`, told by its scale's rank: one more than the
    codes', uint8) holding these arrays."""
    kernel = scale.ndim == packed.ndim + 1 and scale.dtype == jnp.uint8
    return (MXFP4KernelWeight if kernel else MXFP4Weight)(packed, scale, row)


def code_bytes(packed: jax.Array) -> jax.Array:
    """uint8 codes `[..., n]` of packed codes held as uint8 or as uint32 words `[..., n/4]`."""
    if packed.dtype != jnp.uint32:
        return packed
    return jax.lax.bitcast_convert_type(packed, jnp.uint8).reshape(*packed.shape[:-1], 4 * packed.shape[-1])


SCALE_ROW = 128  # uint16 per row of the tiled scale layout: one 128-lane tile row


def scale_tiles(out: int, blocks: int, splits: int) -> bool:
    """Whether scale bytes `[out, blocks]` split `splits` ways along `blocks` take the tiled
    layout: each part's bytes fill rows of 256 bytes, a multiple of 8 rows (one (8, 128) tile
    high), and the part's blocks are not already a multiple of 128 wide."""
    if blocks % splits:
        return False
    part = blocks // splits
    return part % 128 != 0 and (out * part) % (2 * SCALE_ROW * 8) == 0


def tile_scales(scale: jax.Array, splits: int = 1) -> jax.Array:
    """E8M0 scale bytes `[..., out, blocks]` as uint16 `[..., splits, rows, 128]`: the `splits`
    equal parts of the blocks (as devices hold them), each part's bytes `[out, blocks/splits]`
    in order, two per uint16 (little-endian: the same bytes). See `scale_tiles`."""
    *lead, out, blocks = scale.shape
    part = blocks // splits
    parts = jnp.moveaxis(jnp.asarray(scale).reshape(*lead, out, splits, part), -2, -3)
    return jax.lax.bitcast_convert_type(parts.reshape(*lead, splits, out * part // (2 * SCALE_ROW), SCALE_ROW, 2),
                                        jnp.uint16)


def scale_bytes(scale: jax.Array, out: int) -> jax.Array:
    """Scale bytes `[..., out, blocks]` of scales held as bytes or tiled (`tile_scales`)."""
    if scale.dtype != jnp.uint16:
        return scale
    *lead, splits, rows, row = scale.shape
    parts = jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(*lead, splits, out, rows * row * 2 // out)
    return jnp.moveaxis(parts, -3, -2).reshape(*lead, out, -1)


def words_view(packed: jax.Array) -> jax.Array:
    """uint32 words `[..., n/4]` of uint8 codes `[..., n]` (n a multiple of 4): the same bytes."""
    return jax.lax.bitcast_convert_type(jnp.asarray(packed).reshape(*packed.shape[:-1], -1, 4), jnp.uint32)


if TYPE_CHECKING:
    from jaxtyping import Array, Float, Int32, UInt8

_E2M1 = FORMATS["e2m1"]


def _xp(*arrays):
    """NumPy for NumPy/host inputs, jax.numpy for jax arrays and tracers."""
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def pack_fp4(codes: UInt8[Array, "*B n"]) -> UInt8[Array, "*B n/2"]:
    """Packs 4-bit codes (one per uint8, low nibble) two per byte along the last axis.

    Element 2j goes to the low nibble of byte j, element 2j+1 to the high nibble.
    High nibbles of the input bytes are ignored. ``n`` must be even.
    """
    xp = _xp(codes)
    codes = xp.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"pack_fp4: codes must be uint8, got {codes.dtype}")
    n = codes.shape[-1]
    if n % 2:
        raise ValueError(f"pack_fp4: last axis of shape {codes.shape} has odd length {n}")
    pairs = (codes & 0xF).reshape(*codes.shape[:-1], n // 2, 2)
    if xp is np:
        return pairs[..., 0] | (pairs[..., 1] << 4)
    return _pack_pairs(pairs)


def _pack_pairs(pairs: jax.Array) -> jax.Array:
    """uint8 nibbles [..., m, 2] -> bytes [..., m] (low nibble = [..., 0]).

    Written as a weighted sum over the pair axis: XLA:CPU fuses it with the
    producer, whereas the two stride-2 slices of ``lo | hi << 4`` made the
    quantise+pack fusion ~5x slower.
    """
    return (pairs * jnp.array([1, 16], jnp.uint8)).sum(axis=-1, dtype=jnp.uint8)


def unpack_fp4(packed: UInt8[Array, "*B m"]) -> UInt8[Array, "*B 2m"]:
    """Inverse of :func:`pack_fp4`: uint8 [..., m] -> codes uint8 [..., 2m] (low nibble first)."""
    xp = _xp(packed)
    packed = xp.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"unpack_fp4: packed must be uint8, got {packed.dtype}")
    codes = xp.stack([packed & 0xF, packed >> 4], axis=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _e2m1_to_f32(c: jax.Array) -> jax.Array:
    """E2M1 codes (uint8, low nibble) -> exact f32, by bit construction.

    ``s e1 e0 m``: e = 0 gives 0.5 * m (f32 0x3F000000 or 0); e > 0 gives an f32
    with biased exponent e + 126 and mantissa bit 22 = m; bit 3 -> bit 31.
    """
    c = c.astype(jnp.uint32)
    m = c & 1
    e = (c >> 1) & 3
    mag = jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return jax.lax.bitcast_convert_type(mag | ((c & 8) << 28), jnp.float32)


def _check_packed_pair(packed_shape, scale_shape, block: int, name: str) -> None:
    if block % 2:
        raise ValueError(f"{name}: block must be even for packed fp4, got {block}")
    if len(packed_shape) < 1 or len(packed_shape) != len(scale_shape):
        raise ValueError(
            f"{name}: packed {tuple(packed_shape)} and scale {tuple(scale_shape)} "
            "must have the same rank >= 1"
        )
    half = block // 2
    if (
        tuple(packed_shape[:-1]) != tuple(scale_shape[:-1])
        or packed_shape[-1] % half
        or packed_shape[-1] // half != scale_shape[-1]
    ):
        raise ValueError(
            f"{name}: packed {tuple(packed_shape)} (= [..., in/2]) and scale "
            f"{tuple(scale_shape)} (= [..., in/{block}]) do not match for block={block}"
        )


@functools.partial(jax.jit, static_argnames=("dtype", "block"))
def mxfp4_dequantize_packed(
    packed: UInt8[Array, "*B out in_half"],
    scale: UInt8[Array, "*B out in_blocks"],
    dtype=jnp.bfloat16,
    *,
    block: int = DEFAULT_BLOCK,
) -> Float[Array, "*B out in"]:
    """Dequantises packed MXFP4 weights ``[..., out, in/2]`` + ``[..., out, in/32]``.

    This is the in-graph path the model's expert matmul calls. Each nibble (low
    first) is decoded by building its f32 bit pattern with integer ops (exact,
    and ~1.5x faster on XLA:CPU than the equivalent ``u8 -> float4_e2m1fn``
    bitcast + convert), then multiplied by the broadcast block scale in two exact
    power-of-two steps and cast to ``dtype`` (default bf16, exact for every
    E2M1 x E8M0 product in the normal range). Same numerics as
    :func:`dequantize`: scale byte 0xFF -> NaN, f32-subnormal products -> +-0,
    overflow -> +-Inf.

    Returns:
      ``dtype`` array ``[..., out, in]``.
    """
    packed = _check_codes(packed, "mxfp4_dequantize_packed")
    scale = _as_u8_scale(scale, "mxfp4_dequantize_packed")
    _check_packed_pair(_byte_shape(packed), scale.shape, block, "mxfp4_dequantize_packed")
    if jnp.dtype(dtype) != jnp.bfloat16:
        return _dequantize_bits(packed, scale, dtype, block)
    # XLA:CPU: the integer form (faster there). Accelerators: the native E2M1 / E8M0 converts
    # straight to bf16, which XLA:TPU fuses with the scale multiply and keeps in bf16 (the
    # integer form materialises f32 copies of the whole weight before its matmul).
    return jax.lax.platform_dependent(
        packed, scale, cpu=functools.partial(_dequantize_bits, dtype=dtype, block=block),
        default=functools.partial(mxfp4_dequantize_packed_bf16, block=block))


def _check_codes(packed, name: str) -> jax.Array:
    packed = jnp.asarray(packed)
    if packed.dtype not in (jnp.uint8, jnp.uint32):
        raise TypeError(f"{name}: packed must be uint8 (or uint32 words of 4 code bytes), got {packed.dtype}")
    return packed


def _byte_shape(packed) -> tuple[int, ...]:
    return packed.shape[:-1] + (packed.shape[-1] * (4 if packed.dtype == jnp.uint32 else 1),)


def _dequantize_bits(packed, scale, dtype, block):
    packed = code_bytes(packed)
    v = jnp.stack([_e2m1_to_f32(packed & 0xF), _e2m1_to_f32(packed >> 4)], axis=-1)
    v = v.reshape(*scale.shape, block)  # [..., out, in/2, 2] -> [..., out, in/32, 32]
    out = apply_scale_blocks(v, scale)
    return out.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).astype(dtype)


def mxfp4_dequantize_packed_bf16(
    packed: UInt8[Array, "*B out in_half"],
    scale: UInt8[Array, "*B out in_blocks"],
    *,
    block: int = DEFAULT_BLOCK,
) -> Float[Array, "*B out in"]:
    """The bf16 value of packed MXFP4 through the native ``float4_e2m1fn`` and
    ``float8_e8m0fnu`` types: codes -> bf16, scale byte -> bf16 power of two, one multiply.

    Every E2M1 x E8M0 product whose magnitude is a bf16 normal (>= 2**-126) is exact, as are
    0xFF scales (NaN) and overflow (+-Inf). Below that the result is a bf16 subnormal where
    :func:`mxfp4_dequantize_packed`'s integer form gives +-0, and accelerators that flush bf16
    subnormals give +-0 too; scales that small (byte < 2) do not occur in trained weights.
    """
    packed = _check_codes(packed, "mxfp4_dequantize_packed_bf16")
    scale = _as_u8_scale(scale, "mxfp4_dequantize_packed_bf16")
    nbytes = _byte_shape(packed)
    _check_packed_pair(nbytes, scale.shape, block, "mxfp4_dequantize_packed_bf16")
    # u8 -> [..., 2] or u32 words -> [..., 8] codes, lowest bits first (the byte order): words
    # decode straight to codes, with no byte array in between
    codes = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)
    v = codes.astype(jnp.bfloat16).reshape(*scale.shape, block)
    s = jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu).astype(jnp.bfloat16)
    return (v * s[..., None]).reshape(*nbytes[:-1], 2 * nbytes[-1])


@functools.partial(jax.jit, static_argnames=("rule", "block"))
def mxfp4_quantize_packed(
    w: Float[Array, "*B out in"],
    rule: str = "floor",
    *,
    block: int = DEFAULT_BLOCK,
) -> tuple[UInt8[Array, "*B out in_half"], UInt8[Array, "*B out in_blocks"]]:
    """MXFP4-quantises ``w`` along its last axis and packs it.

    Same result as ``pack_fp4(quantize(w, "e2m1", rule=rule)[0])`` and the scale
    bytes, in one fused pass over ``w``.

    Returns:
      ``(packed uint8 [..., out, in/2], scale uint8 [..., out, in/32])``.
    """
    check_rule(rule)
    w = jnp.asarray(w)
    if w.ndim < 1 or w.shape[-1] % block or block % 2:
        raise ValueError(
            f"mxfp4_quantize_packed: last axis of shape {w.shape} must be a multiple "
            f"of block={block} (and block even)"
        )
    wb = w.reshape(*w.shape[:-1], w.shape[-1] // block, block)
    sb = block_scale_bytes(wb, _E2M1, rule)
    y = scale_blocks(wb, sb, _E2M1)
    codes = encode_elements(y, _E2M1).reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
    return _pack_pairs(codes), sb


@jax.jit
def mxfp4_unpack_to_e4m3(packed: UInt8[Array, "*B m"]) -> Array:
    """Packed E2M1 codes [..., m] -> ``float8_e4m3fn`` [..., 2m], losslessly.

    Every E2M1 value is exact in E4M3 (``mx_formats.md`` §1.3), so an fp8 GEMM
    operand times the per-block E8M0 scale (applied per block in f32, never
    folded into the fp8 exponent) reproduces the MXFP4 weights bit-exactly.
    """
    packed = jnp.asarray(packed)
    v = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)
    return v.astype(jnp.float8_e4m3fn).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


@functools.partial(jax.jit, static_argnames=("block",))
def mxfp4_block_max_histogram(
    packed: UInt8[Array, "*B m"], *, block: int = DEFAULT_BLOCK
) -> Int32[Array, "8"]:
    """Histogram of each block's max |code| index (0..7 -> 0, .5, 1, 1.5, 2, 3, 4, 6).

    The release diagnostic of ``mx_formats.md`` §2.1: under the floor or even
    rule every non-zero block's max is 4 or 6 (indices 6, 7); under rceil, 3
    (index 5) also occurs.
    """
    packed = jnp.asarray(packed)
    if packed.shape[-1] % (block // 2):
        raise ValueError(
            f"mxfp4_block_max_histogram: last axis of {packed.shape} is not a multiple of {block // 2}"
        )
    mag = jnp.maximum(packed & 0x7, (packed >> 4) & 0x7)
    mag = mag.reshape(-1, block // 2).max(axis=-1)
    return jnp.bincount(mag.astype(jnp.int32), length=8).astype(jnp.int32)
