"""Converters between the MXFP4 storage layouts of ``mx_formats.md`` §3.

All layouts share the same bytes: the codes packed two per byte along ``in``
(low nibble = even element) and one E8M0 byte per 32 elements. Converting is
therefore pure reshaping/stacking, never re-quantisation, and every converter
here is byte-exact in both directions.

* compressed-tensors per Linear (the K3 release, ``mxfp4-pack-quantized``):
  ``weight_packed`` u8 ``[out, in/2]`` + ``weight_scale`` u8 ``[out, in/32]``.
* k31jax in memory / Orbax: stacked experts ``[E, out, in/2]`` + ``[E, out, in/32]``.
* gpt-oss: ``*_blocks`` u8 ``[..., in/32, 16]`` + ``*_scales`` u8 ``[..., in/32]``;
  ``gate_up`` rows are interleaved (gate = rows 0::2, up = rows 1::2).
* safetensors-native ``F4`` (header shape = logical element count, last dim
  even) and ``F8_E8M0`` (one raw byte per scale): raw byte buffers.

Functions accept NumPy or jax arrays and return the same kind. Converters that
read checkpoint data reject the NaN scale byte 0xFF (``mx_formats.md`` §5.2) when
the data is concrete (``reject_nan=True``); inside ``jit`` the check is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from k31jax.quant._formats import DEFAULT_BLOCK, E8M0_NAN
from k31jax.quant._pack import _check_packed_pair, _xp

if TYPE_CHECKING:
    from jaxtyping import Array, UInt8

GPT_OSS_BLOCK_BYTES = DEFAULT_BLOCK // 2  # 16 bytes = 32 fp4 elements
CT_PACKED_KEY = "weight_packed"
CT_SCALE_KEY = "weight_scale"
CT_FORMAT = "mxfp4-pack-quantized"
SAFETENSORS_F4 = "F4"
SAFETENSORS_E8M0 = "F8_E8M0"


def check_scale_bytes(scale: Any, name: str = "scale") -> None:
    """Raises ``ValueError`` naming ``name`` if a concrete scale array holds 0xFF (NaN).

    Tracers (inside ``jit``) are not checked.
    """
    try:
        s = np.asarray(scale)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    bad = np.flatnonzero(s.reshape(-1) == E8M0_NAN)
    if bad.size:
        first = np.unravel_index(bad[0], s.shape) if s.ndim else ()
        raise ValueError(
            f"{name}: {bad.size} E8M0 scale byte(s) are 0xFF (NaN), first at index "
            f"{tuple(int(i) for i in first)}; refusing to convert a NaN block"
        )


def _check_u8(a: Any, name: str) -> None:
    if a.dtype != np.uint8:
        raise TypeError(f"{name}: expected uint8, got {a.dtype}")


def _validated_pair(packed, scale, name: str, reject_nan: bool):
    xp = _xp(packed, scale)
    packed, scale = xp.asarray(packed), xp.asarray(scale)
    _check_u8(packed, f"{name} packed")
    _check_u8(scale, f"{name} scale")
    _check_packed_pair(packed.shape, scale.shape, DEFAULT_BLOCK, name)
    if reject_nan:
        check_scale_bytes(scale, f"{name} scale")
    return xp, packed, scale


# ----------------------------------------------------------------------------
# compressed-tensors <-> k31jax
# ----------------------------------------------------------------------------


def from_compressed_tensors(
    weight_packed: UInt8[Array, "out in_half"],
    weight_scale: UInt8[Array, "out in_blocks"],
    *,
    name: str = "weight",
    reject_nan: bool = True,
) -> tuple[UInt8[Array, "out in_half"], UInt8[Array, "out in_blocks"]]:
    """Validates one compressed-tensors MXFP4 Linear and returns ``(packed, scale)``.

    The bytes are already the k31jax layout; this checks dtypes, shapes
    (``[..., in/2]`` vs ``[..., in/32]``) and, if ``reject_nan``, the 0xFF byte.
    """
    _, packed, scale = _validated_pair(weight_packed, weight_scale, name, reject_nan)
    return packed, scale


def to_compressed_tensors(
    packed: UInt8[Array, "out in_half"], scale: UInt8[Array, "out in_blocks"]
) -> dict[str, Any]:
    """``(packed, scale)`` -> ``{"weight_packed": ..., "weight_scale": ...}`` (same bytes)."""
    _, packed, scale = _validated_pair(packed, scale, "to_compressed_tensors", False)
    return {CT_PACKED_KEY: packed, CT_SCALE_KEY: scale}


def _as_pair(item: Any, i: int) -> tuple[Any, Any]:
    if isinstance(item, Mapping):
        try:
            return item[CT_PACKED_KEY], item[CT_SCALE_KEY]
        except KeyError:
            raise KeyError(
                f"stack_experts: expert {i} lacks {CT_PACKED_KEY!r}/{CT_SCALE_KEY!r}; "
                f"keys are {sorted(item)}"
            ) from None
    packed, scale = item
    return packed, scale


def stack_experts(
    experts: Sequence[Any], *, reject_nan: bool = True
) -> tuple[UInt8[Array, "E out in_half"], UInt8[Array, "E out in_blocks"]]:
    """Per-expert compressed-tensors tensors -> stacked ``[E, out, in/2]``, ``[E, out, in/32]``.

    Args:
      experts: a sequence of ``(weight_packed, weight_scale)`` pairs or of
        mappings with keys ``"weight_packed"`` / ``"weight_scale"``; all experts
        must have identical shapes.
      reject_nan: raise on 0xFF scale bytes (naming the expert).
    """
    if not experts:
        raise ValueError("stack_experts: no experts given")
    pairs = [_as_pair(e, i) for i, e in enumerate(experts)]
    xp = _xp(*(a for p in pairs for a in p))
    checked = []
    for i, (p, s) in enumerate(pairs):
        _, p, s = _validated_pair(p, s, f"expert {i}", reject_nan)
        if checked and (p.shape != checked[0][0].shape or s.shape != checked[0][1].shape):
            raise ValueError(
                f"stack_experts: expert {i} has shapes {p.shape}/{s.shape}, expert 0 has "
                f"{checked[0][0].shape}/{checked[0][1].shape}"
            )
        checked.append((p, s))
    return xp.stack([p for p, _ in checked]), xp.stack([s for _, s in checked])


def unstack_experts(
    packed: UInt8[Array, "E out in_half"], scale: UInt8[Array, "E out in_blocks"]
) -> list[tuple[UInt8[Array, "out in_half"], UInt8[Array, "out in_blocks"]]]:
    """Inverse of :func:`stack_experts`: a list of E ``(weight_packed, weight_scale)`` pairs."""
    _, packed, scale = _validated_pair(packed, scale, "unstack_experts", False)
    if packed.ndim < 2:
        raise ValueError(f"unstack_experts: expected a leading expert axis, got {packed.shape}")
    return [(packed[i], scale[i]) for i in range(packed.shape[0])]


# ----------------------------------------------------------------------------
# gpt-oss
# ----------------------------------------------------------------------------


def from_gpt_oss(
    blocks: UInt8[Array, "*B n_blocks 16"],
    scales: UInt8[Array, "*B n_blocks"],
    *,
    reject_nan: bool = True,
) -> tuple[UInt8[Array, "*B in_half"], UInt8[Array, "*B n_blocks"]]:
    """gpt-oss ``*_blocks [..., n_blocks, 16]`` + ``*_scales`` -> ``(packed [..., n_blocks*16], scale)``."""
    xp = _xp(blocks, scales)
    blocks, scales = xp.asarray(blocks), xp.asarray(scales)
    _check_u8(blocks, "gpt-oss blocks")
    _check_u8(scales, "gpt-oss scales")
    if blocks.ndim < 2 or blocks.shape[-1] != GPT_OSS_BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"from_gpt_oss: blocks {blocks.shape} must be [..., n_blocks, 16] with "
            f"scales [..., n_blocks]; got scales {scales.shape}"
        )
    if reject_nan:
        check_scale_bytes(scales, "gpt-oss scales")
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * GPT_OSS_BLOCK_BYTES), scales


def to_gpt_oss(
    packed: UInt8[Array, "*B in_half"], scale: UInt8[Array, "*B n_blocks"]
) -> tuple[UInt8[Array, "*B n_blocks 16"], UInt8[Array, "*B n_blocks"]]:
    """``(packed [..., in/2], scale [..., in/32])`` -> gpt-oss ``(blocks [..., in/32, 16], scales)``."""
    _, packed, scale = _validated_pair(packed, scale, "to_gpt_oss", False)
    return packed.reshape(*scale.shape, GPT_OSS_BLOCK_BYTES), scale


def split_interleaved_rows(x: Array, axis: int = -2) -> tuple[Array, Array]:
    """gpt-oss ``gate_up`` -> ``(gate, up)``: rows ``0::2`` and ``1::2`` along ``axis``.

    Apply it to the packed bytes and to the scales alike (``axis`` is the ``out``
    axis, -2 for ``[..., out, in/2]`` and ``[..., out, in/32]``).
    """
    xp = _xp(x)
    x = xp.asarray(x)
    if x.shape[axis] % 2:
        raise ValueError(f"split_interleaved_rows: axis {axis} of {x.shape} has odd length")
    x = xp.moveaxis(x, axis, 0)
    return xp.moveaxis(x[0::2], 0, axis), xp.moveaxis(x[1::2], 0, axis)


def interleave_rows(gate: Array, up: Array, axis: int = -2) -> Array:
    """Inverse of :func:`split_interleaved_rows`."""
    xp = _xp(gate, up)
    gate, up = xp.asarray(gate), xp.asarray(up)
    if gate.shape != up.shape:
        raise ValueError(f"interleave_rows: gate {gate.shape} != up {up.shape}")
    ax = axis % gate.ndim
    both = xp.stack([gate, up], axis=ax + 1)
    return both.reshape(*gate.shape[:ax], 2 * gate.shape[ax], *gate.shape[ax + 1 :])


# ----------------------------------------------------------------------------
# safetensors-native F4 / F8_E8M0 (raw bytes)
# ----------------------------------------------------------------------------


def _buffer_u8(buf: Any, nbytes: int, what: str) -> np.ndarray:
    a = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    if a.size != nbytes:
        raise ValueError(f"{what}: buffer has {a.size} bytes, header shape needs {nbytes}")
    return a


def f4_from_safetensors(buf: Any, shape: Sequence[int]) -> np.ndarray:
    """Raw safetensors ``F4`` bytes + header shape -> packed uint8 ``[..., shape[-1] // 2]``.

    The header shape counts logical fp4 elements; the last dim must be even
    (whole bytes). The nibble order is the k31jax one, so bytes are copied as is.
    """
    shape = tuple(int(d) for d in shape)
    if not shape or shape[-1] % 2:
        raise ValueError(f"F4 tensor: header shape {shape} must have an even last dim")
    out_shape = (*shape[:-1], shape[-1] // 2)
    return _buffer_u8(buf, math.prod(out_shape), f"F4 tensor {shape}").reshape(out_shape).copy()


def f4_to_safetensors(packed: UInt8[Array, "*B m"]) -> tuple[bytes, tuple[int, ...]]:
    """Packed uint8 ``[..., m]`` -> (raw ``F4`` bytes, header shape ``[..., 2m]``)."""
    p = np.asarray(packed)
    _check_u8(p, "f4_to_safetensors")
    if p.ndim < 1:
        raise ValueError("f4_to_safetensors: packed must have rank >= 1")
    return np.ascontiguousarray(p).tobytes(), (*p.shape[:-1], 2 * p.shape[-1])


def e8m0_from_safetensors(buf: Any, shape: Sequence[int], *, reject_nan: bool = True) -> np.ndarray:
    """Raw safetensors ``F8_E8M0`` bytes + header shape -> uint8 scale bytes of that shape."""
    shape = tuple(int(d) for d in shape)
    s = _buffer_u8(buf, math.prod(shape), f"F8_E8M0 tensor {shape}").reshape(shape).copy()
    if reject_nan:
        check_scale_bytes(s, f"F8_E8M0 tensor {shape}")
    return s


def e8m0_to_safetensors(scale: UInt8[Array, "*S"]) -> tuple[bytes, tuple[int, ...]]:
    """uint8 (or ``float8_e8m0fnu``) scale bytes -> (raw ``F8_E8M0`` bytes, header shape)."""
    s = np.asarray(scale)
    if s.dtype != np.uint8:
        if s.dtype.itemsize != 1 or "e8m0" not in s.dtype.name:
            raise TypeError(f"e8m0_to_safetensors: expected uint8 or float8_e8m0fnu, got {s.dtype}")
        s = s.view(np.uint8)
    return np.ascontiguousarray(s).tobytes(), tuple(s.shape)
