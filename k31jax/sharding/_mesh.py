"""Meshes with the four k31jax axes `data, fsdp, expert, tensor`, all `AxisType.Auto`."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType

from ._rules import MESH_AXES, Rules, current_rules, get_rules, use_rules


def parse_mesh(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """`"expert=8,tensor=8"` (or a dict) -> sizes of all four axes (missing ones are 1)."""
    if spec is None:
        sizes: dict[str, int] = {}
    elif isinstance(spec, Mapping):
        sizes = {str(k): int(v) for k, v in spec.items()}
    else:
        sizes = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if "=" not in part:
                raise ValueError(f"mesh {spec!r}: expected axis=size pairs like 'expert=8,tensor=8'")
            k, v = part.split("=", 1)
            sizes[k.strip()] = int(v)
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh {spec!r}: unknown axes {unknown}; the axes are {list(MESH_AXES)}")
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
        raise ValueError(f"mesh {spec!r}: axis sizes must be >= 1, got {bad}")
    return {ax: sizes.get(ax, 1) for ax in MESH_AXES}


def mesh_str(sizes: Mapping[str, int]) -> str:
    parts = [f"{ax}={n}" for ax, n in sizes.items() if n > 1]
    return ",".join(parts) or "single device"


def make_mesh(
    spec: str | Mapping[str, int] | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    **sizes: int,
) -> jax.sharding.Mesh:
    """A device mesh with axes `("data", "fsdp", "expert", "tensor")`, all `AxisType.Auto`.

    `make_mesh(expert=4, tensor=2)` or `make_mesh("expert=4,tensor=2")`. Axes left out have
    size 1; the product must equal the number of devices used (all of `jax.devices()` by
    default, across processes after `jax.distributed.initialize`).
    """
    shape = parse_mesh({**parse_mesh(spec), **{k: v for k, v in sizes.items()}} if sizes else spec)
    n = math.prod(shape.values())
    devs = list(jax.devices() if devices is None else devices)
    if n != len(devs):
        if devices is None and n < len(devs):
            devs = devs[:n]
        else:
            raise ValueError(f"mesh {mesh_str(shape)} needs {n} devices, got {len(devs)}")
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if devices is None and n == len(jax.devices()):
        return jax.make_mesh(tuple(shape.values()), MESH_AXES, axis_types=axis_types)
    return jax.sharding.Mesh(np.asarray(devs).reshape(tuple(shape.values())), MESH_AXES, axis_types=axis_types)


def abstract_mesh(spec: str | Mapping[str, int] | None = None, **sizes: int) -> jax.sharding.AbstractMesh:
    """An `AbstractMesh` of any size (no devices needed): for planning and shape checks."""
    shape = parse_mesh({**parse_mesh(spec), **sizes} if sizes else spec)
    return jax.sharding.AbstractMesh(tuple(shape.values()), MESH_AXES,
                                     axis_types=(AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def activate(mesh, rules: Rules | str | None = None):
    """`jax.set_mesh(mesh)` plus the rule table (default: `rules_for_mesh(mesh)`)."""
    rules = get_rules(rules) or current_rules(dict(mesh.shape))
    with jax.set_mesh(mesh), use_rules(rules):
        yield mesh


def place_host_array(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from a host copy: each device takes its own slice, which is also right
    when the sharding spans several processes (every process holds the same host values),
    where `jax.device_put` is not."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
