"""Multi-host serving: process 0 serves HTTP and decides; every process steps the same batch.

The model and every slot-cache program run sharded on a mesh spanning all processes (SPMD:
each process must launch the same programs, in the same order, with the same host inputs).
The scheduler is deterministic given the requests it admits and cancels at each loop turn, so
that is all process 0 sends: at each turn its ``Scheduler`` broadcasts a ``TurnPlan`` (new
requests, cancelled ids; a heartbeat while idle; the end), and every other process runs
``Scheduler.follow()``, which applies the same plan to its own copy of the scheduler. Token
ids, stop strings, thinking budgets, forced tool calls and prefix-cache hits then come out the
same everywhere, so no sampled token is ever sent between processes.

The broadcast is ``jax.experimental.multihost_utils.broadcast_one_to_all`` (a collective over
the processes' devices): the plan's length, then its bytes. The bytes are a pickle that only
process 0 of the same job writes, over the job's own collective (not a network input).

``to_host`` reads a device array on every process alike (sampled ids, snapshot arrays).
"""

from __future__ import annotations

import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils


class ProcessSync:
    """Broadcasts process 0's ``TurnPlan`` to every process (``Scheduler(sync=ProcessSync())``).

    ``exchange(plan)`` is a collective: every process calls it at the same point of its loop;
    process 0 passes its plan, the others ``None``, and all of them get process 0's plan back.
    """

    def __init__(self):
        self.leader = jax.process_index() == 0
        self.processes = jax.process_count()

    def exchange(self, plan):
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL) if self.leader else b""
        size = int(multihost_utils.broadcast_one_to_all(np.asarray([len(data)], np.int32))[0])
        buf = np.frombuffer(data, np.uint8) if self.leader else np.zeros((size,), np.uint8)
        got = multihost_utils.broadcast_one_to_all(buf)
        return plan if self.leader else pickle.loads(np.asarray(got, np.uint8).tobytes())


def to_host(x) -> np.ndarray:
    """A device array's value on this host. An array sharded across processes (multi-host) is
    gathered first: a collective, so every process reads the same arrays in the same order."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
