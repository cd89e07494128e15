"""A minimal, dependency-free safetensors reader (raw header + memory-mapped buffers).

Reads U8/I8/BF16/F16/F32/F64/I32/I64/BOOL tensors (and F8/F4 as raw bytes) without torch.
Every error names the file and the tensor.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np

SAFETENSORS_DTYPES = {
    "BOOL": np.dtype(bool), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32), "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(np.uint8),
}
@contextlib.contextmanager
def no_gc():
    """Pause the cyclic GC while building hundreds of thousands of small objects (a
    full-size index): its periodic passes otherwise dominate the run time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_ITEMSIZE = {k: v.itemsize for k, v in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A malformed or inconsistent safetensors file; the message names file and tensor."""


class TensorInfo(NamedTuple):
    """One tensor of a safetensors file: dtype, shape and absolute byte range in `file`."""

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
        n = math.prod(self.shape)
        if self.dtype == "F4":
            return (n + 1) // 2
        return n * SAFETENSORS_DTYPES[self.dtype].itemsize


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
            raw_header = f.read(n)
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: no such file") from None
    try:
        header = json.loads(raw_header)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: corrupt JSON header ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    # The format's metadata is a string -> string map; export writes it back verbatim.
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings, got {meta!r:.200}")
    base = 8 + n
    infos = {}
    for name, h in header.items():
        try:
            dtype, shape, (a, b) = h["dtype"], h["shape"], h["data_offsets"]
            # integers only: 16.0, "16", true or Infinity in a shape or an offset are malformed
            if not isinstance(dtype, str) or not isinstance(shape, list) or not all(
                    type(x) is int and x >= 0 for x in (*shape, a, b)):
                raise TypeError
            shape = tuple(shape)
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry {h!r:.200} (expected "
                                   "dtype: string, shape: non-negative integers, data_offsets: two integers)") from None
        if dtype not in SAFETENSORS_DTYPES and dtype != "F4":
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        if not 0 <= a <= b:
            raise SafetensorsError(f"{path}: tensor {name!r} has invalid data_offsets [{a}, {b}]")
        info = TensorInfo(name, dtype, shape, base + a, base + b, path)
        if b - a != (math.prod(shape) * _ITEMSIZE[dtype] if dtype != "F4" else (math.prod(shape) + 1) // 2):
            raise SafetensorsError(f"{path}: tensor {name!r} holds {info.nbytes} bytes, but dtype {dtype} "
                                   f"and shape {list(shape)} need {info.expected_nbytes()}")
        infos[name] = info
    data_size = size - base
    ordered = sorted(infos.values(), key=lambda t: (t.start, t.end))
    needed = max((t.end - base for t in ordered), default=0)
    if needed > data_size:
        tiled = all(x.end == y.start for x, y in zip(ordered, ordered[1:])) and (not ordered or ordered[0].start == base)
        if tiled:  # a consistent header over a short file
            cut = next(t for t in ordered if t.end > size)
            raise SafetensorsError(f"{path}: truncated file: the header describes {needed} data bytes but the "
                                   f"file holds {data_size} ({needed - data_size} missing; tensor {cut.name!r} "
                                   f"and later are cut short)")
        bad = next(t for t in ordered if t.end > size)
        raise SafetensorsError(f"{path}: tensor {bad.name!r} data_offsets [{bad.start - base}, {bad.end - base}] "
                               f"lie outside the file's {data_size}-byte data section")
    for x, y in zip(ordered, ordered[1:]):
        if y.start < x.end:
            raise SafetensorsError(f"{path}: tensors {x.name!r} [{x.start - base}, {x.end - base}] and {y.name!r} "
                                   f"[{y.start - base}, {y.end - base}] overlap")
    return infos, meta


def load_tensor(info: TensorInfo) -> np.ndarray:
    """The tensor as a read-only numpy array backed by a memory map (F4 as raw uint8 bytes)."""
    if info.dtype == "F4":
        return np.memmap(info.file, np.uint8, "r", info.start, (info.nbytes,))
    dt = SAFETENSORS_DTYPES[info.dtype]
    if info.nbytes == 0:
        return np.zeros(info.shape, dt)
    return np.memmap(info.file, dt, "r", info.start, info.shape)


_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")


def _check_shard_set(index: Path, listed: set[str]) -> None:
    """A numbered shard set (`model-00001-of-00096.safetensors`, ...) must be complete: every
    number 1..N listed, and no numbered file on disk left out of the index."""
    sets: dict[tuple[str, str], set[int]] = {}
    widths: dict[tuple[str, str], int] = {}
    for shard in listed:
        m = _SHARD_RE.match(shard)
        if m:
            key = (m["stem"], m["n"])
            sets.setdefault(key, set()).add(int(m["i"]))
            widths[key] = len(m["i"])
    for (stem, n), have in sorted(sets.items()):
        gaps = sorted(set(range(1, int(n) + 1)) - have)
        if gaps:
            names = [f"{stem}-{i:0{widths[(stem, n)]}d}-of-{n}.safetensors" for i in gaps]
            state = ["absent" if not (index.parent / f).exists() else "present but unlisted" for f in names]
            raise SafetensorsError(
                f"{index}: missing shard {names[0]} ({state[0]}; {len(gaps)} of {int(n)} shards missing: "
                f"{names[:4]}): the index maps tensors only to shards {sorted(have)[:8]}"
                f"{' ...' if len(have) > 8 else ''} of {int(n)}, so the tensors stored in the missing "
                "shard(s) are unaccounted for")
    on_disk = {p.name for p in index.parent.glob("*.safetensors") if _SHARD_RE.match(p.name)}
    unlisted = sorted(on_disk - listed)
    if unlisted:
        raise SafetensorsError(f"{index}: shard files {unlisted[:4]} are on disk but not in the index "
                               "(their tensors would be silently skipped)")


class SafetensorsIndex:
    """All tensors of a checkpoint folder: `model.safetensors.index.json` + shards, or one file.

    Only headers are read. `shards` keeps each file's tensor order and `__metadata__`.
    """

    def __init__(self, root: str | os.PathLike):
        with no_gc():
            self._read(Path(root))

    def _read(self, root: Path) -> None:
        self.root = root
        index = self.root / "model.safetensors.index.json"
        self.tensors: dict[str, TensorInfo] = {}
        self.shards: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.index_metadata: dict = {}
        if index.exists():
            try:
                raw = json.loads(index.read_text())
                weight_map = raw["weight_map"]
                if not isinstance(weight_map, dict):
                    raise KeyError("weight_map is not an object")
                bad = [(k, v) for k, v in weight_map.items() if not isinstance(v, str)]
                if bad:
                    raise TypeError(f"weight_map maps {bad[0][0]!r} to {bad[0][1]!r}, expected a shard file name"
                                    f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise SafetensorsError(f"{index}: not a valid index ({e})") from None
            self.index_metadata = raw.get("metadata") or {}
            listed = set(weight_map.values())
            for shard in sorted(listed):
                if not (self.root / shard).exists():
                    users = sorted(k for k, v in weight_map.items() if v == shard)
                    raise SafetensorsError(f"{index}: shard {shard!r} is listed (for {len(users)} tensors, "
                                           f"e.g. {users[0]!r}) but {self.root / shard} does not exist")
            _check_shard_set(index, listed)
            headers: dict[str, dict[str, TensorInfo]] = {}
            for shard in sorted(listed):
                headers[shard], meta = read_header(self.root / shard)
                self.shards[shard] = (sorted(headers[shard], key=lambda k: headers[shard][k].start), meta)
            for name, shard in weight_map.items():
                if name not in headers[shard]:
                    raise SafetensorsError(f"{index}: tensor {name!r} is mapped to {shard!r}, "
                                           "which does not contain it")
                self.tensors[name] = headers[shard][name]
            for shard, infos in headers.items():
                unlisted = sorted(k for k in infos if k not in weight_map)
                if unlisted:
                    raise SafetensorsError(f"{self.root / shard}: tensors {unlisted[:5]} are not in {index.name}")
        elif (self.root / "model.safetensors").exists():
            self.tensors, meta = read_header(self.root / "model.safetensors")
            self.shards["model.safetensors"] = (sorted(self.tensors, key=lambda k: self.tensors[k].start), meta)
        else:
            shards = sorted(p.name for p in self.root.glob("*.safetensors")) if self.root.is_dir() else []
            hint = f" (found {shards[:3]} without an index)" if shards else ""
            raise SafetensorsError(f"{self.root}: neither model.safetensors.index.json nor model.safetensors "
                                   f"found{hint}")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return load_tensor(self.tensors[name])
        except KeyError:
            raise SafetensorsError(f"{self.root}: missing tensor {name!r}") from None

    def names(self) -> list[str]:
        return sorted(self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


# --------------------------------------------------------------------------- streaming I/O
class TensorReader:
    """Reads tensors with positioned reads into caller-owned buffers (no memory maps, so the
    resident set is only what the caller allocates). Keeps one open handle per file.

    `drop_cache=True` is for streaming a checkpoint once (the converter): bytes read one
    tensor at a time are dropped from the page cache after the read, and `read_many` reads
    with O_DIRECT where the file system allows it, so the page cache is never filled."""

    _ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffer addresses aligned to the block size

    def __init__(self, *, drop_cache: bool = False, window_bytes: int = 32 << 20):
        self._files: dict[Path, int] = {}
        self._direct: dict[Path, int | None] = {}
        self._scratch = np.empty(0, np.uint8)
        self._window = np.empty(0, np.uint8)
        self.window_bytes = -(-window_bytes // self._ALIGN) * self._ALIGN
        self.bytes_read = 0
        self.drop_cache = drop_cache

    def _fd(self, path: Path) -> int:
        fd = self._files.get(path)
        if fd is None:
            fd = self._files[path] = os.open(path, os.O_RDONLY)
        return fd

    def _direct_fd(self, path: Path) -> int | None:
        """An O_DIRECT handle when asked for (drop_cache) and supported, else None."""
        if path not in self._direct:
            fd = None
            if self.drop_cache and hasattr(os, "O_DIRECT"):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                except OSError:  # tmpfs and some network file systems refuse O_DIRECT
                    fd = None
            self._direct[path] = fd
        return self._direct[path]

    @staticmethod
    def _byte_view(info: TensorInfo, out: np.ndarray) -> memoryview:
        if not out.flags.c_contiguous:
            raise SafetensorsError(f"{info.file}: tensor {info.name!r}: destination is not contiguous")
        view = memoryview(out.reshape(-1).view(np.uint8))
        if len(view) != info.nbytes:
            raise SafetensorsError(f"{info.file}: tensor {info.name!r} holds {info.nbytes} bytes, "
                                   f"but the destination has {len(view)}")
        return view

    def read_into(self, info: TensorInfo, out: np.ndarray) -> np.ndarray:
        """Fill the C-contiguous `out` (any dtype/shape of `info.nbytes` bytes) from the file."""
        view = self._byte_view(info, out)
        fd, done = self._fd(info.file), 0
        while done < info.nbytes:
            n = os.preadv(fd, [view[done:]], info.start + done)
            if n <= 0:
                raise SafetensorsError(f"{info.file}: tensor {info.name!r} is cut short at byte "
                                       f"{info.start + done} (truncated file?)")
            done += n
        if self.drop_cache:
            os.posix_fadvise(fd, info.start, info.nbytes, os.POSIX_FADV_DONTNEED)
        self.bytes_read += info.nbytes
        return out

    def read_many(self, jobs: list[tuple[TensorInfo, np.ndarray]], *, max_gap: int = 1 << 20) -> None:
        """Fill many destinations at once: the tensors are read in file order, in windows of
        `window_bytes` that span neighbouring tensors (gaps up to `max_gap` are read through),
        and copied out of the window. One large sequential read per window instead of one
        read per tensor; with O_DIRECT the bytes go from the disk to the window without a
        page-cache copy."""
        views = sorted(((info, self._byte_view(info, out)) for info, out in jobs),
                       key=lambda j: (str(j[0].file), j[0].start))
        i = 0
        while i < len(views):  # one run of neighbouring tensors of one file per pass
            j = i + 1
            while (j < len(views) and views[j][0].file == views[i][0].file
                   and views[j][0].start - views[j - 1][0].end <= max_gap):
                j += 1
            self._read_run(views[i:j])
            i = j

    def _read_run(self, run: list[tuple[TensorInfo, memoryview]]) -> None:
        path = run[0][0].file
        fd = self._direct_fd(path)
        align = self._ALIGN if fd is not None else 1
        fd = self._fd(path) if fd is None else fd
        if self._window.nbytes < self.window_bytes:  # one aligned window, reused by every run
            raw = np.empty(self.window_bytes + self._ALIGN, np.uint8)
            skip = -raw.ctypes.data % self._ALIGN
            self._window = raw[skip:skip + self.window_bytes]
        end = max(info.end for info, _ in run)
        pos = run[0][0].start // align * align
        k = 0  # first tensor not yet completely copied
        while pos < end:
            want = min(self.window_bytes, -(-(end - pos) // align) * align)
            got = self._fill(fd, pos, want, direct=align > 1)
            stop = pos + got
            for info, view in run[k:]:
                if info.start >= stop:
                    break
                lo, hi = max(info.start, pos), min(info.end, stop)
                if hi > lo:
                    view[lo - info.start:hi - info.start] = self._window[lo - pos:hi - pos].data
            while k < len(run) and run[k][0].end <= stop:
                k += 1
            if got < want and k < len(run):  # end of file before the last tensor's end
                info = run[k][0]
                raise SafetensorsError(f"{info.file}: tensor {info.name!r} is cut short at byte {stop} "
                                       f"(truncated file?)")
            if got < want:
                break
            pos = stop
        if align == 1 and self.drop_cache:
            os.posix_fadvise(fd, run[0][0].start, end - run[0][0].start, os.POSIX_FADV_DONTNEED)
        self.bytes_read += sum(info.nbytes for info, _ in run)

    def _fill(self, fd: int, pos: int, want: int, *, direct: bool) -> int:
        """Read up to `want` bytes at `pos` into the window; fewer only at the end of the file."""
        got = 0
        while got < want:
            n = os.preadv(fd, [self._window[got:want].data], pos + got)
            got += max(n, 0)
            if n <= 0 or (direct and got % self._ALIGN):  # a direct read stops short only at the end
                break
        return got

    def read(self, info: TensorInfo, *, scratch: bool = False) -> np.ndarray:
        """The tensor as a numpy array (F4 as raw uint8 bytes): a fresh one, or with
        `scratch=True` a view of this reader's reusable buffer, valid until its next
        scratch read (saves page faults on hot paths)."""
        dtype, shape = (np.dtype(np.uint8), (info.nbytes,)) if info.dtype == "F4" else (SAFETENSORS_DTYPES[info.dtype], info.shape)
        if not scratch:
            return self.read_into(info, np.empty(shape, dtype))
        if self._scratch.nbytes < info.nbytes:
            self._scratch = np.empty(max(info.nbytes, 2 * self._scratch.nbytes), np.uint8)
        view = self._scratch[:info.nbytes].view(dtype).reshape(shape)
        return self.read_into(info, view)

    def close(self) -> None:
        for fd in [*self._files.values(), *self._direct.values()]:
            if fd is not None:
                os.close(fd)
        self._files.clear()
        self._direct.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


SAFETENSORS_DTYPE_NAMES = {np.dtype(bool): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
               np.dtype(np.int16): "I16", np.dtype(np.uint16): "U16", np.dtype(np.int32): "I32",
               np.dtype(np.uint32): "U32", np.dtype(np.int64): "I64", np.dtype(np.uint64): "U64",
               np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
               np.dtype(np.float32): "F32", np.dtype(np.float64): "F64",
               np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2"}


def header_bytes(entries, metadata: dict[str, str] | None = None) -> tuple[bytes, list[tuple[int, int]]]:
    """The 8-byte length + JSON header for `entries` = [(name, dtype, shape)] laid out in order;
    also each tensor's (start, end) offsets relative to the data section."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offsets, pos = [], 0
    for name, dtype, shape in entries:
        n = math.prod(shape)
        size = (n + 1) // 2 if dtype == "F4" else n * _ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(map(int, shape)), "data_offsets": [pos, pos + size]}
        offsets.append((pos, pos + size))
        pos += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


class ShardWriter:
    """Writes one safetensors file whose layout is fixed up front: the header is written on
    open and each tensor is written at its offset, in any order (`write`), or never (`sparse`
    files keep unwritten data as holes)."""

    def __init__(self, path: str | os.PathLike, entries, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        with no_gc():
            self._open(entries, metadata)

    def _open(self, entries, metadata) -> None:
        head, offsets = header_bytes(entries, metadata)
        base = len(head)
        self.infos = {name: TensorInfo(name, dtype, tuple(map(int, shape)), base + a, base + b, self.path)
                      for (name, dtype, shape), (a, b) in zip(entries, offsets)}
        self.size = base + (offsets[-1][1] if offsets else 0)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, head, 0)
        os.ftruncate(self._fd, self.size)

    def write(self, name: str, array: np.ndarray) -> None:
        info = self.infos[name]
        buf = np.ascontiguousarray(array)
        if buf.nbytes != info.nbytes:
            raise SafetensorsError(f"{self.path}: tensor {name!r} needs {info.nbytes} bytes "
                                   f"({info.dtype} {list(info.shape)}), got {buf.nbytes}")
        view, done = memoryview(buf.reshape(-1).view(np.uint8)), 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], info.start + done)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
