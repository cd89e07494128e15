"""Generation: a jitted prefill/decode engine with sampling, stop handling, a thinking budget,
streaming text and structured events, and a multi-turn chat session.

- ``Engine(model, tokenizer, max_len=..., prefill_chunk=...)``: ``generate`` / ``stream`` over
  token-id prompts or ``Request``s; compiled once per (batch, length bucket).
- ``SamplingParams``: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed.
- ``ChatSession``: K3 chat history (reasoning, tool calls, tool results) over an engine.
- ``load_model``: a checkpoint folder (Orbax or safetensors) or the embedded default model.
- ``Scheduler``: continuous batching over a slot cache (requests join and leave between decode
  steps), session prefix reuse (``PrefixCache``) and forced tool choice (``ToolChoice``).
"""

from ._engine import Engine, GenerationResult, bucket_length, plan_prefill
from ._loading import DEFAULT_MODEL, LoadedModel, load_model
from ._requests import Completion, Request, StreamDelta
from ._prefix import PrefixCache
from ._sampling import SamplerState, SamplingParams, sample_logits, sample_tokens
from ._scheduler import (Failed, Finished, Handle, QueueFullError, Scheduler, TokenEvent, TokenLogprob,
                         ToolChoice)
from ._session import ChatSession, TurnResult

__all__ = [
    "ChatSession", "Completion", "DEFAULT_MODEL", "Engine", "Failed", "Finished", "GenerationResult",
    "Handle", "LoadedModel", "PrefixCache", "QueueFullError", "Request", "SamplerState", "SamplingParams",
    "Scheduler", "StreamDelta", "TokenEvent", "TokenLogprob", "ToolChoice", "TurnResult",
    "bucket_length", "load_model", "plan_prefill", "sample_logits", "sample_tokens",
]
