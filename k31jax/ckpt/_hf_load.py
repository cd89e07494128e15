"""Load a release-layout (or Kimi Linear HF) safetensors folder straight into a model.

This is the in-memory loader for small models and tests; the streaming Orbax converter
(`convert/`) uses the same name table. Every checkpoint tensor must be used exactly once
and every parameter filled, or the load fails naming what is wrong.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..nn import K31ForCausalLM
from ._names import Source, param_sources
from ._safetensors import SafetensorsIndex

# Parts of the release that are not the text model (loaded by the vision code, if at all).
_NON_TEXT_PREFIXES = ("vision_tower.", "mm_projector.")


class CheckpointError(ValueError):
    """A checkpoint that does not match the config; the message names the tensors."""


def _decode_mxfp4(packed: np.ndarray, scale: np.ndarray, name: str) -> np.ndarray:
    from ..quant import mxfp4_dequantize_packed

    if packed.dtype != np.uint8 or scale.dtype != np.uint8:
        raise CheckpointError(f"{name}: MXFP4 weight_packed/weight_scale must be U8, got "
                              f"{packed.dtype}/{scale.dtype}")
    if packed.shape[-1] * 2 != scale.shape[-1] * 32 or packed.shape[:-1] != scale.shape[:-1]:
        raise CheckpointError(f"{name}: weight_packed {list(packed.shape)} and weight_scale "
                              f"{list(scale.shape)} disagree (expected [out, in/2] and [out, in/32])")
    if (np.asarray(scale) == 0xFF).any():
        raise CheckpointError(f"{name}.weight_scale: contains the E8M0 NaN byte 0xFF")
    return np.asarray(mxfp4_dequantize_packed(jnp.asarray(packed), jnp.asarray(scale), dtype=jnp.float32))


def _expert_value(index: SafetensorsIndex, prefix: str, used: set[str]) -> np.ndarray:
    if prefix + ".weight" in index:
        used.add(prefix + ".weight")
        return np.asarray(index[prefix + ".weight"], np.float32)
    packed, scale = prefix + ".weight_packed", prefix + ".weight_scale"
    if packed in index and scale in index:
        used.update((packed, scale))
        return _decode_mxfp4(index[packed], index[scale], prefix)
    raise CheckpointError(f"{index.root}: missing routed expert weight {prefix!r} (expected "
                          f"{prefix}.weight, or {prefix}.weight_packed + .weight_scale)")


def _packed_experts(index: SafetensorsIndex, src: Source, used: set[str]) -> tuple[np.ndarray, np.ndarray]:
    """Stack per-expert `weight_packed` / `weight_scale` bytes into `[E, out, in/2]`, `[E, out, in/32]`."""
    packed, scale = [], []
    for prefix in src.names:
        p, s = prefix + ".weight_packed", prefix + ".weight_scale"
        if p not in index or s not in index:
            raise CheckpointError(f"{index.root}: missing routed expert weight {prefix!r}: expert_weights="
                                  f"'mxfp4' needs {p} and {s} (load bf16 experts with expert_weights='bf16')")
        pa, sa = index[p], index[s]
        if pa.dtype != np.uint8 or sa.dtype != np.uint8:
            raise CheckpointError(f"{prefix}: weight_packed/weight_scale must be U8, got {pa.dtype}/{sa.dtype}")
        if (np.asarray(sa) == 0xFF).any():
            raise CheckpointError(f"{s}: contains the E8M0 NaN byte 0xFF")
        used.update((p, s))
        packed.append(np.asarray(pa))
        scale.append(np.asarray(sa))
    return np.stack(packed), np.stack(scale)


def _source_value(index: SafetensorsIndex, src: Source, cfg: ModelConfig, used: set[str]) -> np.ndarray:
    if src.transform == "experts":
        return np.stack([_expert_value(index, p, used) for p in src.names])
    (name,) = src.names
    if name not in index:
        raise CheckpointError(f"{index.root}: missing tensor {name!r} (for parameter "
                              f"{'/'.join(src.path)}{'' if src.slot is None else f'[{src.slot}]'})")
    used.add(name)
    arr = np.asarray(index[name])
    if src.transform == "linear":
        if arr.ndim != 2:
            raise CheckpointError(f"{name}: expected a 2-D [out, in] weight, got shape {list(arr.shape)}")
        return arr.T
    if src.transform == "conv":
        if arr.ndim != 3 or arr.shape[1] != 1:
            raise CheckpointError(f"{name}: expected a depthwise conv [C, 1, K], got {list(arr.shape)}")
        return arr[:, 0, :].T
    if src.transform == "a_log":
        flat = arr.reshape(-1)
        if flat.size > cfg.kda_a_log_len:
            raise CheckpointError(f"{name}: {flat.size} values, expected kda_a_log_len={cfg.kda_a_log_len}")
        tail = flat[cfg.kda_num_heads:]
        if np.any(tail != 0):
            raise CheckpointError(f"{name}: entries {cfg.kda_num_heads}.. must be zero padding (only one "
                                  f"value per head is used), found non-zero {tail[tail != 0][:4]}")
        return np.pad(flat, (0, cfg.kda_a_log_len - flat.size))
    if src.transform == "vector":
        return arr.reshape(-1)
    return arr


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _assign(arrays, filled, path, slot, value, index, names=()) -> None:
    """Write one source's value into its (slice of a) parameter, checking the shape."""
    dest = _get(arrays, path)
    want = dest.shape if slot is None else dest.shape[1:]
    if value.shape != want:
        what = names[0] + (" …" if len(names) > 1 else "") if names else "/".join(path)
        raise CheckpointError(f"{index.root}: {what} gives {'/'.join(path)} shape {list(value.shape)}, "
                              f"expected {list(want)} from config.json")
    if slot is None:
        dest[...] = value.astype(dest.dtype)
        _get(filled, path)[...] = True
    else:
        dest[slot] = value.astype(dest.dtype)
        _get(filled, path)[slot] = True


def load_hf_weights(
    path: str | os.PathLike,
    config: ModelConfig | None = None,
    *,
    dtype: str | None = None,
    **overrides,
) -> K31ForCausalLM:
    """Build `K31ForCausalLM` from a safetensors checkpoint folder (`config.json` + weights).

    MXFP4 experts stay packed when the config says `expert_weights="mxfp4"` (the default for
    the release config) and are decoded exactly with `expert_weights="bf16"`. `dtype`
    overrides the parameter/activation dtype (e.g. "float32" for exact comparisons); f32
    tensors of the release stay f32. Other keyword arguments override config fields
    (e.g. `expert_weights="bf16"`, `index_topk=None`).
    """
    path = Path(path)
    cfg = config or ModelConfig.from_hf(path)
    if dtype is not None:
        overrides["dtype"] = str(jnp.dtype(dtype))
    if overrides:
        cfg = cfg.replace(**overrides)
    index = SafetensorsIndex(path)
    abstract = nnx.eval_shape(lambda: K31ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    targets = nnx.to_pure_dict(abs_state)
    arrays = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), targets)
    filled = jax.tree.map(lambda s: np.zeros(s.shape[:1] if s.ndim else (1,), bool), targets)
    used: set[str] = set()
    for src in param_sources(cfg, index.names()):
        try:
            dest = _get(arrays, src.path)
        except KeyError:
            raise CheckpointError(f"internal: no parameter {'/'.join(src.path)} for config") from None
        if isinstance(dest, dict):  # packed MXFP4 experts: copy the bytes verbatim
            for part, value in zip(("packed", "scale"), _packed_experts(index, src, used)):
                _assign(arrays, filled, src.path + (part,), src.slot, value, index)
            continue
        value = _source_value(index, src, cfg, used)
        _assign(arrays, filled, src.path, src.slot, value, index, src.names)
    unused = sorted(n for n in index.names() if n not in used and not n.startswith(_NON_TEXT_PREFIXES))
    if unused:
        raise CheckpointError(f"{index.root}: {len(unused)} tensors are not used by the config "
                              f"(unknown names, or a config that disagrees with the weights): {unused[:8]}")
    empty = [k for k, v in jax.tree_util.tree_leaves_with_path(filled) if not v.all()]
    if empty:
        raise CheckpointError(f"internal: parameters without a source: {[jax.tree_util.keystr(k) for k in empty]}")
    state = jax.tree.map(jnp.asarray, arrays)
    nnx.replace_by_pure_dict(abs_state, state)
    return nnx.merge(graphdef, abs_state)
