"""The generation core: one object under every generation loop (the static ``Engine`` and the
continuous ``Scheduler``), with the verbs they are made of.

- **Model state.** The model is split once (``nnx.split``) and laid out for generation:
  on CPU, for wide layers, the layer stacks become per-layer arrays (`k31jax.nn.unstack_layers`)
  run unrolled, since XLA:CPU copies each row of a stack before a matmul reads it (a 331M
  model's decode step took 1.8x longer); on an accelerator the routed experts are read as
  words (`k31jax.nn.expert_words`). ``backends`` (`k31jax.ops.Backends`) picks the hot paths'
  implementations.
- **Programs.** Every program comes from one table (``_programs.PROGRAMS``) and is compiled
  once per (kind, batch, width) by a ``ProgramCache``; a loop that wants its own compiled set
  (and its own counts) runs on a ``fork()``, which shares everything else.
- **Verbs.** ``new_cache`` / ``new_sampler``; ``prefill`` (one call, ``prefill_calls`` for a
  left-padded batch); ``first`` (a row's first token) and ``decode`` (one step for every row),
  both under per-row ``TokenRules``; ``verify`` (a speculative step over drafted tokens,
  ``_verify``); the slot verbs ``insert``, ``insert_sampler_row``,
  ``compact``, ``snapshot``, ``restore`` (``_slots``).
- **Images** (``Request.images``, with a vision tower): the tower runs once per request before
  prefill (``image_rows``; one program per patch-count bucket); each prefill call that holds
  ``<|media_pad|>`` positions splices the request's rows there (one image prefill program per
  (batch, width), whatever the image count; ``_images``). Decode never splices.
- **Requests.** ``check`` (token ids in the vocabulary, images that fit their prompt) and
  ``controller`` (a row's host-side ``RowController`` with its stop ids and thinking budget).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..chat import ThinkingBudget
from ..nn import LAYER_STACKS, ROUTED_EXPERTS, Cache, expert_words, out_major_projections, unstack_layers
from ..ops import Backends, tpu_kernel_layout
from ..vision import ImagePrompts
from ._images import check_image_request, chunk_splice, media_pad_id, packed_request_images
from ._logits import TokenRules
from ._multihost import to_host
from ._programs import PROGRAMS, Prefilled, ProgramCache, Step
from ._requests import Request, RowController
from ._sampling import SamplerState, SamplingParams, sampler_arrays
from ._slots import Snapshot, scratch_fields, scratch_shapes, snapshot_of
from ._verify import Verified

# Per layer, the unrolled stack costs a CPU decode step ~0.2 ms more than the scan (93 layers
# at tiny widths), and a scanned layer's row copies ~0.18 ms per MB of its weights other than
# the routed experts (those are gathered by row, never copied whole): benchmarks/scan.py,
# RESULTS.md "## scan". Per-layer rows pay off above about 1 MB of such weights per layer.
ROWS_MIN_LAYER_BYTES = 1 << 20


def _rows_pay_off(state, num_layers: int) -> bool:
    """The default `layer_rows`: on CPU, when a layer's copied weights exceed
    `ROWS_MIN_LAYER_BYTES` and the row copy takes at most a quarter of the machine's memory."""
    if jax.default_backend() != "cpu":
        return False
    stacks = {kind: state[kind] for kind in LAYER_STACKS if kind in state}
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(stacks))
    routed = sum(x.size * x.dtype.itemsize for name in ROUTED_EXPERTS if "moe" in stacks and name in stacks["moe"]
                 for x in jax.tree.leaves(stacks["moe"][name]))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (total - routed) / num_layers >= ROWS_MIN_LAYER_BYTES and total <= memory // 4


PrefillCall = tuple[str, tuple]  # (program kind, its arguments after the cache)


class GenerationCore:
    """Model state, vision tower, compiled programs and request checks of one model.

    tokenizer   needed for text, stop strings, the thinking budget and healing; its
                ``stop_ids`` are the default stop ids ({[EOS], <|end_of_msg|>} for K3).
    backends    the hot paths' implementations (default `Backends()`, whose kernel choice
                comes from `$K31JAX_KERNELS`).
    vision      a `k31jax.vision.VisionModel` for requests with images (or `set_vision`).
    layer_rows  keep the layer weights as per-layer arrays, every layer unrolled (one copy of
                the layer weights made here; the caller's model keeps its stacks, so drop it
                to free them). Default (`_rows_pay_off`): on a CPU backend, for layers wide
                enough that the scan's row copies cost more than unrolling, when the copy
                takes at most a quarter of the machine's memory; otherwise a scan.
    """

    def __init__(self, model, tokenizer=None, *, stop_ids=None, backends: Backends | None = None, vision=None,
                 layer_rows: bool | None = None):
        self.config = model.config
        self.tokenizer = tokenizer
        self.backends = backends or Backends()
        self.graphdef, self.state = nnx.split(model)
        if layer_rows is None:
            layer_rows = _rows_pay_off(self.state, self.config.num_hidden_layers)
        if layer_rows:
            self.state = unstack_layers(self.state)
        elif tpu_kernel_layout(self.backends):  # the Pallas TPU grouped matmul reads its own layout
            self.state = expert_words(self.state, kernel=True)
        elif jax.default_backend() != "cpu":  # see `expert_words`; XLA:CPU runs the byte form faster
            self.state = expert_words(self.state)
        if not layer_rows and jax.default_backend() == "tpu":  # the layout XLA:TPU's decode reads them in
            self.state = out_major_projections(self.state)
        if stop_ids is not None:
            self.stop_ids = frozenset(stop_ids)
        elif tokenizer is not None:
            self.stop_ids = frozenset(tokenizer.stop_ids)
        else:
            self.stop_ids = frozenset({self.config.eos_token_id} - {None})
        self._budgets: dict[tuple[str, int], ThinkingBudget] = {}
        self.programs = ProgramCache()
        self.vision = None
        self.set_vision(vision)

    def fork(self) -> "GenerationCore":
        """A core over the same weights, backends, vision tower and budgets (shared, not copied)
        with its own compiled programs, for a loop whose compile counts are its own (a scheduler
        beside the engine it was built from). A later `set_vision` applies to one core only."""
        twin = copy.copy(self)
        twin.programs = ProgramCache()
        return twin

    def run(self, kind: str, *args):
        """Run program `kind` on `args` (the core supplies the model or tower it takes)."""
        takes = PROGRAMS[kind].takes
        if takes == "model":
            supplied = (self.graphdef, self.backends, self.state)
        elif takes == "vision":
            supplied = self._vision_split
        else:
            supplied = ()
        return self.programs.run(kind, supplied, args)

    # ---- requests -----------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise `ValueError` for a request no loop can run on this model."""
        vocab = self.config.vocab_size
        bad = sorted({t for t in req.prompt if not 0 <= t < vocab})
        if bad:
            raise ValueError(f"prompt token ids {bad[:10]} outside the vocabulary [0, {vocab})")
        self.check_images(req)

    def controller(self, index: int, req: Request) -> RowController:
        """The host-side controller of row `index` (stop ids, thinking budget, parser)."""
        budget = None
        if req.thinking_budget is not None:
            key = (req.chat_format, req.thinking_budget)
            if key not in self._budgets:
                make = ThinkingBudget.k3 if req.chat_format == "k3" else ThinkingBudget.k2
                self._budgets[key] = make(self.tokenizer, req.thinking_budget)
            budget = self._budgets[key]
        return RowController(index, req, self.tokenizer, self.stop_ids, budget)

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
        return np.asarray(self.run("vision", inputs))[:m]

    # ---- prefill ------------------------------------------------------------------------
    def new_cache(self, batch: int, length: int) -> Cache:
        return self.run("init_cache", self.config, batch, length)

    def abstract_cache(self, batch: int, length: int) -> Cache:
        """The shapes of ``new_cache(batch, length)``, compiling its program but running nothing."""
        return self.programs.output_shapes("init_cache", (), (self.config, batch, length))

    def prefill_call(self, tokens: np.ndarray, valid: np.ndarray, splice_ids: np.ndarray | None = None,
                     spliced: np.ndarray | None = None) -> PrefillCall:
        """(program kind, arguments after the cache) of one prefill call `[B, w]`. Without a
        vision model: the text program. With one: always the image program (zero rows when
        nothing is spliced), so a vision core compiles one prefill program per (batch, width)
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

    def prefill_calls(self, reqs: Sequence[Request], length: int, width: int) -> Iterator[PrefillCall]:
        """`prefill_call` of each call that prefills `reqs` left-padded to `length`, `width`
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
            yield self.prefill_call(tokens[:, c:c + width], valid[:, c:c + width], chunk_ids, spliced)

    def prefill(self, cache: Cache, call: PrefillCall) -> Prefilled:
        """Run one prefill call on `cache` (donated)."""
        kind, data = call
        return self.run(kind, cache, *data)

    # ---- sampling -----------------------------------------------------------------------
    def new_sampler(self, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]]) -> SamplerState:
        return self.run("init_sampler", sampler_arrays(params, prompts, self.config.vocab_size))

    def first(self, logits, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]], rules: TokenRules,
              with_logprobs: bool = False) -> Step:
        """Each row's first token from its prefill `logits`, with a new sampler state."""
        arrays = sampler_arrays(params, prompts, self.config.vocab_size)
        return self.run("first", logits, arrays, rules, with_logprobs)

    def decode(self, cache: Cache, token, sampler: SamplerState, rules: TokenRules,
               with_logprobs: bool = False) -> Step:
        """One token for every row; `cache` and `sampler` are donated."""
        return self.run("decode", cache, token, sampler, rules, with_logprobs)

    def decode_logits(self, cache: Cache, token) -> Prefilled:
        """A decode step's forward pass: every row's next-token logits and the continued cache
        (`cache` donated); `sample` turns them into tokens."""
        return self.run("decode_logits", cache, token)

    def verify(self, cache: Cache, tokens: np.ndarray, lengths: np.ndarray, sampler: SamplerState,
               rules: TokenRules) -> Verified:
        """One speculative step: `tokens [B, W]` are each row's last token and drafts (row i
        drafted ``lengths[i]``); the kept drafts and the token after them, the cache rolled
        back to them (`cache` and `sampler` donated; `_verify`)."""
        return self.run("verify", cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32), sampler,
                        rules)

    def sample(self, logits, sampler: SamplerState, rules: TokenRules, with_logprobs: bool = False) -> Step:
        """One token per row from `decode_logits`' logits (`sampler` donated); with
        `decode_logits`, the same tokens as `decode`."""
        return self.run("sample", logits, sampler, rules, with_logprobs)

    # ---- slots --------------------------------------------------------------------------
    def insert(self, cache: Cache, scratch: Cache, slot: int, pos: int) -> Cache:
        """`scratch`'s one row into row `slot` of `cache` (donated), its keys ending at `pos`."""
        return self.run("insert", cache, scratch, np.int32(slot), np.int32(pos))

    def insert_sampler_row(self, sampler: SamplerState, row: SamplerState, slot: int) -> SamplerState:
        return self.run("insert_sampler_row", sampler, row, np.int32(slot))

    def compact(self, cache: Cache, live: np.ndarray) -> Cache:
        """The `live` rows' keys moved to the front, the others cleared (`cache` donated)."""
        return self.run("compact", cache, live)

    def snapshot(self, cache: Cache, slot: int, tokens) -> Snapshot:
        """Row `slot`'s state, which must hold exactly `tokens`, on the host."""
        arrays, n = self.run("extract", cache, np.int32(slot))
        n = int(to_host(n))
        if n != len(tokens):
            raise AssertionError(f"cache row holds {n} keys but {len(tokens)} tokens were fed")
        return snapshot_of({name: to_host(a) for name, a in arrays.items()}, tokens)

    def restore(self, snap: Snapshot, length: int) -> Cache:
        """A batch-1 cache of `length` positions holding ``snap`` at ``[0, n)``, ``pos = n``."""
        return self.run("restore", *scratch_fields(snap, length))

    def compile_snapshot(self, cache) -> dict[str, jax.ShapeDtypeStruct]:
        """Compile ``snapshot``'s program for a cache of these shapes; its arrays' shapes."""
        arrays, _ = self.run("extract", cache, np.int32(0))
        return arrays

    def compile_restore(self, extracted: dict[str, jax.ShapeDtypeStruct], length: int) -> None:
        """Compile ``restore`` for snapshots of ``extract``'s output shapes, running nothing."""
        self.run("restore", *scratch_shapes(extracted, length))
