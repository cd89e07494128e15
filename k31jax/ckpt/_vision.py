"""The vision tower and projector of a checkpoint folder as ready modules (`VisionModel`).

Both checkpoint kinds hold the release tensors verbatim (`vision_tower.*`, `mm_projector.*`,
checkpoint_format.md §3.7): a converted Orbax checkpoint under `vision/`, a release-layout
safetensors folder in its shards. `k31jax.vision.load_vision_model` turns them into modules;
this module checks that the config has a `vision_config` and names the folder in every error.
`load_checkpoint(..., vision=True)` and `load_hf_weights(..., vision=True)` return the text
model and this `VisionModel` together as a `ModelWithVision`; `load_checkpoint_vision`
(`_orbax.py`) reads the vision model alone from either kind of folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..config import ModelConfig, VisionConfig
from ..nn import K31ForCausalLM
from ..sharding import Rules
from ..vision import VisionLoadError, VisionModel, load_vision_model
from ._transforms import CheckpointError


class ModelWithVision(NamedTuple):
    """The text model and the vision model of one checkpoint (`model, vision = ...`)."""

    model: K31ForCausalLM
    vision: VisionModel


def vision_config_of(cfg: ModelConfig, path: str | os.PathLike) -> VisionConfig:
    """`cfg.vision`, or a `CheckpointError` naming the folder when its config has none."""
    if cfg.vision is None:
        raise CheckpointError(f"{Path(path)}: vision=True, but the checkpoint's config has no vision_config "
                              "(a text-only checkpoint: there is no vision tower to load)")
    return cfg.vision


def build_vision(tensors, cfg: ModelConfig, path: str | os.PathLike, *, dtype=None,
                 mesh: jax.sharding.Mesh | None = None, rules: Rules | str | None = None,
                 sharding: jax.sharding.Sharding | None = None) -> VisionModel:
    """`load_vision_model` over the release tensors of the checkpoint at `path` (for errors),
    with `cfg.vision` (a `CheckpointError` without one); dtype: default `cfg.dtype`."""
    vcfg = vision_config_of(cfg, path)
    try:
        return load_vision_model(tensors, vcfg, dtype=str(jnp.dtype(dtype or cfg.dtype)), mesh=mesh, rules=rules,
                                 sharding=sharding)
    except VisionLoadError as e:
        raise VisionLoadError(f"{Path(path)}: {e}") from None

