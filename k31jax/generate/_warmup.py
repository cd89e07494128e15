"""The scheduler's warm-up: its compile steps on worker threads (``Scheduler.warmup`` /
``start_warmup``), with what is done and what is left for a health check.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Sequence

import jax


class Warmup:
    """The scheduler's warm-up (``Scheduler.warmup`` / ``start_warmup``): its steps run on
    worker threads, the next free worker taking the next step. ``done`` / ``left``: step labels
    (``left`` includes those compiling now); ``ready`` once every step ran; ``error``: the first
    failure (the remaining steps are skipped, and compile on first use instead)."""

    def __init__(self, steps: Sequence[tuple[str, Callable[[], object]]], context: contextvars.Context,
                 on_done: Callable[["Warmup"], None] | None = None):
        self._steps = collections.deque(steps)
        self.left: list[str] = [label for label, _ in steps]
        self.done: list[str] = []
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._context, self._on_done = context, on_done
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._active = 0

    @property
    def running(self) -> bool:
        return self.finished is None

    @property
    def ready(self) -> bool:
        return self.finished is not None and not self.left and self.error is None

    @property
    def seconds(self) -> float:
        return (self.finished if self.finished is not None else time.perf_counter()) - self.started

    def start(self, workers: int, mesh, stopped: Callable[[], bool]) -> None:
        """`workers` threads, each in a copy of `context` (one context cannot be entered by two
        threads at once) under `mesh`, until the steps run out or `stopped()`."""
        self._active = max(1, min(workers, len(self._steps)))
        for i in range(self._active):
            t = threading.Thread(target=self._context.copy().run, args=(self._work, mesh, stopped),
                                 name=f"k31jax-warmup-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def join(self) -> None:
        for t in self._threads:
            t.join()

    def _work(self, mesh, stopped: Callable[[], bool]) -> None:
        with contextlib.nullcontext() if mesh.empty else jax.set_mesh(mesh):
            while not stopped():
                with self._lock:
                    if not self._steps or self.error is not None:
                        break
                    label, step = self._steps.popleft()
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - reported by `error`; requests compile what they need
                    with self._lock:
                        self.error = self.error or exc
                    break
                with self._lock:
                    self.left.remove(label)
                    self.done.append(label)
        with self._lock:
            self._active -= 1
            last = self._active == 0
            if last:
                self.finished = time.perf_counter()
        if last and self._on_done is not None:
            self._on_done(self)
