"""Logical axis names, the rule tables that map them to mesh axes, meshes and constraints.

This layer knows nothing of the model: parameters and caches carry logical names
(`k31jax.nn`), a rule table (`TP`, `EP_TP`, `FSDP_EP_TP`, `EP_IN_TP`) resolves them on a mesh
with the axes `data, fsdp, expert, tensor` (all `AxisType.Auto`), and `constrain` pins
activations at layer boundaries. Placing a model on a mesh (`init_sharded`, `load_sharded`),
the memory planner and multi-process setup are one layer up, in `k31jax.distributed`::

    from k31jax import distributed, sharding
    mesh = sharding.make_mesh(expert=4, tensor=2)
    model = distributed.load_sharded(orbax_dir, mesh)
    with sharding.activate(mesh):                                # mesh + its rule table
        out = nnx.jit(lambda m, t, c: m(t, c))(model, tokens, cache)   # ModelOutput: logits, cache
"""

from ._mesh import abstract_mesh, activate, make_mesh, mesh_str, parse_mesh, place_host_array
from ._rules import (EP_IN_TP, EP_TP, FSDP_EP_TP, MESH_AXES, RULE_TABLES, TP, Rules, constrain, current_rules,
                     get_rules, inside_manual, logical_to_spec, param_local_rules, rules_for_mesh, rules_name,
                     shard_factor, spec_axes, use_rules)

__all__ = [
    "EP_IN_TP", "EP_TP", "FSDP_EP_TP", "MESH_AXES", "RULE_TABLES", "Rules", "TP", "abstract_mesh", "activate",
    "constrain", "current_rules", "get_rules", "inside_manual", "logical_to_spec", "make_mesh", "mesh_str",
    "param_local_rules", "parse_mesh", "place_host_array", "rules_for_mesh", "rules_name", "shard_factor", "spec_axes",
    "use_rules",
]
