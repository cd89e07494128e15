"""Load a release-layout (or Kimi Linear HF) safetensors folder straight into a model.

This is the in-memory loader for small models and tests; the streaming Orbax converter
(`convert/`) uses the same name table, plan and value builders (`_plan.py`). Every
checkpoint tensor must be used exactly once and every parameter filled, or the load fails
naming what is wrong. With `vision=True` the MoonViT tower and projector (`vision_tower.*`,
`mm_projector.*`) are read too, into a `VisionModel` (`_vision.py`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..nn import K31ForCausalLM, abstract_model
from ._plan import make_plan
from ._transforms import CheckpointError, build_value, get_path
from ._safetensors import SafetensorsIndex, TensorReader
from ._vision import ModelWithVision, build_vision, vision_config_of

__all__ = ["CheckpointError", "load_hf_weights"]


@overload
def load_hf_weights(path: str | os.PathLike, config: ModelConfig | None = None, *, dtype: str | None = ...,
                    vision: Literal[False] = ..., **overrides) -> K31ForCausalLM: ...


@overload
def load_hf_weights(path: str | os.PathLike, config: ModelConfig | None = None, *, dtype: str | None = ...,
                    vision: Literal[True], **overrides) -> ModelWithVision: ...


def load_hf_weights(
    path: str | os.PathLike,
    config: ModelConfig | None = None,
    *,
    dtype: str | None = None,
    vision: bool = False,
    **overrides,
):
    """Build `K31ForCausalLM` from a safetensors checkpoint folder (`config.json` + weights);
    with `vision=True`, a `ModelWithVision(model, vision)`.

    MXFP4 experts stay packed when the config says `expert_weights="mxfp4"` (the default for
    the release config) and are decoded exactly with `expert_weights="bf16"`. `dtype`
    overrides the parameter/activation dtype (e.g. "float32" for exact comparisons); f32
    tensors of the release stay f32. Other keyword arguments override config fields
    (e.g. `expert_weights="bf16"`, `index_topk=None`; the config's own `vision` field only
    through `config`, since `vision` here is the flag below).
    vision: also build the `VisionModel` from `vision_tower.*` / `mm_projector.*`, in the
    model's dtype, on the default device; a config without a `vision_config` is a
    `CheckpointError`. Without it the vision tensors are not read.
    """
    path = Path(path)
    cfg = config or ModelConfig.from_hf(path)
    if dtype is not None:
        overrides["dtype"] = str(jnp.dtype(dtype))
    if overrides:
        cfg = cfg.replace(**overrides)
    if vision:
        vision_config_of(cfg, path)  # fail before reading the text model
    index = SafetensorsIndex(path)
    abstract = abstract_model(cfg)
    graphdef, abs_state = nnx.split(abstract)
    targets = nnx.to_pure_dict(abs_state)
    plan = make_plan(cfg, index.tensors, root=path, expert_weights=cfg.expert_weights, vision=False,
                     abstract=targets)
    arrays = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), targets)
    filled = jax.tree.map(lambda s: np.zeros(s.shape[:1] if s.ndim else (1,), bool), targets)
    with TensorReader() as reader:
        for entry in plan.entries:
            path_ = entry.source.path + ((entry.part,) if entry.part else ())
            dest, slot = get_path(arrays, path_), entry.source.slot
            value = build_value(entry, reader, cfg)
            want = dest.shape if slot is None else dest.shape[1:]
            if value.shape != want:
                raise CheckpointError(f"internal: {entry.describe()} built shape {list(value.shape)}, "
                                      f"expected {list(want)}")
            if slot is None:
                dest[...] = value.astype(dest.dtype)
                get_path(filled, path_)[...] = True
            else:
                dest[slot] = value.astype(dest.dtype)
                get_path(filled, path_)[slot] = True
    empty = [k for k, v in jax.tree_util.tree_leaves_with_path(filled) if not v.all()]
    if empty:
        raise CheckpointError(f"internal: parameters without a source: {[jax.tree_util.keystr(k) for k in empty]}")
    state = jax.tree.map(jnp.asarray, arrays)
    nnx.replace_by_pure_dict(abs_state, state)
    model = nnx.merge(graphdef, abs_state)
    if not vision:
        return model
    return ModelWithVision(model, build_vision(index, cfg, path))
