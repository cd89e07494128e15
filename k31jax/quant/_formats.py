"""MX element formats (E2M1, E4M3, E5M2) and the E8M0 shared scale.

Spec: ``mx_formats.md`` §1 (encodings) and §2.1 (scale-selection rules).

Everything here is static metadata plus two tiny jnp helpers that build powers
of two from integer exponents *by bit construction*, so that no arithmetic ever
has to produce or consume an f32 subnormal (XLA flushes those to zero on CPU and
GPU, ``mx_formats.md`` §5.1).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

FormatName = Literal["e2m1", "e4m3", "e5m2"]
Rule = Literal["floor", "rceil", "even"]

RULES: tuple[str, ...] = ("floor", "rceil", "even")
DEFAULT_BLOCK = 32

E8M0_BIAS = 127
E8M0_NAN = 0xFF
# Scale exponents are clamped to [-127, 127] (bytes 0x00..0xFE), mx_formats.md §2 step 3.
SCALE_EXP_MIN = -127
SCALE_EXP_MAX = 127


@dataclasses.dataclass(frozen=True)
class ElemFormat:
    """Static description of one MX element format.

    Attributes:
      name: "e2m1", "e4m3" or "e5m2".
      dtype: the matching jnp dtype (``float4_e2m1fn``, ``float8_e4m3fn``,
        ``float8_e5m2``).
      ebits, mbits: exponent and explicit mantissa bits.
      emax: ``emax_elem``, the exponent of the largest normal (2, 8, 15).
      max_value: largest finite magnitude (6, 448, 57344). Quantisation clamps
        to +-max_value *before* the RNE cast.
      max_mant_bits: the f32 mantissa field (23 bits) of ``max_value``; used
        by the exact ``rceil`` rule.
      bits: storage width of one code (4 or 8).
    """

    name: str
    dtype: jnp.dtype
    ebits: int
    mbits: int
    emax: int
    max_value: float
    max_mant_bits: int
    bits: int


def _f32_mant_bits(v: float) -> int:
    return int(np.array(v, np.float32).view(np.uint32)) & 0x7FFFFF


FORMATS: dict[str, ElemFormat] = {
    "e2m1": ElemFormat(
        "e2m1", jnp.dtype(jnp.float4_e2m1fn), 2, 1, 2, 6.0, _f32_mant_bits(6.0), 4
    ),
    "e4m3": ElemFormat(
        "e4m3", jnp.dtype(jnp.float8_e4m3fn), 4, 3, 8, 448.0, _f32_mant_bits(448.0), 8
    ),
    "e5m2": ElemFormat(
        "e5m2", jnp.dtype(jnp.float8_e5m2), 5, 2, 15, 57344.0, _f32_mant_bits(57344.0), 8
    ),
}

# E2M1 code -> value (bit 3 = sign; code & 7 indexes the magnitudes), mx_formats.md §1.1.
E2M1_VALUES: np.ndarray = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


def get_format(fmt: str | ElemFormat) -> ElemFormat:
    """Returns the :class:`ElemFormat` for ``fmt`` ("e2m1", "e4m3", "e5m2")."""
    if isinstance(fmt, ElemFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown MX element format {fmt!r}; expected one of {sorted(FORMATS)}"
        ) from None


def check_rule(rule: str) -> str:
    """Validates a scale-selection rule name ("floor", "rceil", "even")."""
    if rule not in RULES:
        raise ValueError(f"unknown MX scale rule {rule!r}; expected one of {RULES}")
    return rule


def pow2_f32(k: jax.Array) -> jax.Array:
    """``2**k`` as f32 for integer ``k`` in [-126, 127], built from bits (exact)."""
    k = k.astype(jnp.int32)
    return jax.lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def split_pow2(k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two *normal* f32 factors whose product is ``2**k``, for int k in [-128, 128].

    ``f1 = 2**(k >> 1)`` and ``f2 = 2**(k - (k >> 1))``, both in [2**-64, 2**64].
    Multiplying by ``f1`` and then by ``f2`` is exact whenever the final result
    is a normal f32, even where ``2**k`` itself (k = -127) is an f32 subnormal
    that XLA would flush to zero.
    """
    k = k.astype(jnp.int32)
    a = k >> 1  # arithmetic shift: floor(k / 2)
    return pow2_f32(a), pow2_f32(k - a)
