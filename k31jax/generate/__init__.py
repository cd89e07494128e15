"""Generation: a jitted prefill/decode engine with sampling, stop handling, a thinking budget,
streaming text and structured events, and a multi-turn chat session.

- ``Engine(model, tokenizer, max_len=..., prefill_chunk=...)``: ``generate`` / ``stream`` over
  token-id prompts or ``Request``s; compiled once per (batch, length bucket).
- ``SamplingParams``: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed.
- ``ChatSession``: K3 chat history (reasoning, tool calls, tool results) over an engine.
- ``heal_prompt``: token healing for raw completion (``Request(healed_prefix=...)``).
- ``load_model``: a checkpoint folder (Orbax or safetensors) or the embedded default model;
  ``load_tokenizer`` / ``tokenizer_dir``: a checkpoint's or run's tokenizer alone.
- Images: ``Engine(..., vision=loaded.vision)`` (``load_model(vision=True)``: the checkpoint's
  tower, or a seeded random one for the embedded model), ``engine.image_prompts()`` as the
  chat template's ``media_prompt``, ``Request(ids, images=prompts.images)``.
- ``Scheduler``: continuous batching over a slot cache (requests join and leave between decode
  steps), session prefix reuse (``PrefixCache``), forced tool choice (``ToolChoice``) and a
  background warm-up (``start_warmup``, ``Warmup``: serve while the programs compile);
  ``ProcessSync`` runs it multi-host (process 0 decides, every process steps the same batch).
"""

from ._engine import Engine, GenerationResult, abstract_decode_inputs, bucket_length, engine_program, plan_prefill
from ._healing import heal_prompt
from ._loading import DEFAULT_MODEL, LoadedModel, embedded_model_dir, load_model, load_tokenizer, tokenizer_dir
from ._multihost import ProcessSync
from ._requests import Completion, Request, StreamDelta
from ._prefix import PrefixCache
from ._sampling import SamplerState, SamplingParams, sample_logits, sample_tokens
from ._scheduler import (Failed, Finished, Handle, QueueFullError, Scheduler, TokenEvent, TokenLogprob,
                         ToolChoice, TurnPlan, Warmup)
from ._session import ChatSession, TurnResult

__all__ = [
    "ChatSession", "Completion", "DEFAULT_MODEL", "Engine", "Failed", "Finished", "GenerationResult",
    "Handle", "LoadedModel", "PrefixCache", "ProcessSync", "QueueFullError", "Request", "SamplerState", "SamplingParams",
    "Scheduler", "StreamDelta", "TokenEvent", "TokenLogprob", "ToolChoice", "TurnPlan", "TurnResult", "Warmup",
    "abstract_decode_inputs", "bucket_length", "embedded_model_dir", "engine_program", "heal_prompt", "load_model",
    "load_tokenizer", "plan_prefill", "sample_logits", "sample_tokens", "tokenizer_dir",
]
