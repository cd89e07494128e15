"""Sharding and scale-out: logical axis rules, meshes, sharded init / restore, activation
constraints, expert-parallel MoE, multi-process setup and a memory planner.

Typical use::

    from k31jax import sharding
    mesh = sharding.make_mesh(expert=4, tensor=2)               # Auto axes data/fsdp/expert/tensor
    model = sharding.init_sharded(cfg, mesh)                     # only local shards materialise
    model = sharding.load_sharded(orbax_dir, mesh)               # or: restore a converted checkpoint
    cache = sharding.init_sharded_cache(cfg, batch, max_len, mesh)
    with sharding.activate(mesh):                                # mesh + its rule table
        logits, cache = nnx.jit(lambda m, t, c: m(t, c))(model, tokens, cache)
"""

from ._distributed import add_distributed_arguments, initialize, initialize_from_args
from ._ep import EXCHANGES, EPPlan, default_exchange, ep_routed_experts, make_plan, ragged_exchange
from ._mesh import abstract_mesh, make_mesh, mesh_str, parse_mesh
from ._plan import DEVICES, MemoryPlan, plan_memory, suggest_mesh
from ._rules import (ACTIVATION_AXES, EP_IN_TP, EP_TP, FSDP_EP_TP, MESH_AXES, PARAM_AXES, RULE_TABLES, TP,
                     Rules, constrain, current_rules, get_rules, logical_to_spec, rules_for_mesh, shard_factor,
                     use_rules)
from ._state import (CACHE_AXES, abstract_cache, abstract_state, activate, cache_shardings, cache_specs,
                     constrain_cache, describe, init_sharded, init_sharded_cache, load_sharded, logical_axes,
                     restore_targets, shard_cache, shard_model, state_shardings, state_specs)

__all__ = [
    "ACTIVATION_AXES", "CACHE_AXES", "DEVICES", "EPPlan", "EP_IN_TP", "EP_TP", "EXCHANGES", "FSDP_EP_TP",
    "MESH_AXES", "MemoryPlan", "PARAM_AXES", "RULE_TABLES", "Rules", "TP", "abstract_cache", "abstract_mesh",
    "abstract_state", "activate", "add_distributed_arguments", "cache_shardings", "cache_specs", "constrain",
    "constrain_cache", "current_rules", "default_exchange", "describe", "ep_routed_experts", "get_rules",
    "init_sharded", "init_sharded_cache", "initialize", "initialize_from_args", "load_sharded", "logical_axes",
    "logical_to_spec", "make_mesh", "make_plan", "mesh_str", "parse_mesh", "plan_memory", "ragged_exchange",
    "restore_targets", "rules_for_mesh", "shard_cache", "shard_factor", "shard_model", "state_shardings",
    "state_specs", "suggest_mesh", "use_rules",
]
