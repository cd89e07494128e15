"""Multi-process JAX: `jax.distributed.initialize` settings for the Python API and the CLI.

The same script runs on every host (or process); after `initialize`, `jax.devices()` lists
every process's devices and `make_mesh` spans them all. On CPU the cross-process
collectives need `cpu_collectives="gloo"`.
"""

from __future__ import annotations

import argparse
import os

import jax

_ENV = {"coordinator": "K31JAX_COORDINATOR", "num_processes": "K31JAX_NUM_PROCESSES",
        "process_id": "K31JAX_PROCESS_ID"}


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: list[int] | None = None,
    cpu_collectives: str | None = None,
    num_cpu_devices: int | None = None,
    initialization_timeout: int | None = None,
) -> bool:
    """`jax.distributed.initialize(...)`, with the CPU knobs a CPU cluster (or a test) needs.

    `coordinator` is "host:port" of process 0. `num_cpu_devices` (fake CPU devices per
    process) applies with or without a coordinator. Without the three process settings nothing
    else happens
    unless the K31JAX_COORDINATOR / K31JAX_NUM_PROCESSES / K31JAX_PROCESS_ID environment
    variables are set (cluster auto-detection of `jax.distributed` is left to callers who call
    it directly). Must run before the first JAX computation. Returns True if initialised.
    """
    coordinator = coordinator or os.environ.get(_ENV["coordinator"])
    if num_processes is None and os.environ.get(_ENV["num_processes"]):
        num_processes = int(os.environ[_ENV["num_processes"]])
    if process_id is None and os.environ.get(_ENV["process_id"]):
        process_id = int(os.environ[_ENV["process_id"]])
    if num_cpu_devices:
        jax.config.update("jax_num_cpu_devices", num_cpu_devices)
    if coordinator is None and num_processes is None and process_id is None:
        return False
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    kwargs = dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    if local_device_ids is not None:
        kwargs["local_device_ids"] = local_device_ids
    if initialization_timeout is not None:
        kwargs["initialization_timeout"] = initialization_timeout
    jax.distributed.initialize(**kwargs)
    return True


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """`--coordinator host:port --num-processes N --process-id I [--cpu-collectives gloo]`
    and `--mesh expert=8,tensor=8`."""
    g = parser.add_argument_group("multi-process / sharding (jax.distributed)")
    g.add_argument("--coordinator", default=None, help="host:port of process 0 (jax.distributed)")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)
    g.add_argument("--local-device-ids", default=None, help="comma-separated local device ids")
    g.add_argument("--cpu-collectives", default=None, choices=["gloo", "mpi"],
                   help="cross-process collectives on CPU devices")
    g.add_argument("--num-cpu-devices", type=int, default=None, help="fake CPU devices per process")
    g.add_argument("--mesh", default=None, help="run sharded on this mesh, e.g. expert=8,tensor=8")
    g.add_argument("--rules", default=None, help="rule table (tp, ep_tp, fsdp_ep_tp, ep_in_tp; "
                   "default: chosen from the mesh)")


def initialize_from_args(args: argparse.Namespace) -> bool:
    ids = getattr(args, "local_device_ids", None)
    return initialize(
        getattr(args, "coordinator", None), getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
        local_device_ids=[int(i) for i in ids.split(",")] if ids else None,
        cpu_collectives=getattr(args, "cpu_collectives", None),
        num_cpu_devices=getattr(args, "num_cpu_devices", None))


def mesh_from_args(args: argparse.Namespace):
    """The mesh `--mesh` asks for (None without it)."""
    spec = getattr(args, "mesh", None)
    if not spec:
        return None
    from ._mesh import make_mesh

    return make_mesh(spec)


class cli_context:
    """For a CLI command: `jax.distributed.initialize` from the flags, then (with --mesh) the
    mesh and its rule table stay active for the whole command, and `place(model)` puts a
    loaded model's parameters on it.

        with cli_context(args) as ctx:
            model = ctx.place(load(...))
            ...  # jitted calls trace under the mesh: constraints + expert parallelism
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.mesh = None
        self._stack = None

    def __enter__(self):
        import contextlib

        from ._state import activate

        initialize_from_args(self.args)
        self.mesh = mesh_from_args(self.args)
        self._stack = contextlib.ExitStack()
        if self.mesh is not None:
            self._stack.enter_context(activate(self.mesh, getattr(self.args, "rules", None)))
        return self

    def place(self, model):
        if self.mesh is None:
            return model
        from ._state import shard_model

        return shard_model(model, self.mesh, getattr(self.args, "rules", None))

    def __exit__(self, *exc):
        self._stack.close()
        return False
