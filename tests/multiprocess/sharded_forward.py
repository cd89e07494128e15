"""One process of a multi-process sharded forward of `tiny` (run by test_sharding_multiprocess).

usage: sharded_forward.py PROCESS_ID NUM_PROCESSES PORT MESH OUT.npz
Every process builds the same model with `init_sharded` (each materialises only its own
shards), runs prefill + one decode step on a global mesh spanning all processes, and
process 0 writes the gathered logits.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from k31jax.distributed import initialize  # noqa: E402

pid, nproc, port, mesh_spec, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
initialize(f"localhost:{port}", nproc, pid, cpu_collectives="gloo", num_cpu_devices=2, initialization_timeout=120)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from k31jax import ModelConfig, distributed, sharding  # noqa: E402

assert jax.process_count() == nproc and jax.device_count() == 2 * nproc, (jax.process_count(), jax.device_count())
cfg = ModelConfig.preset("tiny", dtype="float32", expert_weights="mxfp4")
mesh = sharding.make_mesh(mesh_spec)
model = distributed.init_sharded(cfg, mesh, seed=0)
host_tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 13)).astype(np.int32)
tokens = jax.make_array_from_callback(host_tokens.shape, NamedSharding(mesh, jax.P()), lambda i: host_tokens[i])
with sharding.activate(mesh):
    cache = distributed.init_sharded_cache(cfg, 4, 16, mesh)
    step = nnx.jit(lambda m, t, c: m(t, c))
    first = step(model, tokens[:, :12], cache)
    prefill, decode = first.logits, step(model, tokens[:, 12:], first.cache).logits
prefill = multihost_utils.process_allgather(prefill, tiled=True)
decode = multihost_utils.process_allgather(decode, tiled=True)
if pid == 0:
    np.savez(out, prefill=prefill, decode=decode, devices=jax.device_count(), processes=jax.process_count())
print(f"process {pid}: done", flush=True)
