"""What a scheduler's client holds and receives: the ``Handle`` of a submitted request, its
events (``TokenEvent`` per generated token, then ``Finished`` or ``Failed``), the forced tool
choice it asked for, and the ``TurnPlan`` process 0 broadcasts each loop turn (multi-host).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import time
from collections.abc import Callable

from ._requests import Completion, Request, StreamDelta


class QueueFullError(RuntimeError):
    """The bounded queue is full (a server answers 429 with Retry-After)."""


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """``mode``: "none" | "required" | "named"; ``names``: declared tools; ``name``: the forced one."""

    mode: str
    names: tuple[str, ...] = ()
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    logprob: float
    top: tuple[tuple[int, float], ...]  # (id, logprob), best first


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    delta: StreamDelta
    logprob: TokenLogprob | None


@dataclasses.dataclass(frozen=True)
class Finished:
    completion: Completion
    cached_tokens: int  # prompt tokens restored from the prefix cache
    ttft_seconds: float
    total_seconds: float


@dataclasses.dataclass(frozen=True)
class Failed:
    error: BaseException


class Handle:
    """One submitted request. ``sink`` receives its events (default: an internal queue read by
    ``events()`` / ``result()``)."""

    _ids = itertools.count()

    def __init__(self, request: Request, tool_choice: ToolChoice | None, logprobs: bool,
                 sink: Callable[[object], None] | None):
        self.id = next(self._ids)
        self.request, self.tool_choice, self.logprobs = request, tool_choice, logprobs
        self._queue: queue.Queue | None = None
        if sink is None:
            self._queue = queue.Queue()
            sink = self._queue.put
        self.sink = sink
        self.cancelled = False
        self.submitted = time.perf_counter()

    @classmethod
    def mirror(cls, id_: int, request: Request, tool_choice: ToolChoice | None, logprobs: bool) -> "Handle":
        """A follower's copy of process 0's handle ``id_`` (multi-host): same request, no client."""
        h = cls(request, tool_choice, logprobs, sink=_discard)
        h.id = id_
        return h

    def cancel(self) -> None:
        self.cancelled = True

    def events(self, timeout: float | None = None):
        """Yield ``TokenEvent``s, then return the ``Finished`` (raises a ``Failed`` error)."""
        while True:
            item = self._queue.get(timeout=timeout)
            if isinstance(item, Failed):
                raise item.error
            if isinstance(item, Finished):
                return item
            yield item

    def result(self, timeout: float | None = None) -> Finished:
        it = self.events(timeout)
        while True:
            try:
                next(it)
            except StopIteration as stop:
                return stop.value


def _discard(item: object) -> None:
    """The sink of a follower's handle: its client is served by process 0."""


@dataclasses.dataclass(frozen=True)
class TurnPlan:
    """What process 0's scheduler broadcasts each loop turn (multi-host serving): the requests
    it admitted, as ``(handle id, Request, ToolChoice | None, logprobs)``, and the ids it
    cancelled; or a heartbeat while idle (``idle``); or the end (``stop``)."""

    new: tuple[tuple, ...] = ()
    cancelled: frozenset[int] = frozenset()
    idle: bool = False
    stop: bool = False
