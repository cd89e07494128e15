"""Block quantisation to MX formats and exact dequantisation.

Spec: ``mx_formats.md`` §2 (OCP conversion), §2.1 (rules), §4-§5 (XLA pitfalls).

Numerics (all functions are pure and jit-able; format, rule, block, axis and
dtype are static):

* Quantisation runs in f32 (OCP). Wider inputs are first rounded to f32;
  bf16/f16 inputs convert exactly.
* The shared exponent is derived from the **integer bits** of the block's
  max-abs value (an integer max over ``bits & 0x7fffffff``), never from a
  rounded ``log2``:

  - ``floor``: ``e = floor(log2 amax) - emax_elem``
  - ``rceil``: ``e = ceil(log2(amax / max_elem))``, exact: with
    ``amax = m * 2**E`` (m in [1, 2)), ``e = E - emax_elem + (m > m_max)``
    where ``max_elem = m_max * 2**emax_elem``.
  - ``even``: round amax's mantissa to the element's ``mbits`` (ties up, as
    torchao ``EVEN`` / compressed-tensors), then floor.

  ``e`` is clamped to [-127, 127] and stored as the E8M0 byte ``e + 127``.
* A block whose amax is zero gets byte 0x00 (e = -127) and codes equal to
  the RNE cast of +-0 (0x0, or the negative-zero code 0x8 / 0x80 for -0.0
  inputs). Nothing is ever divided by 2**-127: elements are *multiplied* by
  ``2**-e`` in two exact power-of-two steps.
* A block holding NaN or +-Inf gets byte 0xFF. Its codes are the unit-scale
  codes of the clamped inputs and carry no meaning: the block decodes to NaN.
* Elements are clamped to +-max_elem, then cast with round-to-nearest-even
  (XLA's convert, bit-identical to ml_dtypes).
* f32-subnormal inputs (0 < |x| < 2**-126) are flushed to +-0 by XLA on CPU
  and GPU when they are scaled. The shared scale never depends on them (a
  block whose amax is subnormal gets byte 0x00 under every rule either way).
  An element code can differ from exact OCP arithmetic only in a block whose
  scale is below 2**-124 (e2m1), 2**-116 (e4m3) or 2**-109 (e5m2); with a
  larger scale the exact scaled value rounds to +-0 anyway.
* Near the top of the f32 range, rceil/even may pick a scale for which the
  block max rounds up to a value above f32 max (e.g. 1.75 * 2**127 -> code 4.0
  at scale 2**126 = 2**128); such elements dequantise to +-Inf in f32.

Dequantisation ``value(code) * 2**(byte - 127)`` is computed as
``(value * 2**a) * 2**b`` with ``a + b = byte - 127``, both factors normal f32.
Guarantee: the result is **exact** whenever the exact product is zero or a
normal f32 (|v| >= 2**-126); in particular scale bytes 0x00..0x02 (2**-127,
an f32 subnormal, to 2**-125) decode exactly wherever the product is normal,
e.g. e2m1 code 4.0 at byte 0x00 gives 2**-125. Products with
0 < |v| < 2**-126 are f32 subnormals and come out as +-0 (sign kept) under
XLA's flush-to-zero; a backend that does not flush returns the exact value. For
e2m1 that is only codes 0.5/1/1.5 at byte 0x00 and 0.5 at byte 0x01. Products
above the f32 range give +-Inf. Byte 0xFF gives NaN for the whole block.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from k31jax.quant._formats import (
    DEFAULT_BLOCK,
    E8M0_BIAS,
    E8M0_NAN,
    SCALE_EXP_MAX,
    SCALE_EXP_MIN,
    ElemFormat,
    check_rule,
    get_format,
    split_pow2,
)

if TYPE_CHECKING:  # annotations only; no runtime dependency on jaxtyping
    from jaxtyping import Array, Float, UInt8

_ABS_MASK = 0x7FFFFFFF
_F32_INF_BITS = 0x7F800000


# ----------------------------------------------------------------------------
# Shape helpers
# ----------------------------------------------------------------------------


def _norm_axis(ndim: int, axis: int, name: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: axis={axis} is out of range for a rank-{ndim} array")
    return axis % ndim


def _check_blocked(shape: tuple[int, ...], block: int, axis: int, name: str) -> int:
    """Normalises ``axis`` and checks that ``block`` divides its length."""
    if block <= 0:
        raise ValueError(f"{name}: block must be positive, got {block}")
    ax = _norm_axis(len(shape), axis, name)
    if shape[ax] % block:
        raise ValueError(
            f"{name}: axis {axis} of shape {shape} has length {shape[ax]}, "
            f"which is not a multiple of block={block}"
        )
    return ax


def _to_blocks(x: jax.Array, block: int, ax: int) -> jax.Array:
    """[..., n, ...] (n at ``ax``) -> [..., n/block, block] with the block axis last."""
    x = jnp.moveaxis(x, ax, -1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _from_blocks(xb: jax.Array, ax: int) -> jax.Array:
    """Inverse of :func:`_to_blocks`."""
    x = xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])
    return jnp.moveaxis(x, -1, ax)


def _scale_to_last(s: jax.Array, ax: int) -> jax.Array:
    return jnp.moveaxis(s, ax, -1)


def _scale_from_last(s: jax.Array, ax: int) -> jax.Array:
    return jnp.moveaxis(s, -1, ax)


def _as_u8_scale(scale_bytes: jax.Array, name: str) -> jax.Array:
    scale_bytes = jnp.asarray(scale_bytes)
    if scale_bytes.dtype == jnp.float8_e8m0fnu:
        return jax.lax.bitcast_convert_type(scale_bytes, jnp.uint8)
    if scale_bytes.dtype != jnp.uint8:
        raise TypeError(
            f"{name}: scale bytes must be uint8 (or float8_e8m0fnu), got {scale_bytes.dtype}"
        )
    return scale_bytes


def _check_scale_shape(
    data_shape: tuple[int, ...], scale_shape: tuple[int, ...], block: int, ax: int, name: str
) -> None:
    want = list(data_shape)
    want[ax] //= block
    if tuple(want) != tuple(scale_shape):
        raise ValueError(
            f"{name}: scale shape {tuple(scale_shape)} does not match data shape "
            f"{tuple(data_shape)} with block={block} along axis {ax} "
            f"(expected {tuple(want)})"
        )


# ----------------------------------------------------------------------------
# Block internals (block axis last). Shared with _pack.py.
# ----------------------------------------------------------------------------


def _abs_bits(xb: jax.Array) -> jax.Array:
    """|x| as int32 bit patterns (f32). Integer order == float order, NaN largest."""
    bits = jax.lax.bitcast_convert_type(xb.astype(jnp.float32), jnp.int32)
    return bits & _ABS_MASK


def scale_bytes_from_amax_bits(amax_bits: jax.Array, f: ElemFormat, rule: str) -> jax.Array:
    """E8M0 byte from the int32 bits of a block's max |x| (see module doc)."""
    big_e = amax_bits >> 23  # biased f32 exponent, 0..255
    if rule == "floor":
        e = big_e - 127 - f.emax
    elif rule == "rceil":
        e = big_e - 127 - f.emax + ((amax_bits & 0x7FFFFF) > f.max_mant_bits).astype(jnp.int32)
    elif rule == "even":
        # Add half an ulp of an mbits-wide mantissa; a carry bumps the exponent.
        e = ((amax_bits + (1 << (22 - f.mbits))) >> 23) - 127 - f.emax
    else:  # pragma: no cover - validated by check_rule
        raise ValueError(rule)
    e = jnp.clip(e, SCALE_EXP_MIN, SCALE_EXP_MAX)
    byte = jnp.where(amax_bits >= _F32_INF_BITS, E8M0_NAN, e + E8M0_BIAS)
    return byte.astype(jnp.uint8)


def block_scale_bytes(xb: jax.Array, f: ElemFormat, rule: str) -> jax.Array:
    """[..., nb, block] -> E8M0 bytes [..., nb]."""
    amax_bits = jnp.max(_abs_bits(xb), axis=-1)
    return scale_bytes_from_amax_bits(amax_bits, f, rule)


def scale_blocks(xb: jax.Array, sbytes: jax.Array, f: ElemFormat) -> jax.Array:
    """``clip(x / 2**e, +-max_elem)`` in f32 for [..., nb, block] x and [..., nb] bytes.

    Byte 0xFF scales by 1 (the codes of a NaN block are meaningless).
    """
    b = sbytes.astype(jnp.int32)
    k = jnp.where(b == E8M0_NAN, 0, E8M0_BIAS - b)  # multiply by 2**-e = 2**(127 - b)
    f1, f2 = split_pow2(k)
    y = (xb.astype(jnp.float32) * f1[..., None]) * f2[..., None]
    return jnp.clip(y, -f.max_value, f.max_value)


def encode_elements(y: jax.Array, f: ElemFormat) -> jax.Array:
    """RNE cast of (already clamped) f32 values to codes, one code per uint8."""
    q = y.astype(f.dtype)
    if f.bits == 4:
        return jax.lax.bitcast_convert_type(q, jnp.uint4).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def decode_elements_f32(codes: jax.Array, f: ElemFormat) -> jax.Array:
    """Codes (uint8, one per byte, or the element dtype itself) -> f32 values."""
    if codes.dtype == f.dtype:
        return codes.astype(jnp.float32)
    if codes.dtype != jnp.uint8:
        raise TypeError(f"{f.name} codes must be uint8 or {f.dtype}, got {codes.dtype}")
    if f.bits == 4:
        c = (codes & 0xF).astype(jnp.uint4)
        return jax.lax.bitcast_convert_type(c, f.dtype).astype(jnp.float32)
    return jax.lax.bitcast_convert_type(codes, f.dtype).astype(jnp.float32)


def apply_scale_blocks(vb: jax.Array, sbytes: jax.Array) -> jax.Array:
    """``v * 2**(byte - 127)`` for f32 [..., nb, block] v and [..., nb] bytes; 0xFF -> NaN."""
    b = sbytes.astype(jnp.int32)
    f1, f2 = split_pow2(b - E8M0_BIAS)
    f1 = jnp.where(b == E8M0_NAN, jnp.float32(jnp.nan), f1)  # NaN * 0 is NaN too
    return (vb * f1[..., None]) * f2[..., None]


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("fmt", "rule", "block", "axis"))
def compute_scales(
    x: Float[Array, "*shape"],
    fmt: str = "e2m1",
    *,
    rule: str = "floor",
    block: int = DEFAULT_BLOCK,
    axis: int = -1,
) -> UInt8[Array, "*scale_shape"]:
    """E8M0 shared-scale bytes for blocks of ``block`` elements along ``axis``.

    Args:
      x: float array; ``x.shape[axis]`` must be a multiple of ``block``.
      fmt: element format, "e2m1", "e4m3" or "e5m2" (sets ``emax_elem``).
      rule: "floor" (OCP), "rceil" or "even" (``mx_formats.md`` §2.1).
      block: block size (32 for MX).
      axis: the blocked axis (the contraction axis of a matmul operand).

    Returns:
      uint8 array shaped like ``x`` with ``axis`` divided by ``block``:
      ``e + 127``, 0x00 for all-zero blocks, 0xFF for blocks with NaN/Inf.
    """
    f = get_format(fmt)
    check_rule(rule)
    x = jnp.asarray(x)
    ax = _check_blocked(x.shape, block, axis, "compute_scales")
    s = block_scale_bytes(_to_blocks(x, block, ax), f, rule)
    return _scale_from_last(s, ax)


@functools.partial(jax.jit, static_argnames=("fmt", "block", "axis"))
def quantize_with_scales(
    x: Float[Array, "*shape"],
    scale_bytes: UInt8[Array, "*scale_shape"],
    fmt: str,
    *,
    block: int = DEFAULT_BLOCK,
    axis: int = -1,
) -> UInt8[Array, "*shape"]:
    """Element codes of ``x`` for *given* E8M0 scale bytes.

    ``code_i = RNE(clip(x_i / 2**(byte - 127), +-max_elem))``, computed exactly in
    f32 for every byte 0x00..0xFE (tiny and huge scales included). Byte 0xFF
    scales by 1.

    Returns:
      uint8 codes shaped like ``x``: for e2m1 one 4-bit code per byte (low
      nibble); for e4m3/e5m2 the fp8 bit pattern.
    """
    f = get_format(fmt)
    x = jnp.asarray(x)
    ax = _check_blocked(x.shape, block, axis, "quantize_with_scales")
    sb = _as_u8_scale(scale_bytes, "quantize_with_scales")
    _check_scale_shape(x.shape, sb.shape, block, ax, "quantize_with_scales")
    y = scale_blocks(_to_blocks(x, block, ax), _scale_to_last(sb, ax), f)
    return _from_blocks(encode_elements(y, f), ax)


@functools.partial(jax.jit, static_argnames=("fmt", "rule", "block", "axis"))
def quantize(
    x: Float[Array, "*shape"],
    fmt: str,
    *,
    rule: str = "floor",
    block: int = DEFAULT_BLOCK,
    axis: int = -1,
) -> tuple[UInt8[Array, "*shape"], UInt8[Array, "*scale_shape"]]:
    """MX-quantises ``x`` in blocks of ``block`` along ``axis`` (OCP algorithm).

    Args:
      x: float array (f32/bf16/f16); ``x.shape[axis] % block == 0``.
      fmt: "e2m1" (MXFP4), "e4m3" or "e5m2" (MXFP8).
      rule: shared-exponent rule, "floor" (OCP default), "rceil" or "even".
      block: block size, 32 for MX.
      axis: blocked axis; the default -1 is the contraction axis of [out, in]
        weights.

    Returns:
      ``(codes, scale_bytes)``: uint8 codes shaped like ``x`` (e2m1: one code
      per byte in the low nibble; fp8: the bit pattern), and uint8 E8M0 bytes
      shaped like ``x`` with ``axis`` divided by ``block``. See the module
      docstring for zero, NaN/Inf and subnormal handling.
    """
    f = get_format(fmt)
    check_rule(rule)
    x = jnp.asarray(x)
    ax = _check_blocked(x.shape, block, axis, "quantize")
    xb = _to_blocks(x, block, ax)
    sb = block_scale_bytes(xb, f, rule)
    codes = encode_elements(scale_blocks(xb, sb, f), f)
    return _from_blocks(codes, ax), _scale_from_last(sb, ax)


@functools.partial(jax.jit, static_argnames=("fmt", "block", "axis", "dtype"))
def dequantize(
    codes: UInt8[Array, "*shape"],
    scale_bytes: UInt8[Array, "*scale_shape"],
    fmt: str,
    *,
    block: int = DEFAULT_BLOCK,
    axis: int = -1,
    dtype=jnp.float32,
) -> Float[Array, "*shape"]:
    """Decodes MX codes: ``value(code) * 2**(byte - 127)``, computed in f32.

    Args:
      codes: uint8 codes as produced by :func:`quantize` (for e2m1 only the low
        nibble is read), or an array of the element dtype itself
        (``float4_e2m1fn`` / ``float8_e4m3fn`` / ``float8_e5m2``).
      scale_bytes: uint8 (or ``float8_e8m0fnu``) E8M0 bytes, ``codes.shape``
        with ``axis`` divided by ``block``.
      fmt: "e2m1", "e4m3" or "e5m2".
      block, axis: as in :func:`quantize`.
      dtype: output dtype; the f32 result is cast to it at the end.

    Returns:
      ``dtype`` array shaped like ``codes``. Exact whenever the product is zero
      or a normal f32, including for scale bytes 0..2; f32-subnormal products
      flush to +-0; overflow gives +-Inf; byte 0xFF gives NaN for the block.
    """
    f = get_format(fmt)
    codes = jnp.asarray(codes)
    ax = _check_blocked(codes.shape, block, axis, "dequantize")
    sb = _as_u8_scale(scale_bytes, "dequantize")
    _check_scale_shape(codes.shape, sb.shape, block, ax, "dequantize")
    vb = _to_blocks(decode_elements_f32(codes, f), block, ax)
    out = apply_scale_blocks(vb, _scale_to_last(sb, ax))
    return _from_blocks(out, ax).astype(dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "dtype"))
def decode_elements(codes: UInt8[Array, "*shape"], fmt: str, dtype=jnp.float32) -> Float[Array, "*shape"]:
    """Element values of ``codes`` without any scale (exact in f32 / bf16)."""
    f = get_format(fmt)
    return decode_elements_f32(jnp.asarray(codes), f).astype(dtype)
