"""Checkpoints: the release safetensors format and the k31jax Orbax format, and every way
between them and a model.

- Reading: the safetensors reader, the release name table and canonical layout, the
  conversion plan (`make_plan`: every stored leaf from its release tensors, or one
  `CheckpointError` listing every mismatch).
- Loading a model in memory from release safetensors (`load_hf_weights`), or from a converted
  Orbax checkpoint onto any shardings (`load_checkpoint`), with the vision tower and projector
  on request (`vision=True`, `load_checkpoint_vision`).
- Converting (`k31jax convert`, `k31jax export`), one package with the reader because both
  directions go through the same plan, transforms and checksum manifest::

      from k31jax import convert, export
      convert("Kimi-K3/", "k3-orbax/", verify=True)     # streamed, bounded memory
      model = k31jax.load_checkpoint("k3-orbax/")
      export("k3-orbax/", "Kimi-K3-again/")            # byte-exact release layout

  `verify_checkpoint("k3-orbax/", source="Kimi-K3/")` checks an existing checkpoint: every
  stored byte against its checksum manifest and, with the source, the round trip.
  `write_synthetic_release` writes a random (or given) model of any config in the release
  layout: fixtures, benchmarks, demos. Every patch of Orbax's save path lives in this package.

Both commands refuse a DST that overlaps SRC, lock DST for the run, publish atomically (an
existing DST is replaced only with `overwrite=True` and only if it is their own kind of
output or an empty folder) and leave nothing behind on failure: `DestinationError`,
`SourceOverlapError`, `DiskFullError`, and `Interrupted` when the `stop` event is set.
"""

from ._convert import ConvertResult, convert, describe_plan, read_source
from ._destination import DestinationError, DiskFullError, Interrupted, SourceOverlapError
from ._export import ExportResult, export
from ._hf_load import load_hf_weights
from ._manifest import IntegrityError
from ._orbax import (ASSETS_DIR, checkpoint_config, checkpoint_info, is_orbax_checkpoint, load_checkpoint,
                     load_checkpoint_vision, load_vision)
from ._plan import STORE_DTYPES, Plan, make_plan
from ._release_layout import hf_config_dict, release_layout, tensor_nbytes
from ._safetensors import SafetensorsError, SafetensorsIndex, ShardWriter, TensorReader, load_tensor, read_header
from ._synthetic import synthetic_config, write_synthetic_release
from ._transforms import CheckpointError
from ._values import NonFinite
from ._verify import VerifyResult, verify_checkpoint
from ._vision import ModelWithVision

__all__ = [
    # reading and loading
    "ASSETS_DIR", "CheckpointError", "IntegrityError", "ModelWithVision", "Plan", "STORE_DTYPES", "SafetensorsError",
    "SafetensorsIndex", "ShardWriter", "TensorReader", "checkpoint_config", "checkpoint_info", "hf_config_dict",
    "is_orbax_checkpoint", "load_checkpoint", "load_checkpoint_vision", "load_hf_weights", "load_tensor",
    "load_vision", "make_plan", "read_header", "release_layout", "tensor_nbytes",
    # converting
    "ConvertResult", "DestinationError", "DiskFullError", "ExportResult", "Interrupted", "NonFinite",
    "SourceOverlapError", "VerifyResult", "convert", "describe_plan", "export", "read_source", "synthetic_config",
    "verify_checkpoint", "write_synthetic_release",
]
