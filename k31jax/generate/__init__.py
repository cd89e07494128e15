"""Generation: a jitted prefill/decode core with sampling, stop handling, a thinking budget,
streaming text and structured events, two loops over it, and a multi-turn chat session.

- ``GenerationCore``: the model's generation state and verbs (prefill, first token, decode,
  slot insert / compact / snapshot / restore), every program from one table
  (``engine_program(kind)`` for `k31jax.aot`), per-row ``TokenRules`` on the next token,
  outputs as typed structs (``Prefilled``, ``Step``, ``Logprobs``). ``Engine`` and
  ``Scheduler`` are loops over it.
- ``Engine(model, tokenizer, max_len=..., prefill_chunk=...)``: ``generate`` / ``stream`` over
  token-id prompts or ``Request``s; compiled once per (batch, length bucket).
- Speculative decoding: ``Engine(..., speculation=Speculation("ngram"))`` (and the
  ``Scheduler``'s): prompt-lookup drafts (``NgramDrafter``; a ``Drafter`` can be a model),
  verified in one forward pass per step (``accept_drafts``: greedy output unchanged, sampled
  output distributed as without), the KDA state rolled back (``k31jax.nn.KDATrail``).
- ``SamplingParams``: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed.
- ``ChatSession``: K3 chat history (reasoning, tool calls, tool results) over an engine.
- ``heal_prompt``: token healing for raw completion (``Request(healed_prefix=...)``).
- ``load_model``: a checkpoint folder (Orbax or safetensors) or the embedded default model;
  ``load_tokenizer`` / ``tokenizer_dir``: a checkpoint's or run's tokenizer alone.
- Images: ``Engine(..., vision=loaded.vision)`` (``load_model(vision=True)``: the checkpoint's
  tower, or a seeded random one for the embedded model), ``engine.image_prompts()`` as the
  chat template's ``media_prompt``, ``Request(ids, images=prompts.images)``.
- ``Scheduler``: continuous batching over a slot cache (requests join and leave between decode
  steps), session prefix reuse (``PrefixCache``), forced tool choice (``ToolChoice``),
  grammar-constrained replies (``Request(grammar=OutputGrammar(...))``: the K3 output
  structure, tool-call arguments valid against their ``ToolSchema``, JSON content) and a
  background warm-up (``start_warmup``, ``Warmup``: serve while the programs compile);
  ``ProcessSync`` runs it multi-host (process 0 decides, every process steps the same batch).
"""

from ._core import GenerationCore
from ._drafts import DRAFTERS, Drafter, DraftRow, NgramDrafter, Speculation, SpeculationStats
from ._engine import Engine, GenerationResult, bucket_length, plan_prefill
from ._grammar import GrammarError, OutputGrammar, ToolSchema
from ._handles import Failed, Finished, Handle, QueueFullError, TokenEvent, TokenLogprob, ToolChoice, TurnPlan
from ._healing import heal_prompt
from ._loading import DEFAULT_MODEL, LoadedModel, embedded_model_dir, load_model, load_tokenizer, tokenizer_dir
from ._logits import TokenRules
from ._multihost import ProcessSync
from ._prefix import PrefixCache
from ._programs import Logprobs, Prefilled, Step, abstract_decode_inputs, engine_program
from ._requests import Completion, Request, StreamDelta
from ._sampling import SamplerState, SamplingParams, sample_logits, sample_tokens
from ._scheduler import Scheduler
from ._session import ChatSession, TurnResult
from ._verify import Verified, accept_drafts
from ._warmup import Warmup

__all__ = [
    "ChatSession", "Completion", "DEFAULT_MODEL", "DRAFTERS", "DraftRow", "Drafter", "Engine", "Failed",
    "Finished", "GenerationCore", "GenerationResult", "GrammarError", "Handle", "LoadedModel", "Logprobs",
    "NgramDrafter", "OutputGrammar", "Prefilled", "PrefixCache", "ProcessSync", "QueueFullError", "Request",
    "SamplerState", "SamplingParams", "Scheduler", "Speculation", "SpeculationStats", "Step", "StreamDelta",
    "TokenEvent", "TokenLogprob", "TokenRules", "ToolChoice", "ToolSchema", "TurnPlan", "TurnResult",
    "Verified", "Warmup", "abstract_decode_inputs", "accept_drafts", "bucket_length", "embedded_model_dir",
    "engine_program", "heal_prompt", "load_model", "load_tokenizer", "plan_prefill", "sample_logits",
    "sample_tokens", "tokenizer_dir",
]
