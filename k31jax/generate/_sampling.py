"""Per-row sampling inside the jitted step: greedy, temperature, top-k, top-p, min-p,
repetition penalty, per-request seeds, and forced tokens (thinking budget).

Every knob is a `[B]` array, not a static argument, so one compiled step serves any mix of
requests. The key of row `i` at generated index `t` is `fold_in(key(seed_i), t)`: a row's
samples depend on its own seed only, never on its batch neighbours.

Dtype policy: everything here is fp32 (logits arrive fp32 from the model head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` is greedy (argmax after the repetition
    penalty); ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable those filters.

    Order (as in HF transformers): repetition penalty → temperature → top-k → top-p → min-p.
    ``repetition_penalty`` follows CTRL / HF: a logit of a token already in the prompt or the
    output is divided by the penalty when positive, multiplied when negative.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0

    def __post_init__(self):
        bad = []
        if not self.temperature >= 0:
            bad.append(f"temperature={self.temperature} (must be >= 0)")
        if self.top_k < 0:
            bad.append(f"top_k={self.top_k} (must be >= 0)")
        if not 0 < self.top_p <= 1:
            bad.append(f"top_p={self.top_p} (must be in (0, 1])")
        if not 0 <= self.min_p <= 1:
            bad.append(f"min_p={self.min_p} (must be in [0, 1])")
        if not self.repetition_penalty > 0:
            bad.append(f"repetition_penalty={self.repetition_penalty} (must be > 0)")
        if bad:
            raise ValueError("invalid SamplingParams: " + ", ".join(bad))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
    """Per-row sampling state carried between steps (a pytree of `[B]` / `[B, V]` arrays).

    key          `[B]` typed PRNG keys, one per request seed (never split; folded with `step`).
    step         `[]` int32, generated index of the next token; or `[B]`, one per row
                 (continuous batching, where rows join between steps).
    temperature  `[B]` f32 (0 = greedy), top_k `[B]` i32 (0 = off), top_p / min_p /
    repetition_penalty `[B]` f32.
    seen         `[B, V]` bool: tokens of the prompt and the output (repetition penalty).
    """

    key: jax.Array
    step: Int[Array, ""]
    temperature: Float[Array, " B"]
    top_k: Int[Array, " B"]
    top_p: Float[Array, " B"]
    min_p: Float[Array, " B"]
    repetition_penalty: Float[Array, " B"]
    seen: Bool[Array, "B V"]


def sampler_arrays(params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                   vocab_size: int) -> dict[str, np.ndarray]:
    """Host arrays for `SamplerState` (the keys are made on device by `make_sampler_state`)."""
    b = len(params)
    seen = np.zeros((b, vocab_size), bool)
    for i, (p, prompt) in enumerate(zip(params, prompts)):
        if p.repetition_penalty != 1.0:
            seen[i, np.asarray(prompt, np.int64)] = True
    return dict(
        seeds=np.asarray([p.seed % (1 << 32) for p in params], np.uint32),
        temperature=np.asarray([p.temperature for p in params], np.float32),
        top_k=np.asarray([p.top_k for p in params], np.int32),
        top_p=np.asarray([p.top_p for p in params], np.float32),
        min_p=np.asarray([p.min_p for p in params], np.float32),
        repetition_penalty=np.asarray([p.repetition_penalty for p in params], np.float32),
        seen=seen,
    )


def make_sampler_state(seeds, temperature, top_k, top_p, min_p, repetition_penalty, seen) -> SamplerState:
    """Traceable constructor from `sampler_arrays` output."""
    key = jax.vmap(jax.random.key)(seeds)
    return SamplerState(key, jnp.zeros((), jnp.int32), temperature, top_k, top_p, min_p,
                        repetition_penalty, seen)


def _apply_repetition_penalty(logits, seen, penalty):
    p = penalty[:, None]
    penalized = jnp.where(logits > 0, logits / p, logits * p)
    return jnp.where(seen & (p != 1.0), penalized, logits)


def _filter_thresholds(logits: Float[Array, "B V"], top_k, top_p) -> Float[Array, "B 1"]:
    """Smallest logit kept by top-k then top-p, per row (one descending sort)."""
    v = logits.shape[-1]
    srt = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    srt = jnp.where(srt >= kth, srt, -jnp.inf)  # top-k before top-p
    probs = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep = (before < top_p[:, None]) & (srt > -jnp.inf)
    keep = keep.at[:, 0].set(True)  # always at least the top token
    n_keep = jnp.sum(keep, axis=-1)
    return jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)


def penalized_logits(logits: Float[Array, "B V"], s: SamplerState) -> Float[Array, "B V"]:
    """fp32 logits after the repetition penalty (greedy takes their argmax)."""
    logits = logits.astype(jnp.float32)
    return jax.lax.cond(jnp.any(s.repetition_penalty != 1.0), _apply_repetition_penalty,
                        lambda l, *_: l, logits, s.seen, s.repetition_penalty)


def filtered_logits(logits: Float[Array, "B V"], s: SamplerState) -> Float[Array, "B V"]:
    """The logits a sampling row draws from (`penalized_logits` in): scaled by the temperature,
    -inf outside top-k, top-p and min-p."""
    scaled = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    needs_sort = jnp.any((s.top_k > 0) | (s.top_p < 1.0))
    thr = jax.lax.cond(needs_sort, _filter_thresholds,
                       lambda l, *_: jnp.full((l.shape[0], 1), -jnp.inf, l.dtype),
                       scaled, s.top_k, s.top_p)
    scaled = jnp.where(scaled >= thr, scaled, -jnp.inf)
    # min-p: keep p >= min_p * p_max  <=>  logit >= max + log(min_p)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    return jnp.where(scaled >= top + jnp.log(s.min_p)[:, None], scaled, -jnp.inf)


def row_keys(s: SamplerState, offset=0) -> jax.Array:
    """Each row's key for its token at generated index `step + offset`."""
    step = s.step + offset
    return jax.vmap(jax.random.fold_in, (0, 0 if jnp.ndim(step) else None))(s.key, step)


def sample_tokens(logits: Float[Array, "B V"], s: SamplerState,
                  force: Int[Array, " B"]) -> tuple[Int[Array, " B"], SamplerState]:
    """Next token per row, and the advanced state. `force[i] >= 0` overrides row i with that id
    (equivalent to one-hot logits); `force[i] < 0` samples freely."""
    logits = penalized_logits(logits, s)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(logits):
        # `step` is `[]` (one batch started together) or `[B]` (rows joined at different steps)
        return jax.vmap(jax.random.categorical)(row_keys(s), filtered_logits(logits, s)).astype(jnp.int32)

    sampled = jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda l: greedy, logits)
    token = jnp.where(s.temperature > 0, sampled, greedy)
    token = jnp.where(force >= 0, force, token)
    seen = s.seen.at[jnp.arange(token.shape[0]), token].set(True)
    return token, dataclasses.replace(s, step=s.step + 1, seen=seen)


def sample_logits(logits: Float[Array, "B V"], key: jax.Array, params: SamplingParams) -> Int[Array, " B"]:
    """Convenience: sample `[B]` ids from `[B, V]` logits with one `SamplingParams` for all rows
    (row i uses `fold_in(key, i)`). The engine uses `sample_tokens` with per-row state."""
    b, v = logits.shape
    state = SamplerState(
        key=jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(b)),
        step=jnp.zeros((), jnp.int32),
        temperature=jnp.full((b,), params.temperature, jnp.float32),
        top_k=jnp.full((b,), params.top_k, jnp.int32),
        top_p=jnp.full((b,), params.top_p, jnp.float32),
        min_p=jnp.full((b,), params.min_p, jnp.float32),
        repetition_penalty=jnp.ones((b,), jnp.float32),
        seen=jnp.zeros((b, v), bool),
    )
    return sample_tokens(logits, state, jnp.full((b,), -1, jnp.int32))[0]
