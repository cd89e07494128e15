"""Parameter creation with logical axis names (the rules that map them to a mesh live in
`k31jax.sharding`)."""

import math

import jax
import jax.numpy as jnp
from flax import nnx


def _mesh_active() -> bool:
    return not jax.sharding.get_abstract_mesh().empty


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """An `nnx.Param` annotated with logical axis names, one per dimension.

    Sharding is applied eagerly only when a mesh is active, so the same modules build on a
    laptop CPU, under `nnx.eval_shape`, and under a device mesh.
    """
    if len(axes) != value.ndim:
        raise ValueError(f"axes {axes} do not match a parameter of shape {value.shape}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=_mesh_active())


def normal(rngs: nnx.Rngs, shape, std: float, dtype, axes) -> nnx.Param:
    return param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype), axes)


def constant(shape, fill: float, dtype, axes) -> nnx.Param:
    return param(jnp.full(shape, fill, dtype), axes)


def uniform(rngs: nnx.Rngs, shape, low: float, high: float, dtype, axes) -> nnx.Param:
    return param(jax.random.uniform(rngs.params(), shape, jnp.float32, low, high).astype(dtype), axes)


def dt_bias_init(rngs: nnx.Rngs, shape, axes) -> nnx.Param:
    """Inverse softplus of dt = exp(U(ln 1e-3, ln 1e-1)) clamped ≥ 1e-4 (kda.md §9)."""
    u = jax.random.uniform(rngs.params(), shape, jnp.float32, math.log(1e-3), math.log(1e-1))
    dt = jnp.maximum(jnp.exp(u), 1e-4)
    return param(dt + jnp.log(-jnp.expm1(-dt)), axes)
