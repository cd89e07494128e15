"""The generation programs: every jitted function of the generation core, in one table.

Each ``Program`` of ``PROGRAMS`` declares its jit settings once (static and donated argument
names) and what it takes of the model: "model" programs start with ``(graphdef, backends,
state)`` and "vision" programs with the vision tower's ``(graphdef, state)``, which the core
supplies and leaves out of the program's cache key (they are its own, fixed). A
``ProgramCache`` compiles each program once per (kind, static arguments, signature of the
other arguments), explicitly (``lower().compile()``, timed apart).

The model is called in three places only, ``_prefill_logits``, ``_step_logits`` and
``_verify`` (speculative decoding: the forward pass over each row's drafts with every
position's KDA state kept, ``_verify.accept_drafts``, and the rollback to the kept tokens, in
one program compiled once per (batch, width)).

Sampling runs inside the first-token and decode programs with per-row arrays (``_sampling``)
and per-row ``TokenRules`` (``_logits``); the caches and the sampler state (its ``seen``
mask) are donated. The scheduler runs a decode step as two programs, the forward pass
(``decode_logits``) and its sampling (``sample``), so that the host builds the step's rules (a
grammar's bitmask) while the device runs the forward pass.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..nn import Cache, constrain_cache, init_cache
from ..sharding import constrain
from ..vision import splice_image_embeddings
from ._logits import TokenRules
from ._sampling import SamplerState, SamplingParams, make_sampler_state, sample_tokens, sampler_arrays
from ._slots import compact_rows, extract_row, insert_row, restore_cache
from ._verify import Verified, accept_drafts

TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)


# ---- outputs ----------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefilled:
    """One prefill call: the logits of each row's last position `[B, V]` and the continued cache."""

    logits: jax.Array
    cache: Cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Logprobs:
    """The model's log-probabilities (before sampling filters) of the sampled ids `[B]` and of
    the `TOP_LOGPROBS` best ids `[B, K]`, best first."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Step:
    """One sampled token per row: the ids `[B]`, the advanced sampler state, the advanced cache
    (decode; None after the first token, whose cache came from prefill) and, when asked for,
    `Logprobs`."""

    token: jax.Array
    sampler: SamplerState
    cache: Cache | None = None
    logprobs: Logprobs | None = None


# ---- the model's calls ------------------------------------------------------------------
def _prefill_logits(model, tokens, cache: Cache, valid, backends, embeds=None) -> Prefilled:
    """Logits of the last position only: the head runs on `[B, D]`, not `[B, T, V]`."""
    out = model.hidden_states(tokens, cache, valid=valid, backends=backends, embeds=embeds)
    return Prefilled(model.logits(out.hidden[:, -1:])[:, 0], out.cache)


def _step_logits(model, tokens, cache: Cache, backends) -> tuple[jax.Array, Cache]:
    """Logits `[B, T, V]` of every fed position, and the continued cache."""
    out = model(tokens, cache, backends=backends)
    return out.logits, out.cache


# ---- the programs -----------------------------------------------------------------------
def image_prefill_embeds(model, tokens, splice_ids, rows, pad_id):
    """The layer stack's input of an image prefill call: the token embeddings with row k of
    `rows` at the k-th `pad_id` position of `splice_ids` (-1 where nothing is spliced), row-major.
    `rows` is zero-padded to the call's `B * w` (fixed shape), so this runs traced: the count
    check of `splice_image_embeddings` is for concrete ids; requests are checked at admission
    (`check_image_request`)."""
    return splice_image_embeddings(model.embed_tokens(tokens), splice_ids, rows, pad_id)


def _prefill(graphdef, backends, state, cache: Cache, tokens, valid) -> Prefilled:
    return _prefill_logits(nnx.merge(graphdef, state), tokens, cache, valid, backends)


def _prefill_image(graphdef, backends, state, cache: Cache, tokens, valid, splice_ids, rows, pad_id) -> Prefilled:
    """`_prefill` on `image_prefill_embeds`."""
    model = nnx.merge(graphdef, state)
    embeds = image_prefill_embeds(model, tokens, splice_ids, rows, pad_id)
    return _prefill_logits(model, tokens, cache, valid, backends, embeds)


def _vision(graphdef, state, inputs):
    return nnx.merge(graphdef, state)(inputs)


def _pin_sampler(sampler: SamplerState) -> SamplerState:
    """The sampler state's rows sharded like the cache's (no-op without a mesh)."""
    return jax.tree.map(lambda x: constrain(x, "batch", *[None] * (x.ndim - 1)), sampler)


def _init_sampler(arrays) -> SamplerState:
    """A sampler state with a step counter per row (rows may join at different steps)."""
    s = make_sampler_state(**arrays)
    return _pin_sampler(dataclasses.replace(s, step=jnp.zeros(arrays["temperature"].shape, jnp.int32)))


def _logprobs(logits, token) -> Logprobs:
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, top_ids = jax.lax.top_k(lp, min(TOP_LOGPROBS, lp.shape[-1]))
    return Logprobs(jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top)


def _sample(logits, sampler: SamplerState, rules: TokenRules, with_logprobs: bool, cache=None) -> Step:
    token, sampler = sample_tokens(rules.apply(logits), sampler, rules.force)
    return Step(token, _pin_sampler(sampler), cache, _logprobs(logits, token) if with_logprobs else None)


def _first(logits, arrays, rules: TokenRules, with_logprobs: bool = False) -> Step:
    """Each row's first token from its prefill logits; the sampler state starts here."""
    return _sample(logits, _init_sampler(arrays), rules, with_logprobs)


def _decode(graphdef, backends, state, cache: Cache, token, sampler, rules: TokenRules,
            with_logprobs: bool = False) -> Step:
    logits, cache = _step_logits(nnx.merge(graphdef, state), token[:, None], cache, backends)
    return _sample(logits[:, 0], sampler, rules, with_logprobs, cache)


def _decode_logits(graphdef, backends, state, cache: Cache, token) -> Prefilled:
    """`_decode`'s forward pass alone: the logits of each row's next token `[B, V]` and the
    continued cache. The scheduler samples them with ``_sample_logits`` once the host has built
    the step's rules, which it does while this runs (a grammar's bitmask)."""
    logits, cache = _step_logits(nnx.merge(graphdef, state), token[:, None], cache, backends)
    return Prefilled(logits[:, 0], cache)


def _sample_logits(logits, sampler, rules: TokenRules, with_logprobs: bool = False) -> Step:
    """`_decode`'s sampling alone, on `_decode_logits`' logits."""
    return _sample(logits, sampler, rules, with_logprobs)


def _verify(graphdef, backends, state, cache: Cache, tokens, lengths, sampler, rules: TokenRules) -> Verified:
    """One speculative verify step (`_verify.accept_drafts`): the forward pass over each row's
    last token and drafts `tokens [B, W]` keeping every position's KDA state, the kept drafts
    and the token after them, and the cache rolled back to what each row keeps."""
    out = nnx.merge(graphdef, state)(tokens, cache, backends=backends, trail=True)
    verified = accept_drafts(out.logits, tokens[:, 1:], lengths, sampler, rules)
    cache = constrain_cache(out.cache.rollback(verified.kept, tokens.shape[1]))
    logprobs = _logprobs(out.logits[:, 0], verified.tokens[:, 0])
    return dataclasses.replace(verified, sampler=_pin_sampler(verified.sampler), cache=cache, logprobs=logprobs)


def _init_cache(config, batch: int, max_len: int) -> Cache:
    return constrain_cache(init_cache(config, batch, max_len))


def _insert_sampler_row(sampler: SamplerState, row: SamplerState, slot) -> SamplerState:
    return _pin_sampler(jax.tree.map(lambda b, r: b.at[slot].set(r[0]), sampler, row))


# ---- the table --------------------------------------------------------------------------
# What the TPU compiler is told for every generation program (and for `k31jax compile`, so
# its report is of these programs). On TPU7x the compiler gives 16-bit arrays a (16, 128) tile
# inside loops while arguments keep (8, 128), and so relaid every bf16 weight stack the scan
# over layers reads, out of place, on every decode step: K3.1 Pro at 1M tokens on tpu7x:2x4x4,
# 12 GB of temporaries and 27 GB of traffic per step per chip (benchmarks/RESULTS.md "## compile").
TPU_COMPILER_OPTIONS = {"xla_tpu_control_large_2nd_minor_layout_for_x16": "false"}


@dataclasses.dataclass(frozen=True)
class Program:
    """One kind of program: its function, jit settings and what the core supplies.

    static  argument names jit treats as static (in the cache key by value).
    donate  argument names whose buffers the program reuses (caches, the sampler state).
    takes   "model" (first arguments `graphdef, backends, state`), "vision" (the tower's
            `graphdef, state`) or None: supplied by the core and left out of the cache key.
    """

    fn: Callable
    static: tuple[str, ...] = ()
    donate: tuple[str, ...] = ()
    takes: str | None = None

    @functools.cached_property
    def jitted(self):
        return jax.jit(self.fn, static_argnames=self.static, donate_argnames=self.donate)

    def compile(self, lowered, platform: str | None = None, options: dict | None = None):
        """`lowered` (this program's `jitted.lower(...)`) compiled as the engine compiles it:
        with `TPU_COMPILER_OPTIONS` for a TPU (`platform`, default the default backend's), and
        any other compiler `options` (e.g. dump flags)."""
        tpu = (platform or jax.default_backend()) == "tpu"
        merged = {**(TPU_COMPILER_OPTIONS if tpu else {}), **(options or {})}
        return lowered.compile(compiler_options=merged or None)

    @functools.cached_property
    def static_positions(self) -> frozenset[int]:
        names = list(inspect.signature(self.fn).parameters)
        return frozenset(names.index(name) for name in self.static)

    def position(self, name: str) -> int:
        return list(inspect.signature(self.fn).parameters).index(name)


PROGRAMS: dict[str, Program] = {
    "init_cache": Program(_init_cache, static=("config", "batch", "max_len")),
    "init_sampler": Program(_init_sampler),
    "vision": Program(_vision, static=("graphdef",), takes="vision"),
    "prefill": Program(_prefill, static=("graphdef", "backends"), donate=("cache",), takes="model"),
    "prefill_image": Program(_prefill_image, static=("graphdef", "backends"), donate=("cache",), takes="model"),
    "first": Program(_first, static=("with_logprobs",)),
    "decode": Program(_decode, static=("graphdef", "backends", "with_logprobs"), donate=("cache", "sampler"),
                      takes="model"),
    "decode_logits": Program(_decode_logits, static=("graphdef", "backends"), donate=("cache",), takes="model"),
    "sample": Program(_sample_logits, static=("with_logprobs",), donate=("sampler",)),
    "verify": Program(_verify, static=("graphdef", "backends"), donate=("cache", "sampler"), takes="model"),
    "insert": Program(insert_row, donate=("cache",)),
    "compact": Program(compact_rows, donate=("cache",)),
    "extract": Program(extract_row),
    "restore": Program(restore_cache),
    "insert_sampler_row": Program(_insert_sampler_row, donate=("sampler",)),
}
PREFILL_KINDS = ("prefill", "prefill_image")


def engine_program(kind: str) -> Program:
    """One of the generation programs ("prefill", "decode", ...): what `k31jax.aot` compiles
    ahead of time (`.jitted`), so a TPU report is about the engine's own programs (with their
    donated caches), not a look-alike."""
    if kind not in PROGRAMS:
        raise ValueError(f"no generation program {kind!r}: expected one of {', '.join(PROGRAMS)}")
    return PROGRAMS[kind]


def abstract_decode_inputs(vocab_size: int, batch: int) -> tuple:
    """`(token, sampler, rules)` of one static-engine decode step as ShapeDtypeStructs (nothing
    allocated)."""
    arrays = sampler_arrays([SamplingParams()] * batch, [[0]] * batch, vocab_size)
    sampler = jax.eval_shape(_init_sampler, arrays)
    ids = jax.ShapeDtypeStruct((batch,), jnp.int32)
    rules = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), TokenRules.forcing(np.zeros(batch)))
    return ids, sampler, rules


# ---- compiled programs ------------------------------------------------------------------
def _signature(tree) -> tuple:
    """A tree's structure, shapes, dtypes and shardings, with each ``NamedSharding`` spelled one
    way: jit outputs write an unsplit trailing axis as ``P(None)`` or leave it out (``P()``); a
    compiled program accepts either, so both must find it rather than compile it again."""
    leaves, treedef = jax.tree.flatten(tree)

    def plain(sharding):
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return sharding
        spec = tuple(sharding.spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        return sharding.mesh, spec, sharding.memory_kind

    return treedef, tuple((np.shape(x), jnp.result_type(x), plain(getattr(x, "sharding", None))) for x in leaves)


def shapes_of(tree):
    """``jax.ShapeDtypeStruct``s (shape, dtype, sharding, weak type) of a tree's device arrays;
    host values stay as they are. Running a program on them only compiles it."""
    def one(x):
        if isinstance(x, jax.Array):
            weak = getattr(x, "weak_type", False)  # key arrays have none
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=weak)
        return x
    return jax.tree.map(one, tree)


def _plain_struct(s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """An output's shape without its memory layout, as an argument to the next program (the
    arrays it stands for have the default layout)."""
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding, weak_type=s.weak_type)


class ProgramCache:
    """The compiled programs of one loop, each compiled once per signature; ``compile_counts``
    counts compiles per kind (tests check it stops growing), ``compile_seconds`` sums them.

    Thread-safe: a background warm-up (``Scheduler.start_warmup``) compiles programs while the
    scheduler thread runs others; a thread that needs a program another one is compiling waits
    for that compile. With ``jax.ShapeDtypeStruct`` leaves among a call's arguments nothing
    runs: the program is compiled (or found) and the call returns its outputs' shapes, so a
    warm-up can compile a whole serving sequence without allocating or running anything."""

    def __init__(self):
        self._compiled: dict[tuple, object] = {}
        self._compiling: dict[tuple, threading.Event] = {}
        self._lock = threading.Lock()
        self.compile_counts: collections.Counter[str] = collections.Counter()
        self.compile_seconds = 0.0
        self.prefill_widths: set[int] = set()  # token widths of the prefill programs compiled so far

    def run(self, kind: str, supplied: tuple, args: tuple):
        """Run program `kind` on `supplied + args` (compiling it first if new); only compile it
        and return its output shapes when `args` hold ``jax.ShapeDtypeStruct``s."""
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(args)):
            return self.output_shapes(kind, supplied, args)
        static = PROGRAMS[kind].static_positions
        return self.compiled(kind, supplied, args)(*(a for i, a in enumerate(supplied + args) if i not in static))

    def output_shapes(self, kind: str, supplied: tuple, args: tuple):
        """The output shapes of program `kind` on these arguments, compiling it but running nothing."""
        return jax.tree.map(_plain_struct, self.compiled(kind, supplied, args).out_info)

    def compiled(self, kind: str, supplied: tuple, args: tuple):
        """The program of `kind` for these arguments (arrays or their ``jax.ShapeDtypeStruct``s),
        compiled on first use. The key leaves out `supplied` (the core's model or tower)."""
        program = PROGRAMS[kind]
        n = len(supplied)
        static = tuple(a for i, a in enumerate(args) if i + n in program.static_positions)
        key = (kind, static, _signature([a for i, a in enumerate(args) if i + n not in program.static_positions]))
        while True:
            with self._lock:
                fn = self._compiled.get(key)
                if fn is not None:
                    return fn
                busy = self._compiling.get(key)
                if busy is None:
                    self._compiling[key] = threading.Event()
                    break
            busy.wait()  # another thread compiles it (if that failed, this one tries)
        try:
            t0 = time.perf_counter()
            fn = program.compile(program.jitted.lower(*supplied, *args))
            with self._lock:
                self._compiled[key] = fn
                self.compile_seconds += time.perf_counter() - t0
                self.compile_counts[kind] += 1
                if kind in PREFILL_KINDS:
                    self.prefill_widths.add(int(np.shape((supplied + args)[program.position("tokens")])[1]))
        finally:
            with self._lock:
                self._compiling.pop(key).set()
        return fn

    def programs_of(self, kind: str) -> list:
        """The compiled programs of `kind` (e.g. to read a decode step's cost analysis)."""
        with self._lock:
            return [fn for key, fn in self._compiled.items() if key[0] == kind]
