"""Non-finite values (NaN, Inf) in the converted tensors: counted for every float leaf the
converter stores, reported per source tensor (`convert(...).nonfinite`, the CLI's summary
line) and, with `strict=True` (`--strict`), refused.

Counted on the bit patterns (exponent all ones) in blocks, so a multi-GB leaf costs no more
than a block of scratch memory and bfloat16 is not pushed through NumPy's per-element
ml_dtypes loops. Packed MXFP4 leaves hold no floats: E2M1 has no NaN or Inf, and the E8M0
NaN scale byte is already refused when the scales are read (`_transforms._nan_scales`).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from ._transforms import Entry

_BLOCK = 1 << 22  # elements per pass: 8-16 MB of scratch per temporary
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """Non-finite values of one source tensor (or, for a leaf built from many, the leaf)."""

    file: str
    tensor: str
    nan: int
    inf: int

    @property
    def count(self) -> int:
        return self.nan + self.inf

    def describe(self) -> str:
        parts = [f"{n:,} {what}" for n, what in ((self.nan, "NaN"), (self.inf, "Inf")) if n]
        return f"{self.file}: tensor {self.tensor!r}: {', '.join(parts)}"


def _masks(dtype: np.dtype) -> tuple[type, int, int] | None:
    """(unsigned view type, exponent mask, mantissa mask) of an IEEE-style float dtype that
    has Inf and NaN; None for anything else (integers, packed bytes, float8 without Inf)."""
    dtype = np.dtype(dtype)
    if dtype.itemsize not in _UINT:
        return None
    try:
        fi = ml_dtypes.finfo(dtype) if dtype.kind == "V" else np.finfo(dtype)
    except (TypeError, ValueError):
        return None
    nexp, nmant = int(fi.nexp), int(fi.nmant)
    if 1 + nexp + nmant != 8 * dtype.itemsize:
        return None
    return _UINT[dtype.itemsize], ((1 << nexp) - 1) << nmant, (1 << nmant) - 1


def count_nonfinite(value: np.ndarray) -> tuple[int, int]:
    """(NaN count, Inf count) of a float array; (0, 0) for non-float arrays."""
    masks = _masks(value.dtype)
    if masks is None or value.size == 0:
        return 0, 0
    uint, exp_mask, mant_mask = masks
    flat = np.ascontiguousarray(value).reshape(-1).view(uint)
    nan = inf = 0
    for s in range(0, flat.size, _BLOCK):
        block = flat[s:s + _BLOCK]
        special = (block & uint(exp_mask)) == uint(exp_mask)
        n = int(np.count_nonzero(special))
        if n:
            nan_here = int(np.count_nonzero(special & ((block & uint(mant_mask)) != 0)))
            nan += nan_here
            inf += n - nan_here
    return nan, inf


def nonfinite_of(entry: Entry, value: np.ndarray) -> list[NonFinite]:
    """The non-finite values of one stored leaf by source tensor: per expert for a stacked
    leaf, the one tensor for a plain leaf, the leaf itself for a decoded (many-tensor) one."""
    if _masks(value.dtype) is None:
        return []
    out = []
    if entry.mode == "stack":
        for e, info in enumerate(entry.tensors):
            nan, inf = count_nonfinite(value[e])
            if nan or inf:
                out.append(NonFinite(info.file.name, info.name, nan, inf))
        return out
    nan, inf = count_nonfinite(value)
    if nan or inf:
        if len(entry.tensors) == 1:
            info = entry.tensors[0]
            out.append(NonFinite(info.file.name, info.name, nan, inf))
        else:
            first = entry.tensors[0].file.name if entry.tensors else "(initialised)"
            out.append(NonFinite(first, f"stored leaf {'/'.join(entry.key)}", nan, inf))
    return out


__all__ = ["NonFinite", "count_nonfinite", "nonfinite_of"]
