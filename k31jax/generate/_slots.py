"""Jitted programs of a slot cache for continuous batching (one compile each, any request mix).

The decode cache holds ``max_batch`` rows (slots) with one global write position ``pos`` and
per-row ``key_valid``. The model has no positional encoding (KDA is recurrent, MLA is NoPE), so
a decode query attends to its own row's valid keys wherever they sit. That lets a request join
between decode steps:

- ``prefill_chunk``: the request's prompt is prefilled on a **batch-1 scratch** cache in calls of
  fixed widths (``_scheduler.plan_chunks``), interleaved with decode steps.
- ``restore``: a scratch cache from a host ``Snapshot`` (prefix reuse).
- ``insert``: its KDA recurrent / conv state is copied into a free slot, and its valid MLA
  latent / rope-key / indexer-key rows are gathered to positions ``[pos - n, pos)`` of that
  slot (``pos`` first raised to ``n`` if it is smaller; the other rows then simply have a gap
  of invalid keys).
- ``compact``: when ``pos`` reaches the cache length, every live row's valid keys move to the
  front (a stable gather) and ``pos`` becomes the longest row; freed rows are cleared.
- ``extract``: one row's state with its valid keys gathered to the front (a snapshot for
  prefix reuse; the host keeps the first ``n`` positions).
- ``decode``: one step for every slot with per-row sampling, forcing, an optional per-row
  allow-list of next ids (constrained tool names) and a ban-list (stop ids before a forced
  tool call).

Invariant: no row has a valid key at or after ``pos``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from ..nn import Cache, constrain_cache, init_cache
from ..sharding import constrain
from ._engine import _prefill_fn, _prefill_image_fn, _signature
from ._sampling import make_sampler_state, sample_tokens

MLA_FIELDS = ("mla_ckv", "mla_kpe", "index_keys")
STATE_FIELDS = ("kda_state", "kda_conv")


def to_host(x) -> np.ndarray:
    """A device array's value on this host. An array sharded across processes (multi-host) is
    gathered first: a collective, so every process reads the same arrays in the same order."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _program_key(tree) -> tuple:
    """``_signature`` with each ``NamedSharding`` spelled one way: jit outputs write an unsplit
    trailing axis as ``P(None)`` or leave it out (``P()``); a compiled program accepts either,
    so both must find it rather than compile it again."""
    treedef, leaves = _signature(tree)

    def plain(sharding):
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return sharding
        spec = tuple(sharding.spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        return sharding.mesh, spec, sharding.memory_kind

    return treedef, tuple((shape, dtype, plain(sharding)) for shape, dtype, sharding in leaves)


def abstract(tree):
    """``jax.ShapeDtypeStruct``s (shape, dtype, sharding, weak type) of a tree's device arrays;
    host values stay as they are. Calling a ``SlotPrograms`` program on them only compiles it."""
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


def _valid_first(valid: jax.Array) -> jax.Array:
    """Indices that put valid positions first, in order (stable), along the last axis."""
    return jnp.argsort(~valid, axis=-1, stable=True)


def _restrict(logits, allowed, banned):
    """Rows whose ``allowed[i, 0] >= 0`` may only produce the ids in ``allowed[i]``; no row may
    produce an id in its ``banned[i]`` (both padded with -1)."""
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    ok = jnp.zeros((b, v), bool).at[rows, jnp.clip(allowed, 0, v - 1)].max(allowed >= 0)
    ok = ok | (allowed[:, :1] < 0)
    ok = ok & ~jnp.zeros((b, v), bool).at[rows, jnp.clip(banned, 0, v - 1)].max(banned >= 0)
    return jnp.where(ok, logits, -jnp.inf)


TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)


def _logprobs(logits, token):
    """The model's log-probabilities (before sampling filters): of ``token`` and the top ones."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, min(TOP_LOGPROBS, lp.shape[-1]))
    return jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp


def _first_fn(logits, arrays, force, allowed, banned, mask):
    sampler = make_sampler_state(**arrays)
    sampler = dataclasses.replace(sampler, step=jnp.zeros(logits.shape[:1], jnp.int32))
    token, sampler = sample_tokens(_restrict(jnp.where(mask, logits, -jnp.inf), allowed, banned), sampler, force)
    return token, _pin_sampler(sampler), _logprobs(logits, token)


def _decode_fn(graphdef, backends, state, cache: Cache, token, sampler, force, allowed, banned):
    logits, cache = nnx.merge(graphdef, state)(token[:, None], cache, backends=backends)
    token, sampler = sample_tokens(_restrict(logits[:, 0], allowed, banned), sampler, force)
    return token, cache, _pin_sampler(sampler), _logprobs(logits[:, 0], token)


def _insert_fn(cache: Cache, scratch: Cache, slot, pos) -> Cache:
    valid = scratch.key_valid[0]
    n = jnp.sum(valid.astype(jnp.int32))
    order = _valid_first(valid)
    j = jnp.arange(cache.max_len)
    src = j - (pos - n)
    ok = (src >= 0) & (src < n)
    idx = order[jnp.clip(src, 0, valid.shape[0] - 1)]
    out = {}
    for name in MLA_FIELDS:
        buf, new = getattr(cache, name), getattr(scratch, name)
        if buf is None:
            continue
        row = jnp.where(ok[None, :, None], jnp.take(new[:, 0], idx, axis=1), 0)
        out[name] = buf.at[:, slot].set(row.astype(buf.dtype))
    for name in STATE_FIELDS:
        buf = getattr(cache, name)
        if buf is not None:
            out[name] = buf.at[:, slot].set(getattr(scratch, name)[:, 0])
    return constrain_cache(cache.replace(**out, key_valid=cache.key_valid.at[slot].set(ok),
                                         pos=jnp.asarray(pos, jnp.int32)))


def _compact_fn(cache: Cache, live) -> Cache:
    valid = cache.key_valid & live[:, None]
    counts = jnp.sum(valid.astype(jnp.int32), axis=1)
    order = _valid_first(valid)  # [B, S]
    key_valid = jnp.arange(cache.max_len)[None, :] < counts[:, None]
    out = {}
    for name in MLA_FIELDS:
        buf = getattr(cache, name)
        if buf is not None:
            moved = jnp.take_along_axis(buf, order[None, :, :, None], axis=2)
            out[name] = jnp.where(key_valid[None, :, :, None], moved, 0).astype(buf.dtype)
    return constrain_cache(cache.replace(**out, key_valid=key_valid, pos=jnp.max(counts).astype(jnp.int32)))


def _extract_fn(cache: Cache, slot):
    valid = cache.key_valid[slot]
    order = _valid_first(valid)
    out = {name: getattr(cache, name)[:, slot] for name in STATE_FIELDS if getattr(cache, name) is not None}
    for name in MLA_FIELDS:
        buf = getattr(cache, name)
        if buf is not None:
            out[name] = jnp.take(buf[:, slot], order, axis=1)
    return out, jnp.sum(valid.astype(jnp.int32))


def _sampler_insert_fn(sampler, row, slot):
    return _pin_sampler(jax.tree.map(lambda b, r: b.at[slot].set(r[0]), sampler, row))


# Every cache these programs return is pinned to the cache's logical sharding (a no-op without
# a mesh), as the model's own prefill / decode outputs are: under a mesh a fresh, restored,
# inserted or compacted cache then has the same signature as a prefilled one, so each program
# compiles once, in warm-up, not again for a cache that came from elsewhere.
def _init_cache_fn(config, batch: int, max_len: int) -> Cache:
    return constrain_cache(init_cache(config, batch, max_len))


def _restore_fn(fields: dict, key_valid, pos) -> Cache:
    return constrain_cache(Cache(**fields, key_valid=key_valid, pos=pos))


def _init_sampler_fn(arrays):
    s = make_sampler_state(**arrays)
    return _pin_sampler(dataclasses.replace(s, step=jnp.zeros(arrays["temperature"].shape, jnp.int32)))


def _pin_sampler(sampler):
    """The sampler state's rows sharded like the cache's (``constrain_cache``, below)."""
    return jax.tree.map(lambda x: constrain(x, "batch", *[None] * (x.ndim - 1)), sampler)


# kind -> (jitted function, number of leading static arguments, donated argument indices)
_JITS = {
    "init_cache": (jax.jit(_init_cache_fn, static_argnums=(0, 1, 2)), 3),
    "init_sampler": (jax.jit(_init_sampler_fn), 0),
    "prefill_chunk": (jax.jit(_prefill_fn, static_argnums=(0, 1), donate_argnums=(3,)), 2),
    "prefill_image": (jax.jit(_prefill_image_fn, static_argnums=(0, 1), donate_argnums=(3,)), 2),
    "first": (jax.jit(_first_fn), 0),
    "decode": (jax.jit(_decode_fn, static_argnums=(0, 1), donate_argnums=(3, 5)), 2),
    "insert": (jax.jit(_insert_fn, donate_argnums=(0,)), 0),
    "compact": (jax.jit(_compact_fn, donate_argnums=(0,)), 0),
    "extract": (jax.jit(_extract_fn), 0),
    "restore": (jax.jit(_restore_fn), 0),
    "sampler_insert": (jax.jit(_sampler_insert_fn, donate_argnums=(0,)), 0),
}


@dataclasses.dataclass
class Snapshot:
    """One sequence's cache state on the host: KDA / conv state after ``len(tokens)`` tokens and
    the MLA latent, rope-key and indexer-key rows of those tokens (in order)."""

    tokens: tuple[int, ...]
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values()) + 8 * len(self.tokens)


class SlotPrograms:
    """Compiled slot-cache programs of one engine (model, backends), each compiled once per
    signature; ``compile_counts`` counts compiles per kind (a test checks it stops growing).

    Thread-safe: a background warm-up (``Scheduler.start_warmup``) compiles programs while the
    scheduler thread runs others; a thread that needs a program another one is compiling waits
    for that compile. With ``jax.ShapeDtypeStruct`` leaves among a call's arguments nothing
    runs: the program is compiled (or found) and the call returns its outputs' shapes, so the
    warm-up can compile the whole serving sequence without allocating or running anything."""

    def __init__(self, engine, max_batch: int, scratch_len: int):
        self.engine = engine
        self.config = engine.config
        self.max_batch, self.max_len, self.scratch_len = max_batch, engine.max_len, scratch_len
        self._programs: dict[tuple, object] = {}
        self._compiling: dict[tuple, threading.Event] = {}
        self._lock = threading.Lock()
        self.compile_counts: collections.Counter[str] = collections.Counter()
        self.compile_seconds = 0.0
        self.prefill_widths: set[int] = set()  # widths of the prefill programs compiled so far

    def call(self, kind: str, *args):
        n_static = _JITS[kind][1]
        fn = self.compiled(kind, *args)
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(args[n_static:])):
            return jax.tree.map(_plain_struct, fn.out_info)
        return fn(*args[n_static:])

    def compiled(self, kind: str, *args):
        """The program of `kind` for these arguments (arrays or their ``jax.ShapeDtypeStruct``s),
        compiled on first use."""
        jitted, n_static = _JITS[kind]
        static, dyn = args[:n_static], args[n_static:]
        uses_model = kind in ("prefill_chunk", "prefill_image", "decode")
        key = (kind, None if uses_model else static, _program_key(dyn[1:] if uses_model else dyn))
        while True:
            with self._lock:
                fn = self._programs.get(key)
                if fn is not None:
                    return fn
                busy = self._compiling.get(key)
                if busy is None:
                    self._compiling[key] = threading.Event()
                    break
            busy.wait()  # another thread compiles it (if that failed, this one tries)
        try:
            t0 = time.perf_counter()
            fn = jitted.lower(*args).compile()
            with self._lock:
                self._programs[key] = fn
                self.compile_seconds += time.perf_counter() - t0
                self.compile_counts[kind] += 1
                if kind in ("prefill_chunk", "prefill_image"):
                    self.prefill_widths.add(int(np.shape(args[4])[1]))  # tokens [1, w]
        finally:
            with self._lock:
                self._compiling.pop(key).set()
        return fn

    def abstract_cache(self, batch: int, length: int) -> Cache:
        """The shapes of ``new_cache(batch, length)``, compiling its program but running nothing."""
        return jax.tree.map(_plain_struct, self.compiled("init_cache", self.config, batch, length).out_info)

    # ---- typed wrappers -------------------------------------------------------------------
    def new_cache(self, batch: int, length: int) -> Cache:
        return self.call("init_cache", self.config, batch, length)

    def prefill_chunk(self, scratch: Cache, tokens: np.ndarray, valid: np.ndarray,
                      splice_ids: np.ndarray | None = None, spliced: np.ndarray | None = None):
        """One prefill call; with the engine's vision model, always the image program
        (`Engine.prefill_args`: `spliced` rows at the pad positions of `splice_ids`, or none)."""
        e = self.engine
        kind, data = e.prefill_args(tokens, valid, splice_ids, spliced)
        return self.call("prefill_chunk" if kind == "prefill" else kind, e.graphdef, e.backends, e.state, scratch,
                         *data)

    def first(self, logits, arrays, force: int, allowed: np.ndarray, banned: np.ndarray, mask: np.ndarray):
        """Sample a joining row's first token; `mask` `[V]` as in `first_token_mask`."""
        return self.call("first", logits, arrays, np.asarray([force], np.int32), allowed[None], banned[None],
                         mask[None])

    def decode(self, cache, token, sampler, force: np.ndarray, allowed: np.ndarray, banned: np.ndarray):
        e = self.engine
        return self.call("decode", e.graphdef, e.backends, e.state, cache, token, sampler, force,
                         allowed, banned)

    def insert(self, cache, scratch, slot: int, pos: int) -> Cache:
        return self.call("insert", cache, scratch, np.int32(slot), np.int32(pos))

    def compact(self, cache, live: np.ndarray) -> Cache:
        return self.call("compact", cache, live)

    def snapshot(self, cache, slot: int, tokens) -> Snapshot:
        arrays, n = self.call("extract", cache, np.int32(slot))
        n = int(to_host(n))
        if n != len(tokens):
            raise AssertionError(f"cache row holds {n} keys but {len(tokens)} tokens were fed")
        host = {}
        for name, a in arrays.items():
            a = to_host(a)
            host[name] = a[:, :n] if name in MLA_FIELDS else a
        return Snapshot(tuple(tokens), host)

    def restore(self, snap: Snapshot) -> Cache:
        """A batch-1 scratch cache holding ``snap`` at positions ``[0, n)``, ``pos = n``."""
        n, s2 = len(snap.tokens), self.scratch_len
        fields = {}
        for name in STATE_FIELDS + MLA_FIELDS:
            a = snap.arrays.get(name)
            if a is None:
                fields[name] = None
            elif name in MLA_FIELDS:
                full = np.zeros((a.shape[0], 1, s2) + a.shape[2:], a.dtype)
                full[:, 0, :n] = a
                fields[name] = full
            else:
                fields[name] = a[:, None]
        valid = np.zeros((1, s2), bool)
        valid[0, :n] = True
        return self.call("restore", fields, valid, np.int32(n))

    def compile_snapshot(self, cache) -> dict[str, jax.ShapeDtypeStruct]:
        """Compile ``snapshot``'s program for a cache of these shapes; its arrays' shapes."""
        arrays, _ = self.call("extract", cache, np.int32(0))
        return arrays

    def compile_restore(self, extracted: dict[str, jax.ShapeDtypeStruct]) -> None:
        """Compile ``restore`` for snapshots of ``extract``'s output shapes (host arrays, as
        ``restore`` gets them), running nothing."""
        s2 = self.scratch_len
        fields = {}
        for name in STATE_FIELDS + MLA_FIELDS:
            a = extracted.get(name)
            if a is None:
                fields[name] = None
            elif name in MLA_FIELDS:
                fields[name] = jax.ShapeDtypeStruct((a.shape[0], 1, s2) + a.shape[2:], a.dtype)
            else:
                fields[name] = jax.ShapeDtypeStruct((a.shape[0], 1) + a.shape[1:], a.dtype)
        self.call("restore", fields, np.zeros((1, s2), bool), np.int32(1))

    def init_sampler(self, arrays):
        return self.call("init_sampler", arrays)

    def sampler_insert(self, sampler, row, slot: int):
        return self.call("sampler_insert", sampler, row, np.int32(slot))
