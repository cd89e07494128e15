"""A minimal, dependency-free safetensors reader (raw header + memory-mapped buffers).

Reads U8/I8/BF16/F16/F32/F64/I32/I64/BOOL tensors (and F8/F4 as raw bytes) without torch.
Every error names the file and the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "BOOL": np.dtype(bool), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32), "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(np.uint8),
}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A malformed or inconsistent safetensors file; the message names file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int
    file: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def expected_nbytes(self) -> int:
        n = int(np.prod(self.shape, dtype=np.int64))
        if self.dtype == "F4":
            return (n + 1) // 2
        return n * DTYPES[self.dtype].itemsize


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check a file's header: `{name: TensorInfo}` and the `__metadata__` dict."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsError(f"{path}: truncated file ({size} bytes), no header length")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise SafetensorsError(f"{path}: header length {n} does not fit in a {size}-byte file")
            header_bytes = f.read(n)
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: no such file") from None
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: corrupt JSON header ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    infos = {}
    for name, h in header.items():
        try:
            dtype, shape, (a, b) = h["dtype"], tuple(int(s) for s in h["shape"]), h["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry {h!r}") from None
        if dtype not in DTYPES and dtype != "F4":
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        info = TensorInfo(name, dtype, shape, base + int(a), base + int(b), path)
        if not 0 <= a <= b or info.end > size:
            raise SafetensorsError(f"{path}: tensor {name!r} data_offsets [{a}, {b}] lie outside the "
                                   f"file's {size - base}-byte data section (truncated file?)")
        if info.nbytes != info.expected_nbytes():
            raise SafetensorsError(f"{path}: tensor {name!r} holds {info.nbytes} bytes, but dtype {dtype} "
                                   f"and shape {list(shape)} need {info.expected_nbytes()}")
        infos[name] = info
    return infos, meta


def load_tensor(info: TensorInfo) -> np.ndarray:
    """The tensor as a read-only numpy array backed by a memory map (F4 as raw uint8 bytes)."""
    if info.dtype == "F4":
        return np.memmap(info.file, np.uint8, "r", info.start, (info.nbytes,))
    dt = DTYPES[info.dtype]
    if info.nbytes == 0:
        return np.zeros(info.shape, dt)
    return np.memmap(info.file, dt, "r", info.start, info.shape)


class SafetensorsIndex:
    """All tensors of a checkpoint folder: `model.safetensors.index.json` + shards, or one file."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        index = self.root / "model.safetensors.index.json"
        self.tensors: dict[str, TensorInfo] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise SafetensorsError(f"{index}: not a valid index ({e})") from None
            headers: dict[str, dict[str, TensorInfo]] = {}
            for shard in sorted(set(weight_map.values())):
                if not (self.root / shard).exists():
                    users = sorted(k for k, v in weight_map.items() if v == shard)
                    raise SafetensorsError(f"{index}: shard {shard!r} is listed (for {len(users)} tensors, "
                                           f"e.g. {users[0]!r}) but {self.root / shard} does not exist")
                headers[shard], _ = read_header(self.root / shard)
            for name, shard in weight_map.items():
                if name not in headers[shard]:
                    raise SafetensorsError(f"{index}: tensor {name!r} is mapped to {shard!r}, "
                                           "which does not contain it")
                self.tensors[name] = headers[shard][name]
            for shard, infos in headers.items():
                unlisted = sorted(set(infos) - set(weight_map))
                if unlisted:
                    raise SafetensorsError(f"{self.root / shard}: tensors {unlisted[:5]} are not in {index.name}")
        elif (self.root / "model.safetensors").exists():
            self.tensors, _ = read_header(self.root / "model.safetensors")
        else:
            raise SafetensorsError(f"{self.root}: neither model.safetensors.index.json nor model.safetensors found")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return load_tensor(self.tensors[name])
        except KeyError:
            raise SafetensorsError(f"{self.root}: missing tensor {name!r}") from None

    def names(self) -> list[str]:
        return sorted(self.tensors)
