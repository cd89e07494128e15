"""A jitted prefill / decode engine over explicit cache pytrees.

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
- The model is split once (``nnx.split``); jitted functions are pure in
  ``(graphdef, backends, state, cache, …)`` with the cache (and the sampler's ``seen`` mask)
  donated. ``backends`` (`k31jax.ops.Backends`) picks the hot paths' implementations.
- **Layer rows.** On CPU, for wide layers, the engine keeps the layer stacks split into
  per-layer arrays (`k31jax.nn.unstack_layers`) and runs the stack unrolled: XLA:CPU copies
  each row of a stack before a matmul reads it (a 331M model's decode step took 1.8x longer).
- **Images** (``Request.images``, with a ``vision`` model): the vision model runs once per
  request before prefill (one program per patch-count bucket); each prefill call that holds
  ``<|media_pad|>`` positions splices the request's rows there (one image prefill program per
  (batch, width), whatever the image count; ``_images``). Decode never splices.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..chat import ThinkingBudget
from ..nn import LAYER_STACKS, Cache, expert_words, init_cache, unstack_layers
from ..ops import Backends
from ..vision import ImagePrompts, splice_image_embeddings
from ._healing import first_token_mask
from ._images import check_image_request, chunk_splice, media_pad_id, packed_request_images
from ._requests import (Completion, Request, RowController, StreamDelta, normalize_requests)
from ._sampling import SamplingParams, make_sampler_state, sample_tokens, sampler_arrays


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


# ---- jitted pure functions ------------------------------------------------------------
def _prefill_fn(graphdef, backends, state, cache: Cache, tokens, valid):
    """Logits of the last position only: the head runs on `[B, D]`, not `[B, T, V]`."""
    model = nnx.merge(graphdef, state)
    hidden, cache, _ = model.hidden_states(tokens, cache, valid=valid, backends=backends)
    return model.logits(hidden[:, -1:])[:, 0], cache


def image_prefill_embeds(model, tokens, splice_ids, rows, pad_id):
    """The layer stack's input of an image prefill call: the token embeddings with row k of
    `rows` at the k-th `pad_id` position of `splice_ids` (-1 where nothing is spliced), row-major.
    `rows` is zero-padded to the call's `B * w` (fixed shape), so this runs traced: the count
    check of `splice_image_embeddings` is for concrete ids; requests are checked at admission
    (`check_image_request`)."""
    return splice_image_embeddings(model.embed_tokens(tokens), splice_ids, rows, pad_id)


def _prefill_image_fn(graphdef, backends, state, cache: Cache, tokens, valid, splice_ids, rows, pad_id):
    """`_prefill_fn` on `image_prefill_embeds`."""
    model = nnx.merge(graphdef, state)
    embeds = image_prefill_embeds(model, tokens, splice_ids, rows, pad_id)
    hidden, cache, _ = model.hidden_states(tokens, cache, valid=valid, backends=backends, embeds=embeds)
    return model.logits(hidden[:, -1:])[:, 0], cache


def _vision_fn(graphdef, state, inputs):
    return nnx.merge(graphdef, state)(inputs)


def _first_fn(logits, arrays, force, mask):
    return sample_tokens(jnp.where(mask, logits, -jnp.inf), make_sampler_state(**arrays), force)


def _decode_fn(graphdef, backends, state, cache: Cache, token, sampler, force):
    logits, cache = nnx.merge(graphdef, state)(token[:, None], cache, backends=backends)
    token, sampler = sample_tokens(logits[:, 0], sampler, force)
    return token, cache, sampler


def _init_cache_fn(config, batch: int, max_len: int) -> Cache:
    return init_cache(config, batch, max_len)


# kind -> (jitted function, number of leading static arguments)
_JITS = {
    "init_cache": (jax.jit(_init_cache_fn, static_argnums=(0, 1, 2)), 3),
    "prefill": (jax.jit(_prefill_fn, static_argnums=(0, 1), donate_argnums=(3,)), 2),
    "prefill_image": (jax.jit(_prefill_image_fn, static_argnums=(0, 1), donate_argnums=(3,)), 2),
    "vision": (jax.jit(_vision_fn, static_argnums=(0,)), 1),
    "first": (jax.jit(_first_fn), 0),
    "decode": (jax.jit(_decode_fn, static_argnums=(0, 1), donate_argnums=(3, 5)), 2),
}


def engine_program(kind: str):
    """`(jitted function, number of leading static arguments)` of one of the engine's programs
    ("prefill", "decode", ...): what `k31jax.aot` compiles ahead of time, so a TPU report is
    about the engine's own programs (with their donated caches), not a look-alike."""
    return _JITS[kind]


def abstract_decode_inputs(vocab_size: int, batch: int) -> tuple:
    """`(token, sampler, force)` of one decode step as ShapeDtypeStructs (nothing allocated)."""
    arrays = sampler_arrays([SamplingParams()] * batch, [[0]] * batch, vocab_size)
    sampler = jax.eval_shape(lambda: make_sampler_state(**arrays))
    ids = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return ids, sampler, ids


# Per layer, the unrolled stack costs a CPU decode step ~0.2 ms more than the scan (93 layers
# at tiny widths), and a scanned layer's row copies ~0.18 ms per MB of its weights other than
# the routed experts (those are gathered by row, never copied whole): benchmarks/scan.py,
# RESULTS.md "## scan". Per-layer rows pay off above about 1 MB of such weights per layer.
ROWS_MIN_LAYER_BYTES = 1 << 20
ROUTED_EXPERTS = ("w_gate", "w_up", "w_down")


def _rows_pay_off(state, num_layers: int) -> bool:
    """The engine's default `layer_rows`: on CPU, when a layer's copied weights exceed
    `ROWS_MIN_LAYER_BYTES` and the row copy takes at most a quarter of the machine's memory."""
    if jax.default_backend() != "cpu":
        return False
    stacks = {kind: state[kind] for kind in LAYER_STACKS if kind in state}
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(stacks))
    routed = sum(x.size * x.dtype.itemsize for name in ROUTED_EXPERTS if "moe" in stacks and name in stacks["moe"]
                 for x in jax.tree.leaves(stacks["moe"][name]))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (total - routed) / num_layers >= ROWS_MIN_LAYER_BYTES and total <= memory // 4


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(x), jnp.result_type(x), getattr(x, "sharding", None))
                          for x in leaves)


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
        return (f"prompt {self.prompt_tokens} tok: prefill {self.prefill_tok_s:,.1f} tok/s "
                f"(TTFT {self.prefill_seconds * 1e3:,.1f} ms); decode {self.decode_tok_s:,.1f} tok/s "
                f"({self.decode_tokens} tok in {self.decode_seconds:.3f} s); compile "
                f"{self.compile_seconds:.1f} s (excluded)")


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
    backends       the hot paths' implementations (`k31jax.ops.Backends`; default
                   `Backends()`, whose kernel choice comes from `$K31JAX_KERNELS`).
    vision         a `k31jax.vision.VisionModel` for requests with images (or `set_vision`).
    layer_rows     keep the layer weights as per-layer arrays, every layer unrolled (one copy
                   of the layer weights made here; the caller's model keeps its stacks, so
                   drop it to free them). Default (`_rows_pay_off`): on a CPU backend, for
                   layers wide enough that the scan's row copies cost more than unrolling,
                   when the copy takes at most a quarter of the machine's memory; otherwise
                   the stacks run as a scan.
    """

    def __init__(self, model, tokenizer=None, *, max_len: int = 4096, prefill_chunk: int = 512,
                 min_bucket: int = 16, stop_ids=None, pipeline: bool = True,
                 backends: Backends | None = None, vision=None, layer_rows: bool | None = None):
        if prefill_chunk < 1 or min_bucket < 1:
            raise ValueError("prefill_chunk and min_bucket must be >= 1")
        self.config = model.config
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.min_bucket = min_bucket
        self.pipeline = pipeline
        self.backends = backends or Backends()
        self.graphdef, self.state = nnx.split(model)
        if layer_rows is None:
            layer_rows = _rows_pay_off(self.state, self.config.num_hidden_layers)
        if layer_rows:
            self.state = unstack_layers(self.state)
        elif jax.default_backend() != "cpu":  # see `expert_words`; XLA:CPU runs the byte form faster
            self.state = expert_words(self.state)
        if stop_ids is not None:
            self.stop_ids = frozenset(stop_ids)
        elif tokenizer is not None:
            self.stop_ids = frozenset(tokenizer.stop_ids)
        else:
            self.stop_ids = frozenset({self.config.eos_token_id} - {None})
        self._budgets: dict[tuple[str, int], ThinkingBudget] = {}
        self._programs: dict[tuple, object] = {}  # (kind, static args, signature) -> Compiled
        self.compile_counts: collections.Counter[str] = collections.Counter()  # compiles per kind
        self.compile_seconds = 0.0  # total over this engine's life
        self._run_compile = 0.0
        self.last_result: GenerationResult | None = None
        self.vision = None
        self.set_vision(vision)

    # ---- images -------------------------------------------------------------------------
    def set_vision(self, vision) -> None:
        """Use `vision` (a `k31jax.vision.VisionModel`, or None) for requests with images."""
        if vision is not None:
            vcfg = vision.projector.cfg
            if vcfg.text_hidden_size != self.config.hidden_size:
                raise ValueError(f"the vision model projects to {vcfg.text_hidden_size} features but the text "
                                 f"model's hidden_size is {self.config.hidden_size}")
            self._vision_split = nnx.split(vision)
            self._rows_dtype = jnp.dtype(vision.projector.post_norm[...].dtype)
            self._zero_rows: dict[tuple, jax.Array] = {}
        self.vision = vision
        self.media_pad_id = media_pad_id(self.tokenizer, None if vision is None else vision.projector.cfg)

    def image_prompts(self, *, base_dir=None) -> ImagePrompts:
        """A `media_prompt` for `render_k3` / `apply_chat_template` that reads image parts with
        this vision model's processor settings (`prompts.images` then go into `Request.images`)."""
        if self.vision is None:
            raise ValueError("this engine has no vision model: image inputs need one (Engine(vision=...))")
        vcfg = self.vision.projector.cfg
        kh, kw = vcfg.merge_kernel_size
        if kh != kw:
            raise ValueError(f"the K3 image processor merges square blocks; merge_kernel_size is {kh}x{kw}")
        return ImagePrompts(self.vision.processor, base_dir=base_dir)

    def prefill_args(self, tokens: np.ndarray, valid: np.ndarray, splice_ids: np.ndarray | None = None,
                     spliced: np.ndarray | None = None) -> tuple[str, tuple]:
        """(program kind, data arguments after the cache) of one prefill call `[B, w]`. Without a
        vision model: the text program. With one: always the image program (zero rows when
        nothing is spliced), so a vision engine compiles one prefill program per (batch, width)
        whatever mix of requests with and without images it sees."""
        if self.vision is None:
            if spliced is not None:
                raise ValueError("image rows to splice but this engine has no vision model")
            return "prefill", (jnp.asarray(tokens), jnp.asarray(valid))
        b, w = tokens.shape
        ids = np.full((b, w), -1, np.int32) if splice_ids is None else splice_ids
        if spliced is None:
            key = (b * w, self._rows_dtype)
            if key not in self._zero_rows:
                self._zero_rows[key] = jnp.zeros((b * w, self.config.hidden_size), self._rows_dtype)
            rows = self._zero_rows[key]
        else:
            rows = jnp.asarray(spliced, self._rows_dtype)
        return "prefill_image", (jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(ids, jnp.int32), rows,
                                 np.int32(self.media_pad_id))

    def prefill_calls(self, reqs: Sequence[Request], length: int, width: int) -> Iterator[tuple[str, tuple]]:
        """`prefill_args` of each call that prefills `reqs` left-padded to `length`, `width`
        tokens at a time; runs the vision model once per request with images (before the first
        call), and each call splices the image rows of its pads."""
        b = len(reqs)
        tokens = np.zeros((b, length), np.int32)
        valid = np.zeros((b, length), bool)
        for i, r in enumerate(reqs):
            tokens[i, length - len(r.prompt):] = r.prompt
            valid[i, length - len(r.prompt):] = True
        image_rows = [self.image_rows(r) for r in reqs]
        has_images = any(m is not None for m in image_rows)
        splice_ids = np.where(valid & np.asarray([m is not None for m in image_rows])[:, None], tokens, -1)
        next_row = [0] * b
        for c in range(0, length, width):
            chunk_ids = splice_ids[:, c:c + width]
            spliced = chunk_splice(chunk_ids, image_rows, next_row, self.media_pad_id) if has_images else None
            yield self.prefill_args(tokens[:, c:c + width], valid[:, c:c + width], chunk_ids, spliced)

    def check_images(self, req: Request) -> None:
        """Raise `ValueError` when `req`'s images cannot be spliced into its prompt."""
        check_image_request(req.prompt, req.images, self.media_pad_id,
                            None if self.vision is None else self.vision.projector.cfg)

    def image_rows(self, req: Request) -> np.ndarray | None:
        """The projected rows `[M, D]` of `req`'s images (host array; None without images):
        one vision model call for all of them."""
        if not req.images:
            return None
        self.check_images(req)
        inputs, m = packed_request_images(req.images, self.vision.projector.cfg)
        graphdef, state = self._vision_split
        return np.asarray(self._call("vision", graphdef, state, inputs))[:m]

    # ---- compilation --------------------------------------------------------------------
    def _call(self, kind: str, *args):
        """Run jitted `kind`, compiling it first if this signature is new (timed apart).
        Programs that take the model (graphdef, backends, state, ...) are keyed without the
        state: it is this engine's, fixed."""
        jitted, n_static = _JITS[kind]
        static, dyn = args[:n_static], args[n_static:]
        uses_state = n_static == 2
        key = (kind, None if uses_state else static, _signature(dyn[1:] if uses_state else dyn))
        fn = self._programs.get(key)
        if fn is None:
            t0 = time.perf_counter()
            fn = jitted.lower(*args).compile()
            dt = time.perf_counter() - t0
            self.compile_seconds += dt
            self._run_compile += dt
            self.compile_counts[kind] += 1
            self._programs[key] = fn
        return fn(*dyn)

    def warmup(self, batch: int = 1, prompt_len: int = 1) -> float:
        """Compile the programs for (batch, bucket of prompt_len); returns compile seconds."""
        before = self.compile_seconds
        self.generate([[0] * prompt_len] * batch, max_new_tokens=2,
                      stop_ids=frozenset())
        return self.compile_seconds - before

    def init_cache(self, batch: int) -> Cache:
        return self._call("init_cache", self.config, batch, self.max_len)

    def _budget(self, fmt: str, budget: int) -> ThinkingBudget:
        key = (fmt, budget)
        if key not in self._budgets:
            make = ThinkingBudget.k3 if fmt == "k3" else ThinkingBudget.k2
            self._budgets[key] = make(self.tokenizer, budget)
        return self._budgets[key]

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
        self._run_compile = 0.0
        t_start = time.perf_counter()
        b = len(reqs)
        lengths = [len(r.prompt) for r in reqs]
        length, width = plan_prefill(max(lengths), self.prefill_chunk, self.min_bucket)
        steps = max(r.max_new_tokens for r in reqs)
        if length + steps > self.max_len:
            raise ValueError(f"prompt bucket {length} + max_new_tokens {steps} exceeds the cache "
                             f"length max_len={self.max_len}; raise Engine(max_len=...)")
        vocab = self.config.vocab_size
        bad = sorted({t for r in reqs for t in r.prompt if not 0 <= t < vocab})
        if bad:
            raise ValueError(f"prompt token ids {bad[:10]} outside the vocabulary [0, {vocab})")
        for r in reqs:
            self.check_images(r)
        rows = [RowController(i, r, self.tokenizer, self.stop_ids,
                              self._budget(r.chat_format, r.thinking_budget)
                              if r.thinking_budget is not None else None)
                for i, r in enumerate(reqs)]

        cache = self.init_cache(b)
        for kind, data in self.prefill_calls(reqs, length, width):
            logits, cache = self._call(kind, self.graphdef, self.backends, self.state, cache, *data)
        arrays = sampler_arrays([r.params for r in reqs], [r.prompt for r in reqs], vocab)
        force = np.asarray([row.force() for row in rows], np.int32)
        mask = first_token_mask(self.tokenizer, [r.healed_prefix for r in reqs], vocab)
        token, sampler = self._call("first", logits, arrays, force, mask)
        host = np.asarray(token)
        t_first = time.perf_counter()
        compile_prefill = self._run_compile

        n_steps = 0
        while True:
            # Dispatch the next step before the host work when its forced ids are known now.
            pending = None
            live = [row for row in rows if not row.done]
            if self.pipeline and n_steps + 1 < steps:
                ahead = [row.predict_force_after_next() for row in rows]
                if all(a is not None for a in ahead):
                    pending = self._call("decode", self.graphdef, self.backends, self.state, cache, token,
                                         sampler, np.asarray(ahead, np.int32))
            for row in live:
                delta = row.push(int(host[row.index]))
                yield delta
            n_steps += 1
            if all(row.done for row in rows) or n_steps >= steps:
                break
            if pending is None:
                force = np.asarray([row.force() for row in rows], np.int32)
                pending = self._call("decode", self.graphdef, self.backends, self.state, cache, token, sampler,
                                     force)
            token, cache, sampler = pending
            host = np.asarray(token)
        t_end = time.perf_counter()
        for row in rows:  # rows cut by the global step limit (cannot happen: each has its own)
            if not row.done:
                row.finish_reason = row.finish_reason or "length"
        completions = [row.completion(n) for row, n in zip(rows, lengths)]
        self.last_result = GenerationResult(
            completions=completions,
            prefill_seconds=t_first - t_start - compile_prefill,
            decode_seconds=t_end - t_first - (self._run_compile - compile_prefill),
            compile_seconds=self._run_compile,
            prompt_tokens=sum(lengths),
            padded_prompt_tokens=b * length,
            decode_steps=n_steps - 1,
            decode_tokens=sum(max(len(c.tokens) - 1, 0) for c in completions),
        )
