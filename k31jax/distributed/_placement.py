"""Placing the model state and the caches on a mesh: abstract targets, sharded init and
restore, resharding.

The parameter shardings come from each `nnx.Param`'s `out_sharding` metadata (logical names)
resolved by a rule table on a mesh; the cache shardings from `CACHE_AXES`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..ckpt import checkpoint_config, checkpoint_info, load_checkpoint
from ..config import ModelConfig
from ..nn import CACHE_AXES, Cache, K31ForCausalLM, abstract_model, init_cache
from ..sharding import Rules, current_rules, get_rules, logical_to_spec, place_host_array


def _mesh_shape(mesh) -> dict[str, int]:
    return dict(mesh.shape)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _names(v: nnx.Variable, ndim: int) -> tuple:
    names = v.get_metadata().get("out_sharding")
    return tuple(names) if names is not None else (None,) * ndim


def logical_axes(model_or_state) -> nnx.State:
    """The logical axis names of every variable, as a State of tuples (for inspection)."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    return jax.tree.map(lambda v: v.replace(_names(v, len(v.get_value().shape))), state, is_leaf=_is_var)


def state_specs(model_or_state, mesh, rules: Rules | str | None = None) -> nnx.State:
    """PartitionSpec of every variable on `mesh` (Mesh or AbstractMesh) under `rules`."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    shape = _mesh_shape(mesh)
    rules = get_rules(rules) or current_rules(shape)

    def spec(v):
        val = v.get_value()
        return v.replace(logical_to_spec(_names(v, len(val.shape)), val.shape, shape, rules))

    return jax.tree.map(spec, state, is_leaf=_is_var)


def state_shardings(model_or_state, mesh, rules: Rules | str | None = None) -> nnx.State:
    """NamedSharding of every variable (a State with the model's structure)."""
    specs = state_specs(model_or_state, mesh, rules)
    return jax.tree.map(lambda v: v.replace(NamedSharding(mesh, v.get_value())), specs, is_leaf=_is_var)


def abstract_state(cfg: ModelConfig, mesh, rules: Rules | str | None = None):
    """`(graphdef, state)` whose leaves are `ShapeDtypeStruct(shape, dtype, sharding=...)`.

    Nothing is allocated. The state is a restore target for Orbax
    (`ocp1.load(path, state)`, then `nnx.merge(graphdef, restored)`) and the input to
    per-device memory accounting (`sharding.shard_shape`). `mesh` may be an AbstractMesh.
    """
    graphdef, state = nnx.split(abstract_model(cfg))
    specs = state_specs(state, mesh, rules)

    def target(v, s):
        val = v.get_value()
        return v.replace(jax.ShapeDtypeStruct(val.shape, val.dtype, sharding=NamedSharding(mesh, s.get_value())))

    return graphdef, jax.tree.map(target, state, specs, is_leaf=_is_var)


def restore_targets(cfg: ModelConfig, mesh, rules: Rules | str | None = None, *, dtype=None):
    """Pure-dict restore targets (the layout `nnx.to_pure_dict(nnx.state(model))` saves):
    ShapeDtypeStructs with NamedShardings, optionally cast to `dtype` (float leaves only)."""
    _, state = abstract_state(cfg, mesh, rules)
    tree = nnx.to_pure_dict(state)
    if dtype is None:
        return tree
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dt if jnp.issubdtype(s.dtype, jnp.floating)
                                                       and s.dtype != jnp.float32 else s.dtype,
                                                       sharding=s.sharding), tree)


def init_sharded(cfg: ModelConfig, mesh, rules: Rules | str | None = None, *, seed: int = 0):
    """Build the model directly on `mesh`: the initialiser is jitted with the parameter
    shardings as `out_shardings`, so each device only ever materialises its own shards.
    Values equal `K31ForCausalLM(cfg, rngs=nnx.Rngs(seed))` (partitionable threefry)."""
    rules = get_rules(rules) or current_rules(_mesh_shape(mesh))
    graphdef, abs_state = abstract_state(cfg, mesh, rules)
    out = jax.tree.map(lambda s: s.sharding, abs_state)

    def init():
        return nnx.state(K31ForCausalLM(cfg, rngs=nnx.Rngs(seed)))

    # No mesh context while tracing: the parameters carry no per-variable rules, so the state
    # merges with the abstract graphdef; `out_shardings` makes XLA partition the initialiser.
    state = jax.jit(init, out_shardings=out)()
    return nnx.merge(graphdef, state)


def _put(x, sharding: NamedSharding):
    """Place a host-complete array on a (possibly multi-process) sharding."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already global (built under the mesh)
        return jax.jit(lambda a: a, out_shardings=sharding)(x)
    return place_host_array(np.asarray(x), sharding)


def shard_model(model, mesh, rules: Rules | str | None = None):
    """A copy of `model` with every variable placed on `mesh` as the rules say."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, rules)
    placed = jax.tree.map(lambda v, s: v.replace(_put(v.get_value(), s.get_value())), state, shardings,
                          is_leaf=_is_var)
    return nnx.merge(graphdef, placed)


# ---------------------------------------------------------------------------------- caches
def cache_specs(cache: Cache, mesh, rules: Rules | str | None = None) -> Cache:
    """PartitionSpec of every cache leaf (a Cache whose leaves are specs; None stays None)."""
    shape = _mesh_shape(mesh)
    rules = get_rules(rules) or current_rules(shape)
    fields = {}
    for name, axes in CACHE_AXES.items():
        leaf = getattr(cache, name)
        fields[name] = None if leaf is None else logical_to_spec(axes, leaf.shape, shape, rules)
    return Cache(**fields)


def cache_shardings(cache: Cache, mesh, rules: Rules | str | None = None) -> Cache:
    specs = cache_specs(cache, mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def abstract_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> Cache:
    return jax.eval_shape(lambda: init_cache(cfg, batch, max_len, dtype))


def init_sharded_cache(cfg: ModelConfig, batch: int, max_len: int, mesh, rules: Rules | str | None = None,
                       dtype=None) -> Cache:
    """Zeroed caches created directly in their shardings."""
    shardings = cache_shardings(abstract_cache(cfg, batch, max_len, dtype), mesh, rules)
    return jax.jit(lambda: init_cache(cfg, batch, max_len, dtype), out_shardings=shardings)()


def shard_cache(cache: Cache, mesh, rules: Rules | str | None = None) -> Cache:
    shardings = cache_shardings(cache, mesh, rules)
    return jax.tree.map(_put, cache, shardings)


def describe(model_or_state, mesh=None, rules: Rules | str | None = None, *, min_bytes: int = 0) -> str:
    """A table: path, shape, dtype, logical axes, spec (placed arrays: their own sharding)."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    specs = state_specs(state, mesh, rules) if mesh is not None else None
    rows = []
    flat = nnx.to_flat_state(state)
    flat_specs = dict(nnx.to_flat_state(specs)) if specs is not None else {}
    for path, v in flat:
        val = v.get_value()
        nbytes = int(np.prod(val.shape)) * jnp.dtype(val.dtype).itemsize
        if nbytes < min_bytes:
            continue
        if specs is not None:
            spec = flat_specs[path].get_value()
        else:
            sh = getattr(val, "sharding", None)
            spec = getattr(sh, "spec", None)
        rows.append(("/".join(map(str, path)), str(tuple(val.shape)), str(val.dtype),
                     str(_names(v, len(val.shape))), str(spec)))
    widths = [max(len(r[i]) for r in rows + [("path", "shape", "dtype", "logical", "spec")]) for i in range(5)]
    head = ("path", "shape", "dtype", "logical", "spec")
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def load_sharded(path, mesh, rules: Rules | str | None = None, *, dtype=None, **kwargs):
    """Restore a converted (Orbax) checkpoint straight onto `mesh`: every parameter is read
    into its own sharding (`k31jax.ckpt.load_checkpoint` with these shardings; with
    `vision=True` the vision modules are placed under the same `rules`)."""
    cfg = checkpoint_config(checkpoint_info(path), dtype=str(jnp.dtype(dtype or jnp.bfloat16)))
    _, abs_state = abstract_state(cfg, mesh, rules)
    return load_checkpoint(path, dtype=dtype, shardings=abs_state, rules=rules, **kwargs)
