"""Checkpoint formats and loading: the safetensors reader, the release name table and
canonical layout, the conversion plan, and loading a model (in memory from release
safetensors, or from a converted k31jax Orbax checkpoint onto any shardings), with the
vision tower and projector on request (`vision=True`, `load_checkpoint_vision`)."""

from ._hf_load import load_hf_weights
from ._manifest import IntegrityError
from ._orbax import (ASSETS_DIR, checkpoint_config, checkpoint_info, is_orbax_checkpoint, load_checkpoint,
                     load_checkpoint_vision, load_vision)
from ._plan import CheckpointError, Plan, make_plan
from ._release_layout import hf_config_dict, release_layout
from ._safetensors import SafetensorsError, SafetensorsIndex, ShardWriter, TensorReader, load_tensor, read_header
from ._vision import ModelWithVision

__all__ = ["ASSETS_DIR", "CheckpointError", "IntegrityError", "ModelWithVision", "Plan", "SafetensorsError", "SafetensorsIndex",
           "ShardWriter", "TensorReader", "checkpoint_config", "checkpoint_info", "hf_config_dict",
           "is_orbax_checkpoint", "load_checkpoint", "load_checkpoint_vision", "load_hf_weights", "load_tensor",
           "load_vision", "make_plan", "read_header", "release_layout"]
