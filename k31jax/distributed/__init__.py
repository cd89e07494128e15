"""Placing the model on meshes: sharded init and restore, cache placement, the per-device
memory planner, and process setup (`jax.distributed`; `tune_host_malloc` for XLA:CPU buffers)
with what a multi-process run's processes agree on (`is_primary`, `barrier`, `any_process`,
`gather_json`, `host_copy`, `peer_failure`, `watch_peers`).

Typical use::

    from k31jax import distributed, sharding
    mesh = sharding.make_mesh(expert=4, tensor=2)                # Auto axes data/fsdp/expert/tensor
    model = distributed.init_sharded(cfg, mesh)                  # only local shards materialise
    model = distributed.load_sharded(orbax_dir, mesh)            # or: restore a converted checkpoint
    cache = distributed.init_sharded_cache(cfg, batch, max_len, mesh)
    with sharding.activate(mesh):                                # mesh + its rule table
        out = nnx.jit(lambda m, t, c: m(t, c))(model, tokens, cache)   # ModelOutput: logits, cache
    print(distributed.plan_memory("k31_pro", "expert=8,tensor=8", batch=8, context=1 << 20).table("b300"))

The training planner's choices (`OPTIMIZERS`, `TRAINABLE_SETS`, `MASTER_DTYPES`) are the ones
`k31jax.train` accepts (it imports them from here); plans count bytes in decimal `GB`.
"""

from ._host_malloc import backends_started, tune_host_malloc
from ._initialize import initialize
from ._processes import any_process, barrier, gather_json, host_copy, is_primary, peer_failure
from ._watch import PeerWatch, watch_peers
from ._placement import (abstract_cache, abstract_state, cache_shardings, cache_specs, describe, init_sharded,
                         init_sharded_cache, load_sharded, logical_axes, restore_targets, shard_cache, shard_model,
                         state_shardings, state_specs)
from ._plan import DEVICES, GB, MemoryPlan, plan_memory, suggest_mesh
from ._plan_train import (DEFAULT_LORA_TARGETS, EXPERT_LORA_TARGET, MASTER_DTYPES, OPTIMIZERS, TRAINABLE_SETS,
                          TrainingMemoryPlan, is_trained, lora_factor_axes, lora_targets, plan_training, suggest_training_mesh)

__all__ = [
    "DEFAULT_LORA_TARGETS", "DEVICES", "EXPERT_LORA_TARGET", "GB", "MASTER_DTYPES", "MemoryPlan", "OPTIMIZERS", "PeerWatch", "TRAINABLE_SETS", "TrainingMemoryPlan", "abstract_cache", "abstract_state", "any_process", "backends_started", "barrier", "cache_shardings",
    "cache_specs", "describe", "gather_json", "host_copy", "init_sharded", "init_sharded_cache", "initialize", "is_primary", "is_trained", "load_sharded", "logical_axes", "lora_factor_axes", "lora_targets",
    "peer_failure", "plan_memory", "plan_training", "restore_targets", "shard_cache", "shard_model", "state_shardings", "state_specs",
    "suggest_mesh", "suggest_training_mesh", "tune_host_malloc", "watch_peers",
]
