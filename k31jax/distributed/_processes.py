"""What every process of a multi-process run (`jax.distributed`) must agree on: who writes the
shared files, where all of them wait for each other, whether any of them was asked to stop,
and the one line a process prints when a peer has died.

With one process each helper is the trivial answer (process 0 writes, nobody waits, the local
flag stands), so single-process code pays nothing for them.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.experimental import multihost_utils


def is_primary() -> bool:
    """Whether this process writes the run's shared files (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process reaches `name` before any goes on (a no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def any_process(flag: bool) -> bool:
    """`flag` OR-ed over every process: one collective, so all processes see the same answer
    at the same point of their loops (a signal reaches one process; all must stop together)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.process_allgather(np.array([flag], np.int32)).any())


def gather_json(value) -> list:
    """`value` (anything JSON can hold) of every process, in process order, on every process."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], np.int32))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(row[:int(n)].tobytes()) for row, n in zip(rows, sizes.reshape(-1))]


def host_copy(tree):
    """The whole value of every array in `tree` as NumPy on this process. Arrays split over
    several processes are gathered (every process gets the whole), so process 0 can write them."""
    if jax.process_count() == 1:
        return jax.device_get(tree)  # one batched transfer
    return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree)


def peer_failure(error: BaseException) -> str | None:
    """One line naming the process a failed cross-process collective lost, or None when
    `error` is not that (a single-process run, or another runtime error).

    A process killed mid-run closes its connections: the survivors' next collective fails at
    once with the peer's address (gloo: "Connection closed by peer"), long before the
    coordination service's heartbeat timeout would stop them with a fatal log. With two
    processes the lost one is the other; with more, the address is what the error names
    (`watch_peers` names the process, and notices outside collectives too)."""
    n = jax.process_count()
    text = str(error)
    if n == 1 or not isinstance(error, jax.errors.JaxRuntimeError):
        return None
    lost = ("closed by peer", "connection reset", "connection refused", "broken pipe", "unavailable",
            "heartbeat", "timed out", "timeout")
    if not any(word in text.lower() for word in lost):
        return None
    me = jax.process_index()
    who = f"process {1 - me} of 2" if n == 2 else f"a peer of process {me} (of {n})"
    detail = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{who} stopped answering (a cross-process collective failed: {detail[:200]})"
