"""Continuous batching over a slot cache (``_slots``), in one background thread.

Requests join and leave between decode steps. One waiting request at a time is prefilled on a
batch-1 scratch cache, one chunk per loop turn between decode steps (all chunks at once when
nothing is decoding), then inserted into a free slot. Each row keeps its own sampling
parameters, seed and step counter, stop ids and strings, thinking budget, forced tool choice
and parser (``RowController``), so a greedy request produces the same tokens alone or inside a
busy batch. Every program has a fixed shape (``max_batch`` rows, prefill widths from one fixed
set, one scratch length), so nothing recompiles after ``warmup``. Images: the vision model runs once per request when
its prefill starts (its program compiles once per patch-count bucket, at the bucket's first image),
and with a vision model every chunk runs the image prefill program, pads or not (``Engine.prefill_args``).

Prefix reuse: at each prompt end and turn end the row's state is snapshotted into a
``PrefixCache``; a request whose prompt extends a stored sequence restores it and prefills only
the rest.

Results go to a per-request ``sink`` (called on the scheduler thread): ``TokenEvent`` per
generated token, then ``Finished`` or ``Failed``. ``Handle.cancel()`` (a client that went away)
frees the row at the next step.

Multi-host (``sync``, ``_multihost``): each loop turn acts on one ``TurnPlan`` (the requests
admitted and the ids cancelled, read once); process 0 broadcasts it, the other processes run
``follow()`` and apply it, so they all make the same decisions and launch the same programs.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ._forcing import ToolChoiceForcer
from ._healing import first_token_mask
from ._images import chunk_splice, image_digest
from ._prefix import PrefixCache, image_prefix_key
from ._requests import Completion, Request, RowController, StreamDelta
from ._sampling import SamplingParams, sampler_arrays
from ._slots import SlotPrograms, to_host

MAX_ALLOWED = 64  # widest tool-name branch constrained on device (wider ones sample freely)
MAX_BANNED = 4


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


@dataclasses.dataclass
class _Row:
    handle: Handle
    ctl: RowController
    forcer: ToolChoiceForcer | None
    prompt_tokens: int
    cached_tokens: int
    t_first: float
    key: tuple = ()  # the prompt's prefix-cache key (`image_prefix_key`)


@dataclasses.dataclass
class _Prefill:
    handle: Handle
    scratch: object
    chunks: list[tuple[np.ndarray, np.ndarray]]  # (tokens [1, w], valid [1, w]) per call
    cached_tokens: int
    next_chunk: int = 0
    logits: object = None
    key: tuple = ()  # the prompt's prefix-cache key (`image_prefix_key`)
    image_rows: np.ndarray | None = None  # the request's projected image rows [M, D]
    next_row: list = dataclasses.field(default_factory=lambda: [0])  # first image row not yet spliced


def plan_chunks(rest: Sequence[int], chunk: int, resumed: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Prefill calls for the uncached part of a prompt.

    Every width comes from one fixed set, ``chunk`` and the powers of two below it, so each
    compiles once (in ``Scheduler.warmup``).

    From scratch: the tokens before the last whole chunks go first, left-padded to the
    smallest width of the set that holds them (padding before the first token is exact: an
    identity KDA step with a zero conv input, as at the start of any sequence), then whole
    chunks: a 90-token prompt is one call of 128, not of 256.
    Resumed: no padding at all, since a zero conv input in the middle of a sequence would
    change the convolution window; whole chunks, then the remainder as descending powers of two.
    """
    rest = np.asarray(rest, np.int32)
    if not resumed:
        head = len(rest) % chunk or chunk  # real tokens of the first call
        first = chunk if head == chunk else min(chunk, 1 << (head - 1).bit_length())
        padded = first - head + len(rest)
        tokens = np.zeros((padded,), np.int32)
        valid = np.zeros((padded,), bool)
        tokens[first - head:] = rest
        valid[first - head:] = True
        bounds = [0, *range(first, padded + 1, chunk)]
        return [(tokens[None, a:b], valid[None, a:b]) for a, b in zip(bounds, bounds[1:])]
    widths = [chunk] * (len(rest) // chunk)
    left = len(rest) % chunk
    widths += [1 << b for b in range(left.bit_length() - 1, -1, -1) if left >> b & 1]
    out, at = [], 0
    for w in widths:
        out.append((rest[None, at:at + w], np.ones((1, w), bool)))
        at += w
    return out


def min_context(chunk: int, min_snapshot: int = 16) -> int:
    """The smallest ``max_len`` a ``Scheduler`` can warm up in: the resumed prompt of
    ``min_snapshot + chunk`` tokens and its two new tokens (``Scheduler.warmup``)."""
    return min_snapshot + chunk + 2


class Scheduler:
    """Continuous batching for one ``Engine`` (with a tokenizer).

    max_batch           decode slots.
    max_queue           waiting requests at most (``submit`` raises ``QueueFullError`` beyond).
    prefill_chunk       prefill call width (default: the engine's, at most 256).
    prefix_cache_bytes  bound of the session snapshot LRU (0 = off).
    min_snapshot        sequences shorter than this are not snapshotted.
    sync                multi-host serving (``ProcessSync``): process 0 runs the loop and
                        broadcasts each turn's plan; the other processes run ``follow()``.
    """

    def __init__(self, engine, *, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int | None = None, prefix_cache_bytes: int = 256 << 20,
                 min_snapshot: int = 16, sync=None):
        if engine.tokenizer is None:
            raise ValueError("the scheduler needs an Engine built with a tokenizer")
        if max_batch < 1 or max_queue < 1 or min_snapshot < 1:
            raise ValueError(f"max_batch={max_batch}, max_queue={max_queue}, min_snapshot={min_snapshot}: "
                             "each must be >= 1")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.chunk = prefill_chunk or min(engine.prefill_chunk, 256)
        self.min_snapshot = min_snapshot
        need = min_context(self.chunk, min_snapshot)
        if engine.max_len < need:
            raise ValueError(f"the engine's max_len {engine.max_len} is below the scheduler's minimum {need} "
                             f"(min_snapshot {min_snapshot} + prefill_chunk {self.chunk} + 2: the warm-up's "
                             "resumed prompt and its two tokens)")
        self._sync = sync
        # The caller's sharding context, for the loop thread: jax keeps the mesh of
        # `jax.set_mesh` per thread and k31jax's rule table is a context variable; programs
        # traced without them would drop the model's sharding (and recompile).
        self._mesh = jax.sharding.get_mesh()
        self._context = contextvars.copy_context()
        self.max_len = engine.max_len
        self.programs = SlotPrograms(engine, max_batch, engine.max_len + self.chunk)
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.vocab = engine.config.vocab_size
        self._inbox: queue.Queue[Handle] = queue.Queue()
        self._waiting: collections.deque[Handle] = collections.deque()
        self._queued = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.rows: list[_Row | None] = [None] * max_batch
        self._prefill: _Prefill | None = None
        self.stats = collections.Counter()  # requests, prompt_tokens, cached_tokens, generated_tokens …
        self.ttft_seconds: collections.deque[float] = collections.deque(maxlen=1024)
        self._token_times: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)
        self._reset_device_state()

    # ---- lifecycle ----------------------------------------------------------------------
    def _reset_device_state(self) -> None:
        b = self.max_batch
        self.cache = self.programs.new_cache(b, self.max_len)
        self.pos = 0
        self.sampler = self.programs.init_sampler(sampler_arrays([SamplingParams()] * b, [[0]] * b, self.vocab))
        self.host_tokens = np.zeros((b,), np.int32)

    def start(self) -> "Scheduler":
        """Run the loop on a background thread, under the mesh and rules this scheduler was built in."""
        def run():
            with contextlib.nullcontext() if self._mesh.empty else jax.set_mesh(self._mesh):
                self._loop()

        self._thread = threading.Thread(target=self._context.run, args=(run,), name="k31jax-scheduler",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def warmup(self) -> float:
        """Compile every program: a fresh prompt, its snapshot, two prompts resumed from it
        (their remainders of ``chunk - 1`` and ``chunk`` tokens take every width: ``chunk`` and
        each power of two below it), decode steps, a turn-end snapshot and a compaction. Needs
        ``min_context(chunk, min_snapshot)`` tokens of context. With ``sync``, every process
        runs it alike, without broadcasting. Returns compile seconds."""
        before = self.programs.compile_seconds
        sync, self._sync = self._sync, None
        try:
            base = [1] * self.min_snapshot
            # The first request makes one token, so no turn-end snapshot exists that a later
            # prompt could extend instead of `base` (whatever the model generates).
            for prompt, n_new in ((base, 1), (base + [2] * (self.chunk - 1), 2), (base + [3] * self.chunk, 2)):
                h = self.submit(Request(prompt, max_new_tokens=n_new, stop_ids=frozenset()))
                self._run_until_idle()
                h.result(timeout=0)
        finally:
            self._sync = sync
        live = np.zeros((self.max_batch,), bool)
        self.cache = self.programs.compact(self.cache, live)
        self.pos = int(to_host(self.cache.pos))
        self.prefix = PrefixCache(self.prefix.max_bytes)  # forget the warm-up's snapshots
        self.stats.clear()
        self.ttft_seconds.clear()
        return self.programs.compile_seconds - before

    # ---- submission ---------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise ``ValueError`` for a request that can never run here."""
        n = len(req.prompt)
        if n + req.max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {n} tokens + max_tokens {req.max_new_tokens} exceeds the "
                             f"context length {self.max_len}")
        bad = sorted({t for t in req.prompt if not 0 <= t < self.vocab})
        if bad:
            raise ValueError(f"prompt token ids {bad[:10]} outside the vocabulary [0, {self.vocab})")
        if req.chat_format != "k3" and req.thinking_budget is not None:
            raise ValueError("the server's thinking budget supports the K3 format only")
        self.engine.check_images(req)

    def submit(self, req: Request, *, tool_choice: ToolChoice | None = None, logprobs: bool = False,
               sink: Callable[[object], None] | None = None) -> Handle:
        self.check(req)
        with self._lock:
            if self._queued >= self.max_queue:
                raise QueueFullError(f"{self._queued} requests waiting (max_queue={self.max_queue})")
            self._queued += 1
        h = Handle(req, tool_choice, logprobs, sink)
        self._inbox.put(h)
        self._wake.set()
        return h

    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows) + (self._prefill is not None)

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds of decode steps."""
        now = time.perf_counter()
        return sum(k for t, k in list(self._token_times) if t >= now - window) / window

    # ---- the loop -----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            busy = self._prefill is not None or any(r is not None for r in self.rows) or self._waiting
            if not busy and self._inbox.empty():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                if self._sync is not None:  # a heartbeat: followers never wait long in a collective
                    self._sync.exchange(TurnPlan(idle=True))
                continue
            self._turn()
        if self._sync is not None:
            self._sync.exchange(TurnPlan(stop=True))

    def follow(self) -> None:
        """Multi-host serving, every process but 0: run process 0's turns (the requests it
        admitted and cancelled, broadcast by ``sync``) until process 0 stops. Every device
        program then runs on every process in the same order with the same inputs."""
        if self._sync is None or self._sync.leader:
            raise RuntimeError("follow() runs on the processes other than 0 of a Scheduler(sync=...)")
        while True:
            plan = self._sync.exchange(None)
            if plan.stop:
                return
            if plan.idle:
                continue
            new = [Handle.mirror(*entry) for entry in plan.new]
            with self._lock:
                self._queued += len(new)
            self._turn(new, plan.cancelled)

    def _run_until_idle(self) -> None:
        """Run loop turns on this thread until nothing is left (warmup, tests)."""
        while (self._prefill is not None or any(r is not None for r in self.rows) or self._waiting
               or not self._inbox.empty()):
            self._turn()

    def _plan(self) -> tuple[list[Handle], frozenset[int]]:
        """This turn's new requests and cancellations, read once (a client may cancel at any
        moment; the turn acts on this snapshot), and broadcast to the followers."""
        new = []
        while True:
            try:
                new.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        live = [*self._waiting, *new, *(r.handle for r in self.rows if r is not None)]
        if self._prefill is not None:
            live.append(self._prefill.handle)
        cancelled = frozenset(h.id for h in live if h.cancelled)
        if self._sync is not None:
            self._sync.exchange(TurnPlan(new=tuple((h.id, h.request, h.tool_choice, h.logprobs) for h in new),
                                         cancelled=cancelled))
        return new, cancelled

    def _turn(self, new: list[Handle] | None = None, cancelled: frozenset[int] = frozenset()) -> None:
        if new is None:
            new, cancelled = self._plan()
        try:
            self._admit(new, cancelled)
            if self._prefill is not None:
                decoding = any(r is not None for r in self.rows)
                self._prefill_step(all_chunks=not decoding)
            if any(r is not None for r in self.rows):
                self._decode_step()
        except Exception as exc:  # fail every request in flight and start clean
            self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        victims = [r.handle for r in self.rows if r is not None]
        if self._prefill is not None:
            victims.append(self._prefill.handle)
        self.rows = [None] * self.max_batch
        self._prefill = None
        for h in victims:
            h.sink(Failed(exc))
        self._reset_device_state()

    def _admit(self, new: list[Handle], cancelled: frozenset[int]) -> None:
        self._waiting.extend(new)
        for h in [h for h in self._waiting if h.id in cancelled]:
            self._waiting.remove(h)
            self._dequeued()
        for i, r in enumerate(self.rows):
            if r is not None and r.handle.id in cancelled:
                self.rows[i] = None
                self.stats["cancelled"] += 1
        if self._prefill is not None and self._prefill.handle.id in cancelled:
            self._prefill = None
            self.stats["cancelled"] += 1
        if self._prefill is None and self._waiting and None in self.rows:
            self._start_prefill(self._waiting.popleft())
            self._dequeued()

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    # ---- prefill ------------------------------------------------------------------------
    def _start_prefill(self, h: Handle) -> None:
        req = h.request
        prompt = list(req.prompt)
        pad_id = self.engine.media_pad_id
        key = image_prefix_key(prompt, pad_id, [(image_digest(im), im.num_tokens) for im in req.images])
        snap = self.prefix.longest_prefix(key) if self.prefix.max_bytes else None
        if snap is not None:
            scratch, cached = self.programs.restore(snap), len(snap.tokens)
        else:
            scratch, cached = self.programs.new_cache(1, self.programs.scratch_len), 0
        chunks = plan_chunks(prompt[cached:], self.chunk, resumed=cached > 0)
        rows = self.engine.image_rows(req)  # the vision model, once per request
        first_row = sum(t == pad_id for t in prompt[:cached]) if rows is not None else 0
        self._prefill = _Prefill(h, scratch, chunks, cached, key=key, image_rows=rows, next_row=[first_row])

    def _prefill_step(self, all_chunks: bool) -> None:
        p = self._prefill
        while p.next_chunk < len(p.chunks):
            tokens, valid = p.chunks[p.next_chunk]
            splice_ids = spliced = None
            if p.image_rows is not None:  # the pads of this chunk take the request's next image rows
                splice_ids = np.where(valid, tokens, -1)
                spliced = chunk_splice(splice_ids, [p.image_rows], p.next_row, self.engine.media_pad_id)
            p.logits, p.scratch = self.programs.prefill_chunk(p.scratch, tokens, valid, splice_ids, spliced)
            p.next_chunk += 1
            if not all_chunks:
                break
        if p.next_chunk == len(p.chunks):
            self._prefill = None
            self._join(p)

    def _join(self, p: _Prefill) -> None:
        h, req = p.handle, p.handle.request
        slot = self.rows.index(None)
        budget = (self.engine._budget(req.chat_format, req.thinking_budget)
                  if req.thinking_budget is not None else None)
        ctl = RowController(slot, req, self.tokenizer, self.engine.stop_ids, budget)
        tc = h.tool_choice
        forcer = None if tc is None else ToolChoiceForcer(
            self.tokenizer, tc.mode, tool_names=tc.names, name=tc.name, prompt_ids=req.prompt,
            max_new_tokens=req.max_new_tokens)
        n = len(req.prompt)
        force, allowed, banned = _constraints([(ctl, forcer)])
        arrays = sampler_arrays([req.params], [req.prompt], self.vocab)
        mask = first_token_mask(self.tokenizer, [req.healed_prefix], self.vocab)[0]
        token, row_sampler, lp = self.programs.first(p.logits, arrays, int(force[0]), allowed[0], banned[0], mask)
        self.pos = max(self.pos, n)
        self.cache = self.programs.insert(self.cache, p.scratch, slot, self.pos)
        self.sampler = self.programs.sampler_insert(self.sampler, row_sampler, slot)
        tok = int(to_host(token)[0])
        row = _Row(h, ctl, forcer, n, p.cached_tokens, time.perf_counter(), key=p.key)
        self.rows[slot] = row
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += n
        self.stats["cached_tokens"] += p.cached_tokens
        self.ttft_seconds.append(row.t_first - h.submitted)
        self._push(slot, tok, lp, 0)
        # The prompt's snapshot (the scratch is not donated to `insert`) is taken after the
        # first token went out, so copying it to the host adds nothing to time to first token.
        if n >= self.min_snapshot and self.prefix.max_bytes:
            self.prefix.put(self.programs.snapshot(p.scratch, 0, p.key))

    # ---- decode -------------------------------------------------------------------------
    def _decode_step(self) -> None:
        live = np.asarray([r is not None for r in self.rows])
        if self.pos >= self.max_len:
            self.cache = self.programs.compact(self.cache, live)
            self.pos = int(to_host(self.cache.pos))
            self.stats["compactions"] += 1
        force, allowed, banned = _constraints(
            [(r.ctl, r.forcer) if r is not None else (None, None) for r in self.rows])
        token, self.cache, self.sampler, lp = self.programs.decode(
            self.cache, self.host_tokens, self.sampler, force, allowed, banned)
        self.pos += 1
        host = to_host(token)
        self._token_times.append((time.perf_counter(), int(live.sum())))
        for slot, r in enumerate(self.rows):
            if r is not None:
                self._push(slot, int(host[slot]), lp, slot)

    def _push(self, slot: int, tok: int, lp, lp_row: int) -> None:
        r = self.rows[slot]
        self.host_tokens[slot] = tok
        delta = r.ctl.push(tok)
        if r.forcer is not None:
            r.forcer.push(tok)
        logprob = None
        if r.handle.logprobs:
            chosen, top_ids, top_lp = (to_host(a) for a in lp)
            logprob = TokenLogprob(float(chosen[lp_row]),
                                   tuple(zip(top_ids[lp_row].tolist(), top_lp[lp_row].tolist())))
        self.stats["generated_tokens"] += 1
        r.handle.sink(TokenEvent(delta, logprob))
        if r.ctl.done:
            self._finish(slot)

    def _finish(self, slot: int) -> None:
        r = self.rows[slot]
        self.rows[slot] = None
        gen = r.ctl.tokens
        fed = list(r.key) + gen[:-1]  # the last id was never fed to the model
        if len(gen) > 1 and len(fed) >= self.min_snapshot and self.prefix.max_bytes:
            self.prefix.put(self.programs.snapshot(self.cache, slot, fed))
        now = time.perf_counter()
        r.handle.sink(Finished(r.ctl.completion(r.prompt_tokens), r.cached_tokens,
                               r.t_first - r.handle.submitted, now - r.handle.submitted))


def _constraints(rows: Sequence[tuple[RowController | None, ToolChoiceForcer | None]]):
    """Per-row (force [B], allowed [B, MAX_ALLOWED], banned [B, MAX_BANNED]) for the next step:
    the thinking budget's forced id first, then the tool-choice forcer's constraints."""
    b = len(rows)
    force = np.full((b,), -1, np.int32)
    allowed = np.full((b, MAX_ALLOWED), -1, np.int32)
    banned = np.full((b, MAX_BANNED), -1, np.int32)
    for i, (ctl, forcer) in enumerate(rows):
        if ctl is None:
            continue
        force[i] = ctl.force()
        if force[i] >= 0 or forcer is None:
            continue
        f, allow, ban = forcer.constraint()
        force[i] = f
        if allow is not None and len(allow) <= MAX_ALLOWED:
            allowed[i, :len(allow)] = allow
        banned[i, :min(len(ban), MAX_BANNED)] = ban[:MAX_BANNED]
    return force, allowed, banned

