"""The per-leaf transforms between release tensors and stored k31jax leaves.

`expected_shapes` / `expected_dtypes`: what the release holds for a parameter slot;
`build_value(entry, reader, cfg)`: read an entry's source tensors and build the stored
value (transpose to `[in, out]`, conv `[C, 1, K] -> [K, C]`, AttnRes `[1, D] -> [D]`, A_log
tail check and padding, routed experts stacked verbatim or decoded); `unbuild_value` is its
exact inverse (export, fixtures); `canonical_tensors(cfg)` the release inventory of a
config. Spec: checkpoint_format.md §2-§6, mx_formats.md §3.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Literal

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..nn import abstract_model
from ..quant import mxfp4_dequantize_packed, mxfp4_quantize_packed
from ._names import F32_PARAMS, Source, param_sources
from ._safetensors import SAFETENSORS_DTYPES, TensorInfo

FLOAT_DTYPES = ("BF16", "F32", "F16")
E8M0_NAN = 0xFF


class CheckpointError(ValueError):
    """A checkpoint that does not match the config; the message names the files and tensors."""


Mode = Literal["tensor", "stack", "dequant", "init"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One stored leaf: its Orbax key, stored shape/dtype and the source tensors.

    mode: tensor = one source tensor through `source.transform`; stack = per-expert tensors
    stacked verbatim (`part` "packed"/"scale", or float `.weight`); dequant = per-expert
    (packed, scale) pairs decoded to `dtype`; init = no source (a freshly initialised
    indexer, `init_missing_indexer`).
    """

    key: tuple[str, ...]
    source: Source
    part: str | None
    shape: tuple[int, ...]
    dtype: np.dtype
    tensors: tuple[TensorInfo, ...]
    mode: Mode
    group: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def source_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def describe(self) -> str:
        slot = "" if self.source.slot is None else f"[{self.source.slot}]"
        return "/".join(self.source.path + ((self.part,) if self.part else ())) + slot


def get_path(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def expected_shapes(src: Source, shape: tuple[int, ...], cfg: ModelConfig) -> list[tuple[int, ...]]:
    """Accepted source shapes for a non-expert leaf slot of `shape`; the canonical one first."""
    t = src.transform
    if t == "linear":
        return [(shape[1], shape[0])]
    if t == "row":
        return [(1, shape[0]), tuple(shape)]
    if t == "conv":
        return [(shape[1], 1, shape[0])]
    if t == "a_log":
        h, n = cfg.kda_num_heads, shape[0]
        options = [(n,), (h,), (1, 1, h, 1)]
        if cfg.kda_gate_lower_bound is None:  # Kimi Linear stores [1, 1, H, 1]
            options = [(1, 1, h, 1), (h,), (n,)]
        return list(dict.fromkeys(options))
    return [tuple(shape)]


def expected_dtypes(src: Source) -> tuple[str, ...]:
    return ("F32",) if src.path in F32_PARAMS else FLOAT_DTYPES



def _nan_scales(block: np.ndarray, infos, what: str) -> None:
    bad = np.flatnonzero((block == E8M0_NAN).reshape(block.shape[0], -1).any(axis=1))
    if bad.size:
        info = infos[int(bad[0])]
        pos = np.unravel_index(int(np.flatnonzero(block[bad[0]].reshape(-1) == E8M0_NAN)[0]), block.shape[1:])
        raise CheckpointError(f"{info.file}: tensor {info.name!r} holds the E8M0 NaN scale byte 0xFF (first at "
                              f"{tuple(int(x) for x in pos)}; expected bytes 0x00..0xFE) (for {what})")


def _dequant(packed: np.ndarray, scale: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(mxfp4_dequantize_packed(jnp.asarray(packed), jnp.asarray(scale), dtype=jnp.dtype(dtype)))


def _init_value(entry: Entry, cfg: ModelConfig) -> np.ndarray:
    """A fresh indexer leaf (architecture.md §10.4): N(0, 0.02), k_norm weight 1, bias 0."""
    leaf = entry.source.path[-1]
    if leaf == "k_norm_weight":
        return np.ones(entry.shape, entry.dtype)
    if leaf == "k_norm_bias":
        return np.zeros(entry.shape, entry.dtype)
    rng = np.random.default_rng(zlib.crc32("/".join(entry.key).encode()))
    return (rng.standard_normal(entry.shape, np.float32) * cfg.initializer_range).astype(entry.dtype)


def forward_transform(src: Source, arr: np.ndarray, cfg: ModelConfig, info: TensorInfo) -> np.ndarray:
    """One source tensor -> its (slot of a) parameter value, in the source dtype."""
    t = src.transform
    if t == "linear":
        return arr.T
    if t == "conv":
        return arr[:, 0, :].T
    if t == "a_log":
        flat = arr.reshape(-1)
        tail = flat[cfg.kda_num_heads:]
        if np.any(tail != 0):
            raise CheckpointError(f"{info.file}: tensor {info.name!r}: entries {cfg.kda_num_heads}.. must be zero "
                                  f"padding (one value per head is used), found non-zero {tail[tail != 0][:4]}")
        return np.pad(flat, (0, cfg.kda_a_log_len - flat.size))
    if t in ("vector", "row"):
        return arr.reshape(-1)
    return arr


def build_value(entry: Entry, reader, cfg: ModelConfig, *, out: np.ndarray | None = None,
                chunk_bytes: int = 1 << 28) -> np.ndarray:
    """Read `entry`'s source tensors with `reader` (a `TensorReader`) and build the stored value,
    into `out` when given (C-contiguous, `entry.shape` / `entry.dtype`)."""
    what = entry.describe()
    if out is None:
        out = np.empty(entry.shape, entry.dtype)
    if entry.mode == "init":
        out[...] = _init_value(entry, cfg)
        return out
    if entry.mode == "stack":
        for e, info in enumerate(entry.tensors):
            if SAFETENSORS_DTYPES[info.dtype] == entry.dtype:
                reader.read_into(info, out[e])
            else:
                out[e] = reader.read(info, scratch=True).astype(entry.dtype)
        if entry.part == "scale":
            _nan_scales(out, entry.tensors, what)
        return out
    if entry.mode == "dequant":
        pairs = list(zip(entry.tensors[0::2], entry.tensors[1::2]))
        per = max(1, chunk_bytes // max(1, entry.nbytes // len(pairs)))
        for s in range(0, len(pairs), per):
            chunk = pairs[s:s + per]
            p = np.stack([reader.read(a) for a, _ in chunk])
            sc = np.stack([reader.read(b) for _, b in chunk])
            _nan_scales(sc, [b for _, b in chunk], what)
            out[s:s + len(chunk)] = _dequant(p, sc, entry.dtype)
        return out
    (info,) = entry.tensors
    value = forward_transform(entry.source, reader.read(info, scratch=True), cfg, info).reshape(out.shape)
    if entry.source.transform == "linear" and value.dtype == out.dtype and out.dtype.itemsize in _UINT:
        _transpose_into(out, value.T)
    else:
        _copy(out, value)
    return out


def build_values(entries: list[Entry], reader, cfg: ModelConfig, outs: list[np.ndarray]) -> list[np.ndarray]:
    """`build_value` for many entries into the preallocated `outs`, with every verbatim byte
    copy (the stacked MXFP4 experts: the bulk of a release) gathered into one
    `reader.read_many`, which reads them in file order in large sequential windows."""
    jobs, copied, rest = [], [], []
    for entry, out in zip(entries, outs):
        if entry.mode == "stack" and all(SAFETENSORS_DTYPES[i.dtype] == entry.dtype for i in entry.tensors):
            jobs.extend((info, out[e]) for e, info in enumerate(entry.tensors))
            copied.append((entry, out))
        else:
            rest.append((entry, out))
    reader.read_many(jobs)
    for entry, out in copied:
        if entry.part == "scale":
            _nan_scales(out, entry.tensors, entry.describe())
    for entry, out in rest:
        build_value(entry, reader, cfg, out=out)
    return outs


def _transpose_into(out: np.ndarray, src: np.ndarray, rows: int = 128) -> None:
    """out = src.T for a C-contiguous 2-D `src`, in row blocks: ~2x numpy's plain transposed
    copy (whose writes stride through the whole output)."""
    u = _UINT[out.dtype.itemsize]
    o, s = out.view(u), src.view(u)
    for i in range(0, s.shape[0], rows):
        o[:, i:i + rows] = s[i:i + rows].T


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _copy(out: np.ndarray, value: np.ndarray) -> None:
    """out[...] = value; same-dtype copies (transposes included) run on an unsigned-integer
    view, since numpy's loops for ml_dtypes' bfloat16 go element by element."""
    if value.dtype == out.dtype and out.dtype.itemsize in _UINT:
        u = _UINT[out.dtype.itemsize]
        np.copyto(out.view(u), value.view(u))
    else:
        np.copyto(out, value, casting="unsafe")


def unbuild_value(entry: Entry, value: np.ndarray, cfg: ModelConfig) -> list[tuple[TensorInfo, np.ndarray]]:
    """The exact inverse of `build_value`: the source tensors (as `entry.tensors` describe them)
    that a stored value came from. Float experts are re-quantised (floor rule) only when the
    entry decodes MXFP4 (`dequant`); every other path is byte-exact."""
    value = np.asarray(value)
    if entry.mode == "init":
        return []
    if entry.mode == "stack":
        return [(info, np.ascontiguousarray(value[e]).astype(SAFETENSORS_DTYPES[info.dtype], copy=False))
                for e, info in enumerate(entry.tensors)]
    if entry.mode == "dequant":
        out = []
        for e, (a, b) in enumerate(zip(entry.tensors[0::2], entry.tensors[1::2])):
            packed, scale = mxfp4_quantize_packed(jnp.asarray(value[e], jnp.float32), rule="floor")
            out += [(a, np.asarray(packed)), (b, np.asarray(scale))]
        return out
    (info,) = entry.tensors
    t = entry.source.transform
    if t == "linear":
        arr = value.T
    elif t == "conv":
        arr = value.T[:, None, :]
    elif t == "a_log":
        arr = value.reshape(-1)[:int(np.prod(info.shape))]
    else:
        arr = value
    return [(info, np.ascontiguousarray(arr.reshape(info.shape)).astype(SAFETENSORS_DTYPES[info.dtype], copy=False))]


def canonical_tensors(cfg: ModelConfig, *, style: str | None = None) -> list[tuple[str, str, tuple[int, ...]]]:
    """The release-layout inventory of the text model for `cfg`: `[(name, dtype, shape)]` in
    layer order, canonical spellings (K3 style `language_model.` names, or Kimi Linear
    `model.` names), bf16 weights, the release's f32 tensors, and the routed experts in
    `cfg.expert_weights` (MXFP4 weight_packed/weight_scale, or bf16 `.weight`)."""
    if style is None:
        style = "k3" if cfg.kda_gate_lower_bound is not None or cfg.use_attn_res else "kimi_linear"
    names = {"language_model.lm_head.weight"} if style == "k3" else {"lm_head.weight"}
    abstract = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
    out: list[tuple[str, str, tuple[int, ...]]] = []
    experts: list[tuple[Source, object]] = []

    def flush():  # the release keeps each expert's tensors together: expert-major, w1, w2, w3
        for e in range(len(experts[0][0].names) if experts else 0):
            for src, leaf in sorted(experts, key=lambda x: x[0].names[0].rsplit(".", 1)[-1]):
                p = src.names[e]
                if isinstance(leaf, dict):
                    out.append((p + ".weight_packed", "U8", tuple(leaf["packed"].shape[2:])))
                    out.append((p + ".weight_scale", "U8", tuple(leaf["scale"].shape[2:])))
                else:
                    out.append((p + ".weight", "BF16", tuple(leaf.shape[2:])))
        experts.clear()

    for src in param_sources(cfg, names):
        leaf = get_path(abstract, src.path)
        if src.transform == "experts":
            experts.append((src, leaf))
            continue
        if experts:
            flush()
        shape = tuple(leaf.shape[1:] if src.slot is not None else leaf.shape)
        out.append((src.names[0], expected_dtypes(src)[0], expected_shapes(src, shape, cfg)[0]))
    flush()
    return out
