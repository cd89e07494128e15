"""Multi-process JAX: `jax.distributed.initialize` with the settings a CPU cluster or a test needs.

The same script runs on every host (or process); after `initialize`, `jax.devices()` lists
every process's devices and `make_mesh` spans them all. On CPU the cross-process
collectives need `cpu_collectives="gloo"`.
"""

from __future__ import annotations

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
