"""Checkpoint I/O: the safetensors reader, the HF name table, and loading."""

from ._hf_load import CheckpointError, load_hf_weights
from ._names import Source, detect_prefix, param_sources
from ._safetensors import SafetensorsError, SafetensorsIndex, TensorInfo, load_tensor, read_header

__all__ = ["CheckpointError", "SafetensorsError", "SafetensorsIndex", "Source", "TensorInfo",
           "detect_prefix", "load_hf_weights", "load_tensor", "param_sources", "read_header"]
