"""A jitted prefill / decode loop over explicit cache pytrees.

Prompts of different lengths are left-padded to a length bucket and marked invalid, which
is exact (padded positions are identity steps for KDA and masked keys for MLA), so one
compilation serves every prompt length in a bucket, and one decode step serves all steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..cache import Cache
from ..nn import K31ForCausalLM


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def sample_logits(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
    """Next token ids `[B]` from fp32 logits `[B, V]`."""
    if params.temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / params.temperature
    if params.top_k:
        kth = jax.lax.top_k(logits, params.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if params.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cutoff_idx = jnp.sum(cum < params.top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def bucket_length(n: int, minimum: int = 16) -> int:
    """Round a prompt length up to a power of two (at least `minimum`)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    prompt_tokens: int
    decode_steps: int

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps * len(self.tokens) / max(self.decode_seconds, 1e-9)


class Engine:
    """Prefill and decode for one model; compiled once per (batch, length bucket)."""

    def __init__(self, model: K31ForCausalLM, max_len: int = 4096):
        self.config = model.config
        self.max_len = max_len
        self.graphdef, self.state = nnx.split(model)
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,), static_argnums=(4,))

    def _prefill_fn(self, state, cache: Cache, tokens, valid):
        model = nnx.merge(self.graphdef, state)
        logits, cache = model(tokens, cache, valid=valid)
        return logits[:, -1], cache

    def _decode_fn(self, state, cache: Cache, token, key, params: SamplingParams):
        model = nnx.merge(self.graphdef, state)
        logits, cache = model(token[:, None], cache)
        return sample_logits(logits[:, 0], key, params), cache

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        stop_ids: frozenset[int] = frozenset(),
    ) -> Iterator[np.ndarray]:
        """Yield the next token of every sequence `[B]` per step (finished rows repeat their
        last token); stops when every row hit a stop id or `max_new_tokens` is reached."""
        b = len(prompts)
        lengths = [len(p) for p in prompts]
        if min(lengths) == 0:
            raise ValueError("every prompt needs at least one token")
        t = bucket_length(max(lengths))
        if t + max_new_tokens > self.max_len:
            raise ValueError(f"prompt bucket {t} + max_new_tokens {max_new_tokens} exceeds the "
                             f"cache length max_len={self.max_len}")
        tokens = np.zeros((b, t), np.int32)
        valid = np.zeros((b, t), bool)
        for i, p in enumerate(prompts):
            tokens[i, t - len(p):] = p
            valid[i, t - len(p):] = True
        cache = self.init_cache(b)
        last_logits, cache = self._prefill(self.state, cache, jnp.asarray(tokens), jnp.asarray(valid))
        key = jax.random.key(params.seed)
        key, sub = jax.random.split(key)
        token = sample_logits(last_logits, sub, params)
        done = np.zeros(b, bool)
        for step in range(max_new_tokens):
            host = np.asarray(token)
            yield host
            done |= np.isin(host, list(stop_ids))
            if done.all() or step == max_new_tokens - 1:
                return
            key, sub = jax.random.split(key)
            token, cache = self._decode(self.state, cache, token, sub, params)

    def init_cache(self, batch: int) -> Cache:
        from ..cache import init_cache

        return init_cache(self.config, batch, self.max_len)

    def generate(self, prompts, max_new_tokens, params=SamplingParams(), stop_ids=frozenset()):
        """All generated tokens per prompt (cut after the first stop id), with timings."""
        out: list[list[int]] = [[] for _ in prompts]
        finished = [False] * len(prompts)
        t0 = time.perf_counter()
        t_first = None
        steps = 0
        for step_tokens in self.stream(prompts, max_new_tokens, params, stop_ids):
            if t_first is None:
                t_first = time.perf_counter()
            steps += 1
            for i, tok in enumerate(step_tokens.tolist()):
                if not finished[i]:
                    out[i].append(tok)
                    finished[i] = tok in stop_ids
        t_end = time.perf_counter()
        return GenerationResult(out, (t_first or t_end) - t0, t_end - (t_first or t_end),
                                sum(len(p) for p in prompts), max(steps - 1, 0))
