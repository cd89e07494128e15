"""The static-batch loop: prefill a batch of prompts, then decode it to the end, over the
generation core (``_core``).

- **Batching.** Prompts of different lengths are left-padded to one length bucket and marked
  invalid; padding is exact in the model (identity steps for KDA, masked keys for MLA), so
  no padding token changes another token's result.
- **Buckets.** A bucket is a power of two (at least ``min_bucket``) up to ``prefill_chunk``;
  longer prompts are padded to a multiple of ``prefill_chunk`` and prefilled chunk by chunk,
  continuing the cache. Every program is compiled once per (kind, batch, width) by each
  engine: one prefill program per (batch, bucket), one chunk program per batch, one decode
  step per batch, whatever the prompt or step (`Engine.compile_counts` counts them).
- **Compilation** is explicit (``jax.jit(...).lower(...).compile()``), timed on its own and
  excluded from the prefill / decode timings.
- **Sampling** runs inside the jitted step with per-row arrays (``_sampling``); the host only
  reads each step's ids to run stop checks, the thinking budget and the parser
  (``_requests``), and dispatches the next step before that work when no row's forced token
  depends on it.
- **Speculation** (``Engine(speculation=...)``): a step where some row has a draft
  (``_drafts``) is one verify program over the batch (``_verify``), each row emitting its kept
  drafts and one more token; the host tracks the cache's write position and compacts the cache
  when a verify step would run past it.
- The cache and the sampler state (its ``seen`` mask) are donated to each step; the model's
  layout (layer rows on CPU, expert words elsewhere), the backends and the vision tower are
  the core's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from ..ops import Backends
from ..vision import ImagePrompts
from ._core import GenerationCore
from ._drafts import Speculation, SpeculationStats, Speculator, StepTimings
from ._healing import first_token_mask
from ._logits import TokenRules, pack_mask
from ._requests import Completion, Request, RowController, StreamDelta, normalize_requests
from ._sampling import SamplingParams


def bucket_length(n: int, minimum: int = 16) -> int:
    """Round a prompt length up to a power of two (at least `minimum`)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def plan_prefill(n: int, chunk: int, minimum: int = 16) -> tuple[int, int]:
    """(padded length, call width) for a longest prompt of `n` tokens: a power-of-two bucket
    prefilled in one call, or a multiple of `chunk` prefilled in calls of width `chunk`."""
    length = bucket_length(n, minimum)
    if length <= chunk:
        return length, length
    return -(-n // chunk) * chunk, chunk


@dataclasses.dataclass
class GenerationResult:
    """Outputs of one `Engine.generate` call, with timings that exclude compilation.

    prefill_seconds  prompt processing + first token (what a user waits: TTFT minus compile).
    decode_seconds   from the first token to the last one.
    """

    completions: list[Completion]
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float
    prompt_tokens: int
    padded_prompt_tokens: int
    decode_steps: int
    decode_tokens: int
    speculation: SpeculationStats | None = None  # drafted and kept tokens (`Engine(speculation=)`)

    @property
    def tokens(self) -> list[list[int]]:
        return [c.tokens for c in self.completions]

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]

    @property
    def ttft_seconds(self) -> float:
        return self.prefill_seconds

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tok_s(self) -> float:
        """Generated tokens after the first ones, per second of decoding."""
        return self.decode_tokens / max(self.decode_seconds, 1e-9)

    def timing_line(self) -> str:
        line = (f"prompt {self.prompt_tokens} tok: prefill {self.prefill_tok_s:,.1f} tok/s "
                f"(TTFT {self.prefill_seconds * 1e3:,.1f} ms); decode {self.decode_tok_s:,.1f} tok/s "
                f"({self.decode_tokens} tok in {self.decode_seconds:.3f} s); compile "
                f"{self.compile_seconds:.1f} s (excluded)")
        if self.speculation is not None:
            line += f"; speculation: {self.speculation.summary()}"
        return line


class Engine:
    """Prefill and decode for one model; programs compiled once per (batch, length bucket).

    tokenizer      needed for text, stop strings, the thinking budget and parsing; its
                   ``stop_ids`` are the default stop ids ({[EOS], <|end_of_msg|>} for K3).
    max_len        cache length: padded prompt + max_new_tokens must fit.
    prefill_chunk  longest prefill call; longer prompts are prefilled in chunks of this size.
    min_bucket     smallest prompt bucket.
    pipeline       dispatch the next decode step before the host handles the current token
                   whenever no forced token depends on it (identical results; False for
                   debugging).
    backends, vision, layer_rows: the core's (`GenerationCore`): the hot paths'
                   implementations, a `k31jax.vision.VisionModel` for requests with images
                   (or `set_vision`), and the layer layout (per-layer rows on CPU for wide
                   layers; the caller's model keeps its stacks, so drop it to free them).
    speculation    a `Speculation` (e.g. `Speculation("ngram")`): decode steps verify each
                   row's drafted tokens in one forward pass (`_verify`); greedy output is the
                   same, sampled output has the same distribution. Steps where no row drafts
                   are plain decode steps (pipelined after a plain step when no row can draft
                   after its tokens).
    """

    def __init__(self, model, tokenizer=None, *, max_len: int = 4096, prefill_chunk: int = 512,
                 min_bucket: int = 16, stop_ids=None, pipeline: bool = True,
                 backends: Backends | None = None, vision=None, layer_rows: bool | None = None,
                 speculation: Speculation | None = None):
        if prefill_chunk < 1 or min_bucket < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk}, min_bucket={min_bucket}: each must be >= 1")
        self.core = GenerationCore(model, tokenizer, stop_ids=stop_ids, backends=backends, vision=vision,
                                   layer_rows=layer_rows)
        self.config = model.config
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.min_bucket = min_bucket
        self.pipeline = pipeline
        self.speculation = speculation
        self.step_timings = StepTimings()  # kept across calls: a call starts knowing what steps cost
        self.last_result: GenerationResult | None = None

    @property
    def compile_counts(self):
        """Programs compiled per kind over this engine's life."""
        return self.core.programs.compile_counts

    @property
    def compile_seconds(self) -> float:
        """Compile time over this engine's life."""
        return self.core.programs.compile_seconds

    @property
    def stop_ids(self) -> frozenset[int]:
        """The default stop ids of a request that names none."""
        return self.core.stop_ids

    @property
    def vision(self):
        return self.core.vision

    def set_vision(self, vision) -> None:
        """Use `vision` (a `k31jax.vision.VisionModel`, or None) for requests with images."""
        self.core.set_vision(vision)

    def image_prompts(self, *, base_dir=None) -> ImagePrompts:
        """A `media_prompt` for `render_k3` / `apply_chat_template` that reads image parts with
        this engine's vision model (`prompts.images` then go into `Request.images`)."""
        return self.core.image_prompts(base_dir=base_dir)

    def warmup(self, batch: int = 1, prompt_len: int = 1) -> float:
        """Compile the programs for (batch, bucket of prompt_len); returns compile seconds."""
        before = self.compile_seconds
        self.generate([[0] * prompt_len] * batch, max_new_tokens=2, stop_ids=frozenset())
        return self.compile_seconds - before

    # ---- public API ---------------------------------------------------------------------
    def stream(self, prompts: Sequence[Sequence[int] | Request], max_new_tokens: int = 64,
               params: SamplingParams | Sequence[SamplingParams] | None = None, *,
               stop_ids=None, stop: Sequence[str] | str = (), thinking_budget: int | None = None,
               parse: bool = False, chat_format: str = "k3") -> Iterator[StreamDelta]:
        """Yield a `StreamDelta` per row per step (rows that finished are skipped).

        `prompts` are token-id lists or `Request`s (which carry their own settings); the
        keyword arguments fill in plain prompts. After the iterator ends, `last_result`
        holds the completions and timings.
        """
        reqs = normalize_requests(prompts, max_new_tokens, params, stop_ids, stop,
                                  thinking_budget, parse, chat_format)
        yield from self._run(reqs)

    def generate(self, prompts, max_new_tokens: int = 64, params=None, stop_ids=None, *,
                 stop: Sequence[str] | str = (), thinking_budget: int | None = None,
                 parse: bool = False, chat_format: str = "k3") -> GenerationResult:
        """Run to completion; see `stream` for the arguments."""
        for _ in self.stream(prompts, max_new_tokens, params, stop_ids=stop_ids, stop=stop,
                             thinking_budget=thinking_budget, parse=parse,
                             chat_format=chat_format):
            pass
        return self.last_result

    # ---- the loop -----------------------------------------------------------------------
    def _run(self, reqs: list[Request]) -> Iterator[StreamDelta]:
        core = self.core
        compile_before = core.programs.compile_seconds
        t_start = time.perf_counter()
        b = len(reqs)
        lengths = [len(r.prompt) for r in reqs]
        length, width = plan_prefill(max(lengths), self.prefill_chunk, self.min_bucket)
        steps = max(r.max_new_tokens for r in reqs)
        if length + steps > self.max_len:
            raise ValueError(f"prompt bucket {length} + max_new_tokens {steps} exceeds the cache "
                             f"length max_len={self.max_len}; raise Engine(max_len=...)")
        for r in reqs:
            core.check(r)
            if r.grammar is not None:  # never ignored silently
                raise ValueError("Request.grammar runs on the Scheduler (k31jax serve), not the static Engine")
        rows = [core.controller(i, r) for i, r in enumerate(reqs)]

        cache = core.new_cache(b, self.max_len)
        for call in core.prefill_calls(reqs, length, width):
            prefilled = core.prefill(cache, call)
            cache = prefilled.cache
        mask = first_token_mask(self.tokenizer, [r.healed_prefix for r in reqs], self.config.vocab_size)
        rules = TokenRules.forcing([row.force() for row in rows]).with_bitmask(pack_mask(mask))
        step = core.first(prefilled.logits, [r.params for r in reqs], [r.prompt for r in reqs], rules)
        token, sampler = step.token, step.sampler
        speculator = None if self.speculation is None else Speculator(self.speculation, self.step_timings)
        if speculator is not None:  # the drafters read the prompts while the device prefills
            for row, req in zip(rows, reqs):
                speculator.add(row.index, req.prompt)
        host = np.asarray(token)
        t_first = time.perf_counter()
        compile_prefill = core.programs.compile_seconds - compile_before

        if speculator is not None:
            n_steps = yield from self._speculate(speculator, rows, cache, token, sampler, host, length)
        else:
            n_steps = yield from self._decode(rows, cache, token, sampler, host, steps)
        t_end = time.perf_counter()
        run_compile = core.programs.compile_seconds - compile_before
        for row in rows:  # rows cut by the global step limit (cannot happen: each has its own)
            if not row.done:
                row.finish_reason = row.finish_reason or "length"
        completions = [row.completion(n) for row, n in zip(rows, lengths)]
        self.last_result = GenerationResult(
            completions=completions,
            prefill_seconds=t_first - t_start - compile_prefill,
            decode_seconds=t_end - t_first - (run_compile - compile_prefill),
            compile_seconds=run_compile,
            prompt_tokens=sum(lengths),
            padded_prompt_tokens=b * length,
            decode_steps=n_steps - 1,
            decode_tokens=sum(max(len(c.tokens) - 1, 0) for c in completions),
            speculation=None if speculator is None else speculator.stats,
        )

    def _decode(self, rows: list[RowController], cache, token, sampler, host, steps: int) -> Iterator[StreamDelta]:
        """Decode every row to its end, a token per step; returns the steps taken."""
        core = self.core
        n_steps = 0
        while True:
            # Dispatch the next step before the host work when its forced ids are known now.
            pending = None
            live = [row for row in rows if not row.done]
            if self.pipeline and n_steps + 1 < steps:
                ahead = [row.predict_force_after_next() for row in rows]
                if all(a is not None for a in ahead):
                    pending = core.decode(cache, token, sampler, TokenRules.forcing(ahead))
            for row in live:
                delta = row.push(int(host[row.index]))
                yield delta
            n_steps += 1
            if all(row.done for row in rows) or n_steps >= steps:
                return n_steps
            if pending is None:
                pending = core.decode(cache, token, sampler, TokenRules.forcing([row.force() for row in rows]))
            token, cache, sampler = pending.token, pending.cache, pending.sampler
            host = np.asarray(token)

    def _speculate(self, spec: Speculator, rows: list[RowController], cache, token, sampler, host,
                   pos: int) -> Iterator[StreamDelta]:
        """Decode every row to its end with verify steps over each row's drafts (plain steps when
        no row drafts or the step timings refuse the width); returns the steps taken. `pos` is
        the cache's write position."""
        core = self.core
        emitted = [[int(t)] for t in host]
        n_steps = 0
        timing = None  # (live rows, width, seconds) of the step that emitted `emitted`
        while True:
            # The drafts are proposed, and whether a verify step may run is settled, as soon as
            # the tokens are in. When none will run, every row takes in one token and every forced
            # id of the next step is known now, that plain step is dispatched before the host
            # work, as `_decode` does.
            pending, t0, compiled = None, 0.0, 0.0
            live_now = [row.index for row in rows if not row.done]
            for i in live_now:  # (tokens past a row's end reach its drafter too: it drafts no more)
                spec.emitted(i, emitted[i])
            proposals = spec.proposals(live_now)  # trimmed to the rows' limits once they are known
            # The batch is done when its slowest row is: a verify step must advance the rows with
            # the most tokens left, or it only lets faster rows finish sooner.
            left = {row.index: row.req.max_new_tokens - len(row.tokens) - len(emitted[row.index])
                    for row in rows if not row.done}
            verifying = spec.width(proposals, len(live_now), left) > 0  # the timings asked once a step
            if self.pipeline and not verifying and all(len(e) == 1 for e in emitted):
                ahead = [row.predict_force_after_next() for row in rows]
                if all(a is not None for a in ahead):
                    t0, compiled = time.perf_counter(), core.programs.compile_seconds
                    pending = core.decode(cache, token, sampler, TokenRules.forcing(ahead))
            pushed = time.perf_counter()
            for row in rows:
                for t in emitted[row.index]:
                    if row.done:
                        break
                    yield row.push(t)
            if timing is not None:
                # A step is charged the host work on its tokens where no step in flight hid it
                # (a verify step's several tokens per row are never hidden), so its timed cost is
                # what the loop pays for it.
                hidden = pending is not None
                spec.timed(*timing[:2], timing[2] + (0.0 if hidden else time.perf_counter() - pushed))
                timing = None
            n_steps += 1
            if all(row.done for row in rows):
                return n_steps
            if pending is not None:
                cache, sampler, token = pending.cache, pending.sampler, pending.token
                emitted = [[int(t)] for t in np.asarray(token)]
                if core.programs.compile_seconds == compiled:
                    timing = (len(live_now), 0, time.perf_counter() - t0)
                pos += 1
                continue
            rules = TokenRules.forcing([row.force() for row in rows])
            limits = {row.index: min(row.unforced_run(), row.req.max_new_tokens - len(row.tokens)) - 1
                      for row in rows if not row.done}
            drafts = spec.trim(proposals, limits) if verifying else {}
            live = len(limits)
            width = spec.verify_width(drafts)
            if width and pos + width > self.max_len:  # the live rows' keys to the front
                cache = core.compact(cache, np.asarray([not row.done for row in rows]))
                pos = int(np.asarray(cache.pos))
            if width and pos + width <= self.max_len:
                fed = np.zeros((len(rows), width), np.int32)
                fed[:, 0] = [seq[-1] for seq in emitted]
                lengths = np.zeros(len(rows), np.int32)
                for i, d in drafts.items():
                    fed[i, 1:1 + len(d)] = d
                    lengths[i] = len(d)
                t0, compiled = time.perf_counter(), core.programs.compile_seconds
                verified = core.verify(cache, fed, lengths, sampler, rules)
                cache, sampler = verified.cache, verified.sampler
                out, kept = np.asarray(verified.tokens), np.asarray(verified.kept)
                if core.programs.compile_seconds == compiled:
                    timing = (live, width, time.perf_counter() - t0)
                emitted = [out[i, :kept[i]].tolist() for i in range(len(rows))]
                spec.verified(drafts, {i: int(kept[i]) - 1 for i in drafts})
                token = jnp.asarray([seq[-1] for seq in emitted], jnp.int32)
                pos += width
            else:
                t0, compiled = time.perf_counter(), core.programs.compile_seconds
                step = core.decode(cache, token, sampler, rules)
                cache, sampler, token = step.cache, step.sampler, step.token
                emitted = [[int(t)] for t in np.asarray(token)]
                if core.programs.compile_seconds == compiled:
                    timing = (live, 0, time.perf_counter() - t0)
                pos += 1
