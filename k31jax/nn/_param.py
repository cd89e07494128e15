"""Parameter creation with logical axis names (the rules that map them to a mesh live in
`k31jax.sharding`)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..sharding import constrain, param_local_rules


def _mesh_active() -> bool:
    return not jax.sharding.get_abstract_mesh().empty


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """An `nnx.Param` annotated with logical axis names, one per dimension.

    Sharding is applied eagerly only when a mesh is active, so the same modules build on a
    laptop CPU, under `nnx.eval_shape`, and under a device mesh. The names are resolved by
    `k31jax.sharding` (its rule table, with divisibility fallback), not by Flax's rules.
    """
    if len(axes) != value.ndim:
        raise ValueError(f"axes {axes} do not match a parameter of shape {value.shape}")
    if not _mesh_active():
        return nnx.Param(value, out_sharding=axes, eager_sharding=False)
    # `sharding_rules` lets Flax's own tools (nnx.eval_shape / get_abstract_model /
    # get_partition_spec under this mesh) resolve the names exactly as k31jax does.
    return nnx.Param(constrain(value, *axes), out_sharding=axes, eager_sharding=False,
                     sharding_rules=param_local_rules(axes, value.shape))


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutMajor:
    """A projection `[..., in, out]` held as its transpose `t` `[..., out, in]`, the value of its
    `nnx.Param` in an inference layout (`nn.out_major_projections`).

    Reading it as the layer does (`param[...]`) gives the `[..., in, out]` matrix as a transpose
    of `t`, which XLA folds into the matmul that reads it: no copy is made. Slicing a stack's
    row (`jax.tree.map`) slices `t`.
    """

    t: jax.Array

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError(f"OutMajor: read the whole matrix with [...], got index {index!r}")
        return jnp.swapaxes(self.t, -1, -2)
