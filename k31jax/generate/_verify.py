"""Speculative verification on the device: which of each row's drafted tokens the target model
keeps, in one forward pass over the drafts (docs/speculative.md).

A verify step feeds each row ``[last token, d_1 .. d_k]`` (``W = k + 1`` tokens, one width for
the batch; row i's own draft length ``L_i <= k``, the rest filler) with ``trail=True``, so the
logits at position j are the target's for the token after ``d_j`` and the cache keeps every
position's KDA state. `accept_drafts` then decides per row:

- **greedy** rows keep ``d_{j+1}`` while it is the argmax at position j;
- **sampling** rows keep it with probability ``p_j(d_{j+1})`` (the rejection rule of Leviathan
  et al. and Chen et al. for a draft that proposes one token with certainty, as an n-gram
  match does); at the first rejection the row draws from ``p_j`` without ``d_{j+1}``
  (renormalised), after the last kept draft from ``p_j`` itself. The tokens a row emits are
  then distributed exactly as the target's own, one step at a time;
- ``p_j`` is the distribution ``sample_tokens`` draws from: the repetition penalty (with the
  kept drafts before j counted as seen), temperature, top-k, top-p, min-p.

Every row emits ``n + 1`` tokens, n its kept drafts; ``Cache.rollback`` keeps the state after
them. ``TokenRules`` apply to position 0 only: a row the host constrains (a forced id, an
allow-list, a grammar's mask) drafts nothing. A row that drafts nothing draws its one token with
the key and distribution a plain decode step uses, so it samples the same id.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..nn import Cache
from ._logits import TokenRules
from ._sampling import SamplerState, filtered_logits, penalized_logits, row_keys


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified:
    """What a verify step returns.

    tokens   `[B, W]` int32: each row's emitted tokens first (``kept[i]`` of them), -1 after.
    kept     `[B]` int32: tokens row i emits (its kept drafts + 1), which its cache now holds
             after the fed last token.
    sampler  the advanced sampler state (step + kept, the emitted tokens seen).
    cache    the cache rolled back to each row's kept tokens (None from `accept_drafts`).
    logprobs the `Logprobs` of each row's first emitted token (a row that asks for them
             drafts nothing, so that is its one token); None from `accept_drafts`.
    """

    tokens: Int[Array, "B W"]
    kept: Int[Array, " B"]
    sampler: SamplerState
    cache: Cache | None = None
    logprobs: Any = None


def _seen_before(s: SamplerState, drafts: Int[Array, "B k"], w: int) -> jax.Array:
    """`[B, W, V]`: the ids seen before position j (the state's, and drafts 1..j)."""
    b, v = s.seen.shape
    hits = jnp.zeros((b, w, v), jnp.int32)
    rows = jnp.arange(b)[:, None]
    hits = hits.at[rows, jnp.arange(1, w)[None, :], drafts].set(1)
    return s.seen[:, None, :] | (jnp.cumsum(hits, axis=1) > 0)


def _per_position(s: SamplerState, w: int, seen) -> SamplerState:
    """The sampler state of `[B * W]` rows: row i's settings at each of its W positions."""
    rep = lambda a: jnp.repeat(a, w, axis=0)  # noqa: E731
    return dataclasses.replace(s, key=rep(s.key), step=rep(s.step) + jnp.tile(jnp.arange(w), s.step.shape[0]),
                               temperature=rep(s.temperature), top_k=rep(s.top_k), top_p=rep(s.top_p),
                               min_p=rep(s.min_p), repetition_penalty=rep(s.repetition_penalty),
                               seen=seen.reshape(-1, seen.shape[-1]))


def accept_drafts(logits: Float[Array, "B W V"], drafts: Int[Array, "B k"], lengths: Int[Array, " B"],
                  s: SamplerState, rules: TokenRules) -> Verified:
    """The tokens each row keeps of its drafts and the token after them (module docstring).

    logits   the target's logits at the W fed positions; drafts `[B, W-1]` the fed tokens after
    the first; lengths `[B]` how many of them row i drafted (0 .. W-1). `s.step` must be `[B]`.
    """
    b, w, v = logits.shape
    logits = logits.astype(jnp.float32).at[:, 0].set(rules.apply(logits[:, 0].astype(jnp.float32)))
    seen = jax.lax.cond(jnp.any(s.repetition_penalty != 1.0), lambda: _seen_before(s, drafts, w),
                        lambda: jnp.broadcast_to(s.seen[:, None, :], (b, w, v)))
    flat = _per_position(s, w, seen)
    penalized = penalized_logits(logits.reshape(b * w, v), flat)
    greedy = jnp.argmax(penalized, axis=-1).astype(jnp.int32).reshape(b, w)
    sampling = s.temperature > 0
    scaled = jax.lax.cond(jnp.any(sampling), lambda p: filtered_logits(p, flat), lambda p: p, penalized)
    scaled = scaled.reshape(b, w, v)
    keys = row_keys(flat).reshape(b, w)
    uniforms = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1))))(keys)

    filler = jnp.zeros((b, 1), jnp.int32)
    fed = jnp.concatenate([drafts.astype(jnp.int32), filler], axis=1)  # [B, W]: position j's draft
    p_draft = jnp.take_along_axis(jax.nn.softmax(scaled, axis=-1), fed[..., None], axis=-1)[..., 0]
    match = jnp.where(sampling[:, None], uniforms < p_draft, fed == greedy)
    match &= jnp.arange(w)[None, :] < lengths[:, None]
    n = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)  # kept drafts

    at_n = lambda a: jnp.take_along_axis(a, n.reshape((b, 1) + (1,) * (a.ndim - 2)), axis=1)[:, 0]  # noqa: E731
    rejected = n < lengths
    last = jnp.where(rejected[:, None] & (jnp.arange(v)[None, :] == at_n(fed)[:, None]), -jnp.inf, at_n(scaled))
    drawn = jax.vmap(jax.random.categorical)(at_n(keys), last).astype(jnp.int32)
    bonus = jnp.where(sampling, drawn, at_n(greedy))
    bonus = jnp.where((n == 0) & (rules.force >= 0), rules.force, bonus)

    position = jnp.arange(w)[None, :]
    tokens = jnp.where(position < n[:, None], fed, jnp.where(position == n[:, None], bonus[:, None], -1))
    kept = n + 1
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, w))
    seen_after = jnp.asarray(s.seen).at[rows, jnp.maximum(tokens, 0)].max(tokens >= 0)
    return Verified(tokens, kept, dataclasses.replace(s, step=s.step + kept, seen=seen_after))
