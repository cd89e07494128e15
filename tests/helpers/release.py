"""Helpers for the converter tests: a random model written in the release layout, and
surgery on release folders (rewrite shards, edit headers and configs)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
from flax import nnx

from helpers.model import tiny_config
from k31jax.ckpt import SafetensorsIndex, ShardWriter, TensorReader
from k31jax.ckpt._synthetic import bf16_exact, write_synthetic_release

# A small MoonViT-like vision config (only shapes matter to the converter).
VISION = {"vt_hidden_size": 32, "patch_size": 2, "vt_intermediate_size": 64, "qkv_hidden_size": 32, "vt_num_attention_heads": 2,
          "vt_num_hidden_layers": 2, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "mm_hidden_size": 32,
          "merge_kernel_size": [2, 2], "text_hidden_size": 64}


def release_ready_model(seed: int = 0, **overrides):
    """A tiny random model with packed MXFP4 experts whose parameters are exactly what a
    release checkpoint can hold (bf16 values, zero A_log padding); returns (model, params).

    Built from the abstract model with NumPy values (eager module construction is slow)."""
    import jax
    import jax.numpy as jnp

    from k31jax import abstract_model
    from k31jax.quant import mxfp4_quantize_packed

    cfg = tiny_config(expert_weights="mxfp4", **overrides)
    graphdef, state = nnx.split(abstract_model(cfg))
    rng = np.random.default_rng(seed)
    pure = nnx.to_pure_dict(state)

    def fill(kp, leaf):
        name = jax.tree_util.keystr(kp)
        if name.endswith("['packed']") or name.endswith("['scale']"):
            return None
        if "norm" in name and "proj" not in name:
            v = 1 + 0.05 * rng.standard_normal(leaf.shape)
        elif "conv" in name:
            v = 0.3 * rng.standard_normal(leaf.shape)
        else:
            v = 0.05 * rng.standard_normal(leaf.shape)
        return v.astype(np.float32).astype(leaf.dtype)

    params = jax.tree_util.tree_map_with_path(fill, pure)
    if "moe" in params:
        for w in ("w_gate", "w_up", "w_down"):
            shape = pure["moe"][w]["packed"].shape
            dense = 0.05 * rng.standard_normal(shape[:-1] + (shape[-1] * 2,)).astype(np.float32)
            packed, scale = mxfp4_quantize_packed(jnp.asarray(dense), rule="floor")
            params["moe"][w] = {"packed": np.asarray(packed), "scale": np.asarray(scale)}
    params = bf16_exact(params)
    if "kda" in params:
        params["kda"]["a_log"][:, cfg.kda_num_heads:] = 0
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state), params


def write_model_release(out: Path, model, params, *, vision: bool = True, num_shards: int = 3) -> Path:
    rng = np.random.default_rng(7)
    vision_params = None
    if vision:
        from k31jax.ckpt._release_layout import vision_tensors

        vision_params = {n: rng.standard_normal(s).astype(np.float32) for n, _, s in
                         vision_tensors(VISION, model.config.hidden_size)}
    return write_synthetic_release(out, model.config, params=params, num_shards=num_shards,
                         vision_config=VISION if vision else None, vision_params=vision_params)


def copy_release(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def tensors_of(folder: Path) -> dict[str, np.ndarray]:
    index = SafetensorsIndex(folder)
    with TensorReader() as r:
        return {n: r.read(i) for n, i in index.tensors.items()}


def rewrite(folder: Path, *, drop=(), replace=None, add=None, rename=None) -> None:
    """Rewrite a release folder in place: drop / replace (name -> (dtype, array)) / add
    (name -> (dtype, array), appended to the first shard) / rename tensors."""
    replace, add, rename = dict(replace or {}), dict(add or {}), dict(rename or {})
    index = SafetensorsIndex(folder)
    with TensorReader() as r:
        data = {n: (i.dtype, r.read(i)) for n, i in index.tensors.items()}
    first = sorted(index.shards)[0]
    for shard, (names, meta) in index.shards.items():
        entries = [(rename.get(n, n), *replace.get(n, data[n])) for n in names if n not in drop]
        if shard == first:
            entries += [(a, d, v) for a, (d, v) in add.items()]
        with ShardWriter(folder / shard, [(n, d, a.shape) for n, d, a in entries], meta) as w:
            for n, _, a in entries:
                w.write(n, a)
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        raw = json.loads(idx.read_text())
        wm = {}
        for n, shard in raw["weight_map"].items():
            if n in drop:
                continue
            wm[rename.get(n, n)] = shard
        for a in add:
            wm[a] = sorted(index.shards)[0]
        raw["weight_map"] = wm
        idx.write_text(json.dumps(raw, indent=2))


def shard_of(folder: Path, name: str) -> Path:
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        return folder / json.loads(idx.read_text())["weight_map"][name]
    return folder / "model.safetensors"


def edit_header(path: Path, fn) -> None:
    """Apply `fn(header_dict)` to a shard's JSON header, keeping the data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    fn(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def edit_config(folder: Path, fn) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    fn(raw.get("text_config", raw))
    path.write_text(json.dumps(raw, indent=2))


def leftovers(parent: Path, name: str) -> list[str]:
    """Temporary folders a conversion into `parent / name` may have left behind."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}.") or
                  p.name.startswith(f"{name}.partial_save"))
