"""A slot cache for continuous batching: the pure functions behind the core's slot verbs
(``GenerationCore.insert`` / ``compact`` / ``snapshot`` / ``restore``; each one program of
``_programs.PROGRAMS``, compiled once whatever the request mix).

The decode cache holds ``max_batch`` rows (slots) with one global write position ``pos`` and
per-row ``key_valid``. The model has no positional encoding (KDA is recurrent, MLA is NoPE), so
a decode query attends to its own row's valid keys wherever they sit. That lets a request join
between decode steps:

- prefill: the request's prompt is prefilled on a **batch-1 scratch** cache in calls of fixed
  widths (``_scheduler.plan_chunks``), interleaved with decode steps.
- ``restore_cache``: a scratch cache from a host ``Snapshot`` (prefix reuse).
- ``insert_row``: its KDA recurrent / conv state is copied into a free slot, and its valid MLA
  latent / rope-key / indexer-key rows are gathered to positions ``[pos - n, pos)`` of that
  slot (``pos`` first raised to ``n`` if it is smaller; the other rows then simply have a gap
  of invalid keys).
- ``compact_rows``: when ``pos`` reaches the cache length, every live row's valid keys move to
  the front (a stable gather) and ``pos`` becomes the longest row; freed rows are cleared.
- ``extract_row``: one row's state with its valid keys gathered to the front (a snapshot for
  prefix reuse; the host keeps the first ``n`` positions).
- decode: one step for every slot with per-row sampling and ``TokenRules`` (forcing, an
  allow-list of next ids for constrained tool names, a ban-list of stop ids before a forced
  tool call).

Invariant: no row has a valid key at or after ``pos``.

Every cache returned here is pinned to the cache's logical sharding (a no-op without a mesh),
as the model's own prefill / decode outputs are: under a mesh a fresh, restored, inserted or
compacted cache then has the same signature as a prefilled one, so each program compiles once,
in warm-up, not again for a cache that came from elsewhere.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..nn import Cache, constrain_cache

MLA_FIELDS = ("mla_ckv", "mla_kpe", "index_keys")
STATE_FIELDS = ("kda_state", "kda_conv")


@dataclasses.dataclass
class Snapshot:
    """One sequence's cache state on the host: KDA / conv state after ``len(tokens)`` tokens and
    the MLA latent, rope-key and indexer-key rows of those tokens (in order)."""

    tokens: tuple[int, ...]
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values()) + 8 * len(self.tokens)


def _valid_first(valid: jax.Array) -> jax.Array:
    """Indices that put valid positions first, in order (stable), along the last axis."""
    return jnp.argsort(~valid, axis=-1, stable=True)


def insert_row(cache: Cache, scratch: Cache, slot, pos) -> Cache:
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


def compact_rows(cache: Cache, live) -> Cache:
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


def extract_row(cache: Cache, slot):
    """(row `slot`'s fields, its valid keys first; its number of valid keys)."""
    valid = cache.key_valid[slot]
    order = _valid_first(valid)
    out = {name: getattr(cache, name)[:, slot] for name in STATE_FIELDS if getattr(cache, name) is not None}
    for name in MLA_FIELDS:
        buf = getattr(cache, name)
        if buf is not None:
            out[name] = jnp.take(buf[:, slot], order, axis=1)
    return out, jnp.sum(valid.astype(jnp.int32))


def restore_cache(fields: dict, key_valid, pos) -> Cache:
    return constrain_cache(Cache(**fields, key_valid=key_valid, pos=pos))


def snapshot_of(extracted: dict[str, np.ndarray], tokens) -> Snapshot:
    """The `Snapshot` of `tokens` from `extract_row`'s fields on the host (MLA rows cut to the
    tokens)."""
    n = len(tokens)
    return Snapshot(tuple(tokens), {name: a[:, :n] if name in MLA_FIELDS else a for name, a in extracted.items()})


def scratch_fields(snap: Snapshot, length: int) -> tuple[dict, np.ndarray, np.int32]:
    """`restore_cache`'s arguments for a batch-1 cache of `length` positions holding `snap` at
    positions ``[0, n)``, ``pos = n``."""
    n = len(snap.tokens)
    fields = {}
    for name in STATE_FIELDS + MLA_FIELDS:
        a = snap.arrays.get(name)
        if a is None:
            fields[name] = None
        elif name in MLA_FIELDS:
            full = np.zeros((a.shape[0], 1, length) + a.shape[2:], a.dtype)
            full[:, 0, :n] = a
            fields[name] = full
        else:
            fields[name] = a[:, None]
    valid = np.zeros((1, length), bool)
    valid[0, :n] = True
    return fields, valid, np.int32(n)


def scratch_shapes(extracted: dict[str, jax.ShapeDtypeStruct], length: int) -> tuple[dict, np.ndarray, np.int32]:
    """`scratch_fields` from the shapes of `extract_row`'s fields (host arrays, as a restore
    gets them): compiles the restore program without a snapshot."""
    fields = {}
    for name in STATE_FIELDS + MLA_FIELDS:
        a = extracted.get(name)
        if a is None:
            fields[name] = None
        elif name in MLA_FIELDS:
            fields[name] = jax.ShapeDtypeStruct((a.shape[0], 1, length) + a.shape[2:], a.dtype)
        else:
            fields[name] = jax.ShapeDtypeStruct((a.shape[0], 1) + a.shape[1:], a.dtype)
    return fields, np.zeros((1, length), bool), np.int32(1)
