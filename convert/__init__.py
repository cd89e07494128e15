"""The release safetensors <-> k31jax Orbax converter (`k31jax convert`, `k31jax export`).

    from convert import convert, export
    convert("Kimi-K3/", "k3-orbax/", verify=True)     # streamed, bounded memory
    model = k31jax.load_checkpoint("k3-orbax/")
    export("k3-orbax/", "Kimi-K3-again/")            # byte-exact release layout
"""

from ._convert import ConvertResult, convert, describe_plan, read_source
from ._export import ExportResult, export

__all__ = ["ConvertResult", "ExportResult", "convert", "describe_plan", "export", "read_source"]
