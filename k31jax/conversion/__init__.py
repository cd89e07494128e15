"""The release safetensors <-> k31jax Orbax converter (`k31jax convert`, `k31jax export`).

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
from ._synthetic import synthetic_config, write_synthetic_release
from ._values import NonFinite
from ._verify import VerifyResult, verify_checkpoint

__all__ = ["ConvertResult", "DestinationError", "DiskFullError", "ExportResult", "Interrupted", "NonFinite",
           "SourceOverlapError", "VerifyResult", "convert", "describe_plan", "export", "read_source",
           "synthetic_config", "verify_checkpoint", "write_synthetic_release"]
