"""Continuous batching over a slot cache (``_slots``), in one background thread: a loop over
the generation core (``_core``; its own ``fork()``, so its compile counts are its own).

Requests join and leave between decode steps. One waiting request at a time is prefilled on a
batch-1 scratch cache, one chunk per loop turn between decode steps (all chunks at once when
nothing is decoding), then inserted into a free slot. Each row keeps its own sampling
parameters, seed and step counter, stop ids and strings, thinking budget, forced tool choice
and parser (``RowController``), so a greedy request produces the same tokens alone or inside a
busy batch. Every program has a fixed shape (``max_batch`` rows, prefill widths from one fixed
set, one scratch length), so nothing recompiles after ``warmup``. Images: the vision model runs once per request when
its prefill starts (its program compiles once per patch-count bucket, at the bucket's first image),
and with a vision model every chunk runs the image prefill program, pads or not
(``GenerationCore.prefill_call``).

Warm-up: ``warmup()`` compiles every program from shapes alone before serving;
``start_warmup()`` does it on background threads while the scheduler already serves (a
request waits only for the programs it needs, the most needed compile first, and prefill uses
the widths compiled so far; ``Warmup`` says what is left).

Decode steps run as two programs, the forward pass and its sampling: the host builds the step's
``TokenRules`` in between, while the device runs the forward pass. A row with a grammar
(``Request.grammar``, ``_grammar``) gets its next-token bitmask there, from llguidance (checked at
``submit``: a schema it cannot compile is the caller's ``ValueError``).

Speculative decoding (``speculation``, ``_drafts``, ``_verify``): a step in which some row
drafts is one verify program over every row (the others feed one token, as in a plain step);
each row emits its kept drafts and one more token through the same ``_push``. Rows whose next
tokens have rules (a grammar, a tool-choice forcer) or that report logprobs draft nothing; the
cache's write position advances by the verify width, and compaction reclaims the gaps.

Prefix reuse: at each prompt end and turn end the row's state is snapshotted into a
``PrefixCache``; also at ``Request.snapshot_at`` (the end of a conversation that closing notes
follow, the start of a tool result that a compaction may replace) and where a prompt leaves a
stored or a waiting one (a branch point: the system prompt and tools many clients share, stored
by the first client whose prompt shows them shared and resumed by the rest). A request whose prompt extends a stored
sequence restores it and prefills only the rest.

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
import functools
import itertools
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence

import jax
import numpy as np

from ._drafts import Speculation, Speculator
from ._forcing import ToolChoiceForcer
from ._grammar import GrammarCompiler, RowGrammar
from ._handles import Failed, Finished, Handle, QueueFullError, TokenEvent, TokenLogprob, ToolChoice, TurnPlan
from ._healing import first_token_mask
from ._images import chunk_splice, image_digest
from ._logits import TokenRules, bitmask_words, pack_mask
from ._multihost import to_host
from ._prefix import PrefixCache, common_prefix_length, image_prefix_key
from ._programs import Logprobs, shapes_of
from ._requests import FINISH_LENGTH, Request, RowController
from ._sampling import SamplingParams
from ._warmup import Warmup

MAX_ALLOWED = 64  # widest tool-name branch constrained on device (wider ones sample freely)
MAX_BANNED = 4


@dataclasses.dataclass
class _Row:
    handle: Handle
    ctl: RowController
    forcer: ToolChoiceForcer | None
    grammar: RowGrammar | None
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
    snapshots: dict[int, int] = dataclasses.field(default_factory=dict)  # after call i, store the first n tokens


def prefill_widths(chunk: int) -> list[int]:
    """Every prefill call width a prompt can need, widest first: ``chunk`` and the powers of two
    below it (one program each)."""
    return sorted({chunk, *(1 << k for k in range(chunk.bit_length()) if 1 << k < chunk)}, reverse=True)


def plan_chunks(rest: Sequence[int], chunk: int, resumed: bool,
                widths: Collection[int] | None = None) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Prefill calls for the uncached part of a prompt.

    Every width comes from one fixed set, ``chunk`` and the powers of two below it
    (``prefill_widths``), so each compiles once (in ``Scheduler.warmup``).

    From scratch: the tokens before the last whole chunks go first, left-padded to the
    smallest width of the set that holds them (padding before the first token is exact: an
    identity KDA step with a zero conv input, as at the start of any sequence), then whole
    chunks: a 90-token prompt is one call of 128, not of 256.
    Resumed: no padding at all, since a zero conv input in the middle of a sequence would
    change the convolution window; whole chunks, then the remainder as descending powers of two.

    ``widths`` (default: the whole set) limits the calls to the widths compiled so far, while
    the warm-up runs (it must hold ``chunk``): a fresh prompt then pads its first call more, and
    a resumed one that needs a missing width gets None (the caller prefills it from scratch).
    """
    rest = np.asarray(rest, np.int32)
    if not resumed:
        head = len(rest) % chunk or chunk  # real tokens of the first call
        first = min(w for w in (prefill_widths(chunk) if widths is None else widths) if w >= head)
        padded = first - head + len(rest)
        tokens = np.zeros((padded,), np.int32)
        valid = np.zeros((padded,), bool)
        tokens[first - head:] = rest
        valid[first - head:] = True
        bounds = [0, *range(first, padded + 1, chunk)]
        return [(tokens[None, a:b], valid[None, a:b]) for a, b in zip(bounds, bounds[1:])]
    sizes = [chunk] * (len(rest) // chunk)
    left = len(rest) % chunk
    sizes += [1 << b for b in range(left.bit_length() - 1, -1, -1) if left >> b & 1]
    if widths is not None and not set(sizes) <= set(widths):
        return None
    out, at = [], 0
    for w in sizes:
        out.append((rest[None, at:at + w], np.ones((1, w), bool)))
        at += w
    return out


class Scheduler:
    """Continuous batching for one ``Engine`` (with a tokenizer).

    max_batch           decode slots.
    max_queue           waiting requests at most (``submit`` raises ``QueueFullError`` beyond).
    prefill_chunk       prefill call width (default: the engine's, at most 256).
    prefix_cache_bytes  bound of the session snapshot LRU (0 = off).
    min_snapshot        sequences shorter than this are not snapshotted.
    min_branch          a prompt that leaves a stored sequence is snapshotted where it leaves
                        it when they share at least this many tokens (a system prompt and tool
                        list; shorter shared heads, such as the chat template's, are not worth a
                        snapshot).
    sync                multi-host serving (``ProcessSync``): process 0 runs the loop and
                        broadcasts each turn's plan; the other processes run ``follow()``.
    speculation         a `Speculation` (default: the engine's): a decode step in which some
                        row drafts is a verify step (``_verify``) with each row's own draft
                        length; rows with a grammar, a tool-choice forcer or logprobs draft
                        nothing (their next token's rules are known one token at a time).
    """

    def __init__(self, engine, *, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int | None = None, prefix_cache_bytes: int = 256 << 20,
                 min_snapshot: int = 16, min_branch: int = 256, sync=None,
                 speculation: Speculation | None = None):
        if engine.tokenizer is None:
            raise ValueError("the scheduler needs an Engine built with a tokenizer")
        if max_batch < 1 or max_queue < 1 or min_snapshot < 1:
            raise ValueError(f"max_batch={max_batch}, max_queue={max_queue}, min_snapshot={min_snapshot}: "
                             "each must be >= 1")
        self.tokenizer = engine.tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.chunk = prefill_chunk or min(engine.prefill_chunk, 256)
        self.min_snapshot, self.min_branch = min_snapshot, min_branch
        self._sync = sync
        # The caller's sharding context, for the loop thread: jax keeps the mesh of
        # `jax.set_mesh` per thread and k31jax's rule table is a context variable; programs
        # traced without them would drop the model's sharding (and recompile).
        self._mesh = jax.sharding.get_mesh()
        self._context = contextvars.copy_context()
        self.max_len = engine.max_len
        self.scratch_len = engine.max_len + self.chunk  # a prompt's prefill cache (its last call may overrun)
        self.core = engine.core.fork()
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
        self._warmup: Warmup | None = None
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self.grammar_seconds: collections.deque[float] = collections.deque(maxlen=4096)  # per masked row-step
        # (seconds, rows) of recent decode steps: dispatch to every row's token handled
        self.step_seconds: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)
        speculation = speculation or engine.speculation
        self.speculator = None if speculation is None else Speculator(speculation)
        self._reset_device_state()

    @property
    def compile_counts(self) -> collections.Counter[str]:
        """Programs compiled per kind by this scheduler (stable once warmed up)."""
        return self.core.programs.compile_counts

    # ---- lifecycle ----------------------------------------------------------------------
    def _reset_device_state(self) -> None:
        b = self.max_batch
        self.cache = self.core.new_cache(b, self.max_len)
        self.pos = 0
        self.sampler = self.core.new_sampler([SamplingParams()] * b, [[0]] * b)
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

    def warmup(self, workers: int = 1) -> float:
        """Compile every serving program now (``warmup_steps``: a prompt's prefill at each
        width, the first token, insertion, decode, snapshots, restore and compaction), on
        `workers` threads, running none of them; afterwards nothing compiles again. Multi-host
        (``sync``): every process runs it before serving, so all of them plan alike. Returns
        compile seconds (summed over the workers)."""
        before = self.core.programs.compile_seconds
        warm = Warmup(self.warmup_steps(), self._context)
        warm.start(workers, self._mesh, lambda: self._stop)
        warm.join()
        if warm.error is not None:
            raise warm.error
        return self.core.programs.compile_seconds - before

    def start_warmup(self, workers: int = 1, on_done: Callable[["Warmup"], None] | None = None) -> "Warmup":
        """``warmup`` on background threads while the scheduler already serves: a request that
        needs a program still compiling waits for it, prefill calls use the widths compiled so
        far (``plan_chunks``), the most needed programs compile first. `on_done(status)` runs
        on a warm-up thread at the end. Not with ``sync``: processes must plan alike."""
        if self._sync is not None:
            raise RuntimeError("multi-host serving warms up before it serves: call warmup() on every process")
        self._warmup = Warmup(self.warmup_steps(), self._context, on_done)
        self._warmup.start(workers, self._mesh, lambda: self._stop)
        return self._warmup

    @property
    def warmup_status(self) -> "Warmup | None":
        """The background warm-up (``start_warmup``), or None."""
        return self._warmup

    def warmup_steps(self) -> list[tuple[str, Callable[[], object]]]:
        """(label, compile it) for every serving program, what the first request needs first:
        the full-width prefill, decode, the first token, insertion, snapshots, restore,
        compaction, then the narrower prefill widths. Programs run on shapes only
        (``ProgramCache``, ``shapes_of``); a step that needs another's outputs compiles or waits
        for it first, so the steps may run in any order, on several threads."""
        core, b = self.core, self.max_batch
        scratch = core.abstract_cache(1, self.scratch_len)
        cache, sampler = shapes_of(self.cache), shapes_of(self.sampler)

        def prefill(width: int = self.chunk):
            return core.prefill(scratch, core.prefill_call(np.zeros((1, width), np.int32), np.ones((1, width), bool)))

        def first():
            return core.first(prefill().logits, [SamplingParams()], [[0]], self._token_rules([None]),
                              with_logprobs=True)

        def forward():
            return core.decode_logits(cache, np.zeros((b,), np.int32))

        def decode():
            return core.sample(forward().logits, sampler, self._token_rules([None] * b), with_logprobs=True)

        def decode_cache():
            return forward().cache

        def verify(width: int):
            fed = np.zeros((b, width), np.int32)
            return core.verify(cache, fed, np.zeros((b,), np.int32), sampler, self._token_rules([None] * b))

        verify_steps = [] if self.speculator is None else [
            (f"verify {w}", functools.partial(verify, w)) for w in self.speculator.widths()]
        steps = [(f"prefill {self.chunk}", prefill), ("decode", forward), ("sample", decode), ("first token", first),
                 ("insert", lambda: core.insert(cache, prefill().cache, 0, 0)),
                 ("sampler insert", lambda: core.insert_sampler_row(sampler, first().sampler, 0)),
                 ("prompt snapshot", lambda: core.compile_snapshot(prefill().cache)),
                 ("turn-end snapshot", lambda: core.compile_snapshot(decode_cache())),
                 ("restore", lambda: core.compile_restore(core.compile_snapshot(prefill().cache), self.scratch_len)),
                 ("compact", lambda: core.compact(decode_cache(), np.zeros((b,), bool)))]
        return (steps + verify_steps
                + [(f"prefill {w}", functools.partial(prefill, w)) for w in prefill_widths(self.chunk)[1:]])

    # ---- submission ---------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise ``ValueError`` for a request that can never run here."""
        n = len(req.prompt)
        if n + req.max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {n} tokens + max_tokens {req.max_new_tokens} exceeds the "
                             f"context length {self.max_len}")
        if req.chat_format != "k3" and req.thinking_budget is not None:
            raise ValueError("the server's thinking budget supports the K3 format only")
        self.core.check(req)

    def submit(self, req: Request, *, tool_choice: ToolChoice | None = None, logprobs: bool = False,
               sink: Callable[[object], None] | None = None) -> Handle:
        self.check(req)
        if req.grammar is not None and tool_choice is not None:  # the grammar holds the choice: no forcer runs
            forced = tool_choice.mode in ("required", "named")  # one forced call ends the turn, as the forcer's
            req = dataclasses.replace(req, grammar=dataclasses.replace(
                req.grammar, tool_choice=tool_choice.mode, name=tool_choice.name,
                parallel=req.grammar.parallel and not forced))
        # A grammar is compiled here, on the caller's thread: a bad schema is the caller's error.
        args_room = 0 if req.grammar is None else self.grammar_compiler.room(req.grammar, req.prompt)
        if tool_choice is not None and tool_choice.mode != "none":
            room = ToolChoiceForcer(self.tokenizer, tool_choice.mode, tool_names=tool_choice.names,
                                    name=tool_choice.name, prompt_ids=req.prompt,
                                    max_new_tokens=req.max_new_tokens, args_room=args_room).min_new_tokens
            if req.max_new_tokens < room:
                what = "with its shortest valid arguments" if args_room else "alone, its arguments more"
                raise ValueError(f"max_tokens {req.max_new_tokens} is too small for the forced tool call: its "
                                 f"markup {what} takes up to {room} tokens")
        with self._lock:
            if self._queued >= self.max_queue:
                raise QueueFullError(f"{self._queued} requests waiting (max_queue={self.max_queue})")
            self._queued += 1
        h = Handle(req, tool_choice, logprobs, sink)
        self._inbox.put(h)
        self._wake.set()
        return h

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """llguidance for this scheduler's tokenizer, built at the first grammar request."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer)
            return self._grammars

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
                # While rows decode, one call per turn; a resumed prompt's short rest (up to one
                # chunk, in a few narrower calls) goes at once: spread over turns, each of its
                # calls would wait a decode step.
                p = self._prefill
                rest = sum(t.shape[1] for t, _ in p.chunks[p.next_chunk:])
                decoding = any(r is not None for r in self.rows)
                self._prefill_step(all_chunks=not decoding or rest <= self.chunk)
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
        pad_id = self.core.media_pad_id
        key = image_prefix_key(prompt, pad_id, [(image_digest(im), im.num_tokens) for im in req.images])
        snap = self.prefix.longest_prefix(key) if self.prefix.max_bytes else None
        marks = list(req.snapshot_at)
        if self.prefix.max_bytes:  # where this prompt leaves a stored or a waiting one (a shared system prompt)
            waiting = [w.request.prompt for w in itertools.islice(self._waiting, 16) if not w.request.images]
            branch = max([self.prefix.shared_length(key), *(common_prefix_length(key, w) for w in waiting)])
            if branch >= self.min_branch:
                marks.append(branch)
        planned = self._plan_prefill(prompt, len(snap.tokens), marks) if snap is not None else None
        if planned is None:  # nothing stored, or (warm-up) a resumed plan needs a width not compiled yet
            snap, planned = None, self._plan_prefill(prompt, 0, marks)
        if snap is not None:
            scratch, cached = self.core.restore(snap, self.scratch_len), len(snap.tokens)
        else:
            scratch, cached = self.core.new_cache(1, self.scratch_len), 0
        chunks, snapshots = planned
        rows = self.core.image_rows(req)  # the vision model, once per request
        first_row = sum(t == pad_id for t in prompt[:cached]) if rows is not None else 0
        self._prefill = _Prefill(h, scratch, chunks, cached, key=key, image_rows=rows, next_row=[first_row],
                                 snapshots=snapshots)

    def _plan_prefill(self, prompt: list[int], cached: int, marks: Sequence[int]):
        """(prefill calls for `prompt[cached:]`, {call index: n} to snapshot the prompt's first n
        tokens after that call), or None when a resumed prompt needs a width the warm-up has not
        compiled yet. The calls split at each mark (``Request.snapshot_at``, the point where the
        prompt leaves a stored sequence) that lies inside the uncached part and is long enough
        to store."""
        widths = self._usable_widths()
        stops = sorted({m for m in marks if cached < m < len(prompt) and m >= self.min_snapshot}
                       if self.prefix.max_bytes else ())
        for split in (stops, []):  # (while the warm-up runs, a split may need a width not compiled yet)
            chunks, snapshots, start = [], {}, cached
            for end in [*split, len(prompt)]:
                part = plan_chunks(prompt[start:end], self.chunk, resumed=start > 0, widths=widths)
                if part is None:
                    break
                chunks += part
                if end < len(prompt):
                    snapshots[len(chunks) - 1] = end
                start = end
            else:
                return chunks, snapshots
        return None

    def _usable_widths(self) -> set[int] | None:
        """The prefill widths a plan may use: while a background warm-up runs, those compiled
        so far and ``chunk`` (the first it compiles: a request waits for it); else all of them
        (each compiled on first use)."""
        if self._warmup is None or not self._warmup.running:
            return None
        return self.core.programs.prefill_widths | {self.chunk}

    def _prefill_step(self, all_chunks: bool) -> None:
        p = self._prefill
        while p.next_chunk < len(p.chunks):
            tokens, valid = p.chunks[p.next_chunk]
            splice_ids = spliced = None
            if p.image_rows is not None:  # the pads of this chunk take the request's next image rows
                splice_ids = np.where(valid, tokens, -1)
                spliced = chunk_splice(splice_ids, [p.image_rows], p.next_row, self.core.media_pad_id)
            prefilled = self.core.prefill(p.scratch, self.core.prefill_call(tokens, valid, splice_ids, spliced))
            p.logits, p.scratch = prefilled.logits, prefilled.cache
            if p.next_chunk in p.snapshots:  # a conversation before its closing notes, a shared prefix
                self.prefix.put(self.core.snapshot(p.scratch, 0, p.key[:p.snapshots[p.next_chunk]]))
            p.next_chunk += 1
            if not all_chunks:
                break
        if p.next_chunk == len(p.chunks):
            self._prefill = None
            self._join(p)

    def _join(self, p: _Prefill) -> None:
        h, req = p.handle, p.handle.request
        slot = self.rows.index(None)
        ctl = self.core.controller(slot, req)
        tc = h.tool_choice
        grammar = (None if req.grammar is None
                   else self.grammar_compiler.row(req.grammar, req.prompt, req.max_new_tokens))
        # A grammar row's tool choice is its grammar's; its closing tiers keep the room the call
        # needs (`_grammar`, "Closing"). The forcer serves rows without a grammar.
        forcer = None if tc is None or grammar is not None else ToolChoiceForcer(
            self.tokenizer, tc.mode, tool_names=tc.names, name=tc.name, prompt_ids=req.prompt,
            max_new_tokens=req.max_new_tokens)
        n = len(req.prompt)
        row = _Row(h, ctl, forcer, grammar, n, p.cached_tokens, 0.0, key=p.key)
        self.stats["grammar_requests"] += grammar is not None
        rules = self._token_rules([row], healed=[req.healed_prefix])
        step = self.core.first(p.logits, [req.params], [req.prompt], rules, with_logprobs=True)
        self.pos = max(self.pos, n)
        self.cache = self.core.insert(self.cache, p.scratch, slot, self.pos)
        self.sampler = self.core.insert_sampler_row(self.sampler, step.sampler, slot)
        tok = int(to_host(step.token)[0])
        row.t_first = time.perf_counter()
        self.rows[slot] = row
        if self.speculator is not None:
            self.speculator.add(slot, req.prompt)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += n
        self.stats["cached_tokens"] += p.cached_tokens
        self.ttft_seconds.append(row.t_first - h.submitted)
        self._push(slot, tok, step.logprobs, 0)
        # The prompt's snapshot (the scratch is not donated to `insert`) is taken after the
        # first token went out, so copying it to the host adds nothing to time to first token.
        if n >= self.min_snapshot and self.prefix.max_bytes:
            self.prefix.put(self.core.snapshot(p.scratch, 0, p.key))

    def _token_rules(self, rows: Sequence[_Row | None], healed: Sequence[bytes] | None = None) -> TokenRules:
        """The rules of each row's next token: forced / allowed / banned ids (``_row_rules``)
        and a bitmask, every id allowed but where a grammar row's matcher or token healing
        (`healed`: each row's healed prefix, first token only) says otherwise."""
        rules = _row_rules(rows)
        if healed is not None and any(healed):
            bitmask = pack_mask(first_token_mask(self.tokenizer, healed, self.vocab))
        else:
            bitmask = np.full((len(rows), bitmask_words(self.vocab)), -1, np.int32)
        grammars = [(i, r.grammar) for i, r in enumerate(rows) if r is not None and r.grammar is not None
                    and rules.force[i] < 0 and not r.grammar.broken]
        if grammars:
            t0 = time.perf_counter()
            masks = np.full((len(rows), bitmask.shape[1]), -1, np.int32)
            self.grammar_compiler.fill(grammars, masks)
            bitmask &= masks
            self.grammar_seconds.extend([(time.perf_counter() - t0) / len(grammars)] * len(grammars))
        return rules.with_bitmask(bitmask)

    # ---- decode -------------------------------------------------------------------------
    def _decode_step(self) -> None:
        live = np.asarray([r is not None for r in self.rows])
        drafts = self._drafts()
        width = self.speculator.width(drafts, int(live.sum())) if drafts else 0
        if self.pos + max(width, 1) > self.max_len:
            self.cache = self.core.compact(self.cache, live)
            self.pos = int(to_host(self.cache.pos))
            self.stats["compactions"] += 1
        if width and self.pos + width <= self.max_len:
            self._verify_step(live, drafts, width)
            return
        # The forward pass is dispatched first; the rules (a grammar's bitmask) are built on the
        # host while it runs, then sampled on.
        t0, compiled = time.perf_counter(), self.core.programs.compile_seconds
        forward = self.core.decode_logits(self.cache, self.host_tokens)
        rules = self._token_rules(self.rows)
        step = self.core.sample(forward.logits, self.sampler, rules, with_logprobs=True)
        self.cache, self.sampler = forward.cache, step.sampler
        self.pos += 1
        host = to_host(step.token)
        self._token_times.append((time.perf_counter(), int(live.sum())))
        for slot, r in enumerate(self.rows):
            if r is not None:
                self._push(slot, int(host[slot]), step.logprobs, slot)
        # Steps are timed with the host work on their tokens (a verify step's several per row)
        if self.speculator is not None and self.core.programs.compile_seconds == compiled:
            self.speculator.timed(int(live.sum()), 0, time.perf_counter() - t0)
        self.step_seconds.append((time.perf_counter() - t0, int(live.sum())))

    def _drafts(self) -> dict[int, list[int]]:
        """Each drafting row's draft for this step: rows without a grammar, a tool-choice forcer
        or logprobs, at most one fewer tokens than they may still emit unforced."""
        if self.speculator is None:
            return {}
        limits = {slot: min(r.ctl.unforced_run(), r.ctl.req.max_new_tokens - len(r.ctl.tokens)) - 1
                  for slot, r in enumerate(self.rows)
                  if r is not None and r.grammar is None and r.forcer is None and not r.handle.logprobs}
        return self.speculator.drafts(limits)

    def _verify_step(self, live: np.ndarray, drafts: dict[int, list[int]], width: int) -> None:
        """A decode step that verifies each drafting row's draft (`_verify`): every row emits
        its kept drafts and one token more; a row without a draft, its one token."""
        t0, compiled = time.perf_counter(), self.core.programs.compile_seconds
        fed = np.zeros((self.max_batch, width), np.int32)
        fed[:, 0] = self.host_tokens
        lengths = np.zeros((self.max_batch,), np.int32)
        for slot, d in drafts.items():
            fed[slot, 1:1 + len(d)] = d
            lengths[slot] = len(d)
        verified = self.core.verify(self.cache, fed, lengths, self.sampler, self._token_rules(self.rows))
        self.cache, self.sampler = verified.cache, verified.sampler
        self.pos += width
        out, kept = to_host(verified.tokens), to_host(verified.kept)
        self.speculator.verified(drafts, {slot: int(kept[slot]) - 1 for slot in drafts})
        self.stats["verify_steps"] += 1
        self._token_times.append((time.perf_counter(), int(kept[live].sum())))
        for slot, r in enumerate(self.rows):
            if r is None:
                continue
            for j in range(int(kept[slot])):
                self._push(slot, int(out[slot, j]), verified.logprobs, slot)
                if self.rows[slot] is not r:  # finished
                    break
        if self.core.programs.compile_seconds == compiled:  # timed with the host work on its tokens
            self.speculator.timed(int(live.sum()), width, time.perf_counter() - t0)
        self.step_seconds.append((time.perf_counter() - t0, int(live.sum())))

    def _push(self, slot: int, tok: int, lp: Logprobs, lp_row: int) -> None:
        r = self.rows[slot]
        self.host_tokens[slot] = tok
        delta = r.ctl.push(tok)
        if self.speculator is not None:
            self.speculator.emitted(slot, [tok])
        if r.forcer is not None:
            r.forcer.push(tok)
        if r.grammar is not None and not r.grammar.broken:
            r.grammar.push(tok)
            if r.grammar.broken:  # a forced id the grammar refused (a budget cut the reply short)
                self.stats["grammar_broken"] += 1
        logprob = None
        if r.handle.logprobs:
            chosen, top_ids, top_lp = to_host(lp.chosen), to_host(lp.top_ids), to_host(lp.top)
            logprob = TokenLogprob(float(chosen[lp_row]),
                                   tuple(zip(top_ids[lp_row].tolist(), top_lp[lp_row].tolist())))
        self.stats["generated_tokens"] += 1
        r.handle.sink(TokenEvent(delta, logprob))
        if r.ctl.done:
            self._finish(slot)

    def _finish(self, slot: int) -> None:
        r = self.rows[slot]
        self.rows[slot] = None
        if self.speculator is not None:
            self.speculator.drop(slot)
        gen = r.ctl.tokens
        fed = list(r.key) + gen[:-1]  # the last id was never fed to the model
        if len(gen) > 1 and len(fed) >= self.min_snapshot and self.prefix.max_bytes:
            self.prefix.put(self.core.snapshot(self.cache, slot, fed))
        now = time.perf_counter()
        completion = r.ctl.completion(r.prompt_tokens)
        if r.forcer is not None and r.forcer.cut:  # max_new_tokens closed the call early, not the model
            completion = dataclasses.replace(completion, finish_reason=FINISH_LENGTH)
        r.handle.sink(Finished(completion, r.cached_tokens,
                               r.t_first - r.handle.submitted, now - r.handle.submitted))


def _row_rules(rows: Sequence[_Row | None]) -> TokenRules:
    """Each row's forced / allowed / banned ids for its next token (``MAX_ALLOWED`` allowed and
    ``MAX_BANNED`` banned ids at most): the thinking budget's forced id first, then the
    tool-choice forcer's."""
    b = len(rows)
    force = np.full((b,), -1, np.int32)
    allowed = np.full((b, MAX_ALLOWED), -1, np.int32)
    banned = np.full((b, MAX_BANNED), -1, np.int32)
    for i, row in enumerate(rows):
        if row is None:
            continue
        force[i] = row.ctl.force()
        if force[i] >= 0 or row.forcer is None:
            continue
        f, allow, ban = row.forcer.constraint()
        force[i] = f
        if allow is not None and len(allow) <= MAX_ALLOWED:
            allowed[i, :len(allow)] = allow
        banned[i, :min(len(ban), MAX_BANNED)] = ban[:MAX_BANNED]
    return TokenRules(force, allowed, banned)
