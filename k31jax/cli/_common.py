"""Flags and context shared by the commands: multi-process settings and the --mesh."""

from __future__ import annotations

import argparse
import contextlib

from ..distributed import initialize, shard_model
from ..sharding import activate, make_mesh


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
        initialize_from_args(self.args)
        self.mesh = mesh_from_args(self.args)
        self._stack = contextlib.ExitStack()
        if self.mesh is not None:
            self._stack.enter_context(activate(self.mesh, getattr(self.args, "rules", None)))
        return self

    def place(self, model):
        if self.mesh is None:
            return model
        return shard_model(model, self.mesh, getattr(self.args, "rules", None))

    def __exit__(self, *exc):
        self._stack.close()
        return False
