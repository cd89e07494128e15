"""Checkpoint I/O: the safetensors reader, the HF name table, the conversion plan, loading
(in memory from safetensors, or from a converted Orbax checkpoint)."""

from ._hf_load import load_hf_weights
from ._names import Source, detect_prefix, param_sources, stack_layers
from ._orbax import checkpoint_config, checkpoint_info, load_checkpoint, load_vision
from ._plan import CheckpointError, Entry, Plan, canonical_tensors, make_plan
from ._safetensors import (SafetensorsError, SafetensorsIndex, ShardWriter, TensorInfo, TensorReader,
                           load_tensor, read_header)

__all__ = ["CheckpointError", "Entry", "Plan", "SafetensorsError", "SafetensorsIndex", "ShardWriter", "Source",
           "TensorInfo", "TensorReader", "canonical_tensors", "checkpoint_config", "checkpoint_info",
           "detect_prefix", "load_checkpoint", "load_hf_weights", "load_tensor", "load_vision", "make_plan",
           "param_sources", "read_header", "stack_layers"]
