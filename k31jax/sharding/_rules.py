"""Logical axis names, the rule tables that map them to mesh axes, and their resolution.

Every parameter and cache leaf names one logical axis per dimension (`k31jax/nn/_param.py`,
`cache_axes`); activations are constrained at layer boundaries with `constrain`. A rule
table is data: a tuple of `(logical_name, mesh_axes)` pairs, where `mesh_axes` is a mesh
axis name, a tuple of names (the dimension is split over their product) or None.

Resolution (`logical_to_spec`) differs from a positional lookup in two ways:
- **priority**: dimensions are resolved in the order their names appear in the table, and a
  mesh axis is used at most once per array, so `heads` claims `tensor` before `embed` does
  (a `[D, heads]` projection is column-parallel, a `[D, 128]` one row-parallel);
- **divisibility**: a mesh axis that does not divide the dimension (or has size 1) is
  skipped, so tiny test configs and odd shapes fall back to replication instead of failing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping, Sequence
from typing import Union

import jax
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor")

MeshAxes = Union[str, tuple[str, ...], None]
Rules = tuple[tuple[str, MeshAxes], ...]

# Parameter vocabulary (style.md §3) and activation / cache names.
PARAM_AXES = ("layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "q_lora", "kv_lora", "mlp",
              "expert", "latent", "expert_mlp", "packed_in", "index_heads", "conv", "norm")
ACTIVATION_AXES = ("batch", "seq", "act_embed", "act_heads", "act_vocab", "act_mlp", "cache_seq")

# Order = priority. Names early in the table claim their mesh axes first.
TP: Rules = (
    ("layers", None),
    ("expert", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("index_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert_mlp", "tensor"),
    ("vocab", "tensor"),
    ("latent", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("head_dim", None),
    ("conv", None),
    ("packed_in", None),
    # Low priority: the D side of projections whose other side is not head-parallel
    # ([D, 128], [D, 1536], the router, the latent down/up) becomes row-parallel.
    ("embed", "tensor"),
    # Stacked norm / AttnRes vectors: split so that no stacked leaf is replicated on every
    # device (they are all-gathered per use; a few KB per layer).
    ("norm", "tensor"),
    # Activations and caches.
    ("batch", "data"),
    ("seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_vocab", "tensor"),
    ("act_mlp", "tensor"),
    # The MLA latent and indexer caches have no head axis (one 576-d latent per token shared
    # by all heads), so with the batch replicated over the tensor group they are split along
    # the sequence instead of being replicated on every tensor rank; the partitioner turns
    # attention over them into partial softmax sums. (Writing new tokens into a
    # sequence-split buffer currently makes XLA's SPMD partitioner rematerialise the layer's
    # cache slice: correct, not yet efficient.)
    ("cache_seq", "tensor"),
)


def _override(base: Rules, **changes: MeshAxes) -> Rules:
    unknown = set(changes) - {k for k, _ in base}
    if unknown:
        raise KeyError(f"no such logical axes {sorted(unknown)}")
    return tuple((k, changes.get(k, v)) for k, v in base)


# Expert parallel + tensor parallel: experts split over `expert`, their intermediate over
# `tensor`; attention is data-parallel over `expert` (batch split over data x expert, which
# also splits the caches) and tensor-parallel inside each expert group.
EP_TP: Rules = _override(TP, expert="expert", batch=("data", "expert"), cache_seq=None)

# FSDP + EP + TP: additionally split the D / latent side of every weight over `fsdp` (gathered
# per layer by the partitioner) and the batch over `fsdp` too.
FSDP_EP_TP: Rules = _override(EP_TP, embed=("fsdp", "tensor"), latent="fsdp",
                              batch=("data", "fsdp", "expert"))

# One node (e.g. 8 GPUs): experts split over the same `tensor` axis that holds the attention
# heads (EP inside the TP group, as SGLang / vLLM serve DeepSeek); batch replicated, caches
# split along the sequence (as in TP) so a 1M context fits.
EP_IN_TP: Rules = _override(TP, expert="tensor")

RULE_TABLES: dict[str, Rules] = {"tp": TP, "ep_tp": EP_TP, "fsdp_ep_tp": FSDP_EP_TP, "ep_in_tp": EP_IN_TP}


def get_rules(rules: Rules | str | None) -> Rules | None:
    if rules is None or not isinstance(rules, str):
        return rules
    try:
        return RULE_TABLES[rules]
    except KeyError:
        raise KeyError(f"unknown rule table {rules!r}; known: {sorted(RULE_TABLES)}") from None


def rules_name(rules: Rules) -> str:
    """The name of a rule table in `RULE_TABLES`, or "custom"."""
    return next((name for name, table in RULE_TABLES.items() if table == rules), "custom")


def rules_for_mesh(mesh_shape: Mapping[str, int]) -> Rules:
    """The default table for a mesh: FSDP+EP+TP if `fsdp` > 1, else EP+TP if `expert` > 1,
    else TP. (Each table reduces to the next when the extra axis has size 1.)"""
    if mesh_shape.get("fsdp", 1) > 1:
        return FSDP_EP_TP
    if mesh_shape.get("expert", 1) > 1:
        return EP_TP
    return TP


_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("k31jax_sharding_rules", default=None)


@contextlib.contextmanager
def use_rules(rules: Rules | str | None):
    """Make `rules` the table that `constrain`, parameter creation and the expert-parallel
    MoE resolve against. Without it, `rules_for_mesh(active mesh)` is used.

    Jitted functions are cached per mesh, not per rule table: retrace (a new `jax.jit`) when
    switching tables on the same mesh.
    """
    token = _RULES.set(get_rules(rules))
    try:
        yield
    finally:
        _RULES.reset(token)


def current_rules(mesh_shape: Mapping[str, int] | None = None) -> Rules:
    rules = _RULES.get()
    if rules is not None:
        return rules
    if mesh_shape is None:
        mesh_shape = active_mesh_shape() or {}
    return rules_for_mesh(mesh_shape)


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int] | None,
    mesh_shape: Mapping[str, int],
    rules: Rules | str | None = None,
) -> P:
    """The PartitionSpec of an array with these logical axis names on a mesh of this shape."""
    rules = get_rules(rules) if rules is not None else current_rules(mesh_shape)
    table = dict(rules)
    prio = {name: i for i, (name, _) in enumerate(rules)}
    names = tuple(names)
    if shape is not None and len(shape) != len(names):
        raise ValueError(f"logical axes {names} do not match shape {tuple(shape)}")
    out: list = [None] * len(names)
    used: set[str] = set()
    for d in sorted(range(len(names)), key=lambda d: (prio.get(names[d], -1), d)):
        name = names[d]
        if name is None:
            continue
        if name not in table:
            raise KeyError(f"no sharding rule for logical axis {name!r} (known: {sorted(table)})")
        chosen, prod = [], 1
        for ax in _as_tuple(table[name]):
            size = mesh_shape.get(ax, 1)
            if ax in used or size == 1:
                continue
            if shape is not None and shape[d] % (prod * size):
                continue
            chosen.append(ax)
            prod *= size
        used.update(chosen)
        out[d] = None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen)
    return P(*out)


def spec_axes(spec: P, dim: int) -> tuple[str, ...]:
    """The mesh axes that split dimension `dim` of a PartitionSpec."""
    return _as_tuple(spec[dim]) if dim < len(spec) else ()


def shard_factor(spec: P, mesh_shape: Mapping[str, int]) -> int:
    """How many ways the array is split (product of the mesh axes its spec uses)."""
    n = 1
    for entry in spec:
        for ax in _as_tuple(entry):
            n *= mesh_shape[ax]
    return n


def active_mesh_shape() -> dict[str, int] | None:
    """Axis sizes of the mesh set by `jax.set_mesh` / `use_abstract_mesh`, or None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    return dict(mesh.shape)


def inside_manual() -> bool:
    """Whether the code runs inside `shard_map` (the mesh's axes are manual there)."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(mesh, "manual_axes", None)
    if manual is not None:
        return bool(manual)
    return any(str(t).endswith("Manual") for t in getattr(mesh, "axis_types", ()))


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """`with_sharding_constraint` by logical names; a no-op without an active mesh (and inside
    `shard_map`, where the axes are manual)."""
    mesh_shape = active_mesh_shape()
    if mesh_shape is None or inside_manual():
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh_shape))


def param_local_rules(names: Sequence[str | None], shape: Sequence[int]) -> Rules:
    """This array's names -> the mesh axes they resolve to on the active mesh (a per-variable
    Flax `sharding_rules` table); `layers` (added by the stacking vmap) stays unsplit."""
    mesh_shape = active_mesh_shape() or {}
    spec = logical_to_spec(names, shape, mesh_shape)
    out = {"layers": None}
    for d, name in enumerate(names):
        if name is not None:
            out[name] = spec[d] if d < len(spec) else None
    return tuple(out.items())
