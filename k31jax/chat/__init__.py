"""Tokenizer, K3 XTML chat format, output parsing and thinking budget (chat_format.md).

- Tokenizers: ``KimiTokenizer.from_dir`` (tiktoken BPE + 256 special slots) and
  ``ByteTokenizer`` (tiny models) share one interface: ``encode`` (specials are plain text
  unless ``allow_special=True``), ``encode_segments``, ``decode``, ``stream_decoder``,
  ``stop_ids``, ``special_id``.
- Rendering: ``render_k3`` → ``list[Segment]``; ``render_k3_text``; ``apply_chat_template``
  (effort defaults to ``"max"``); ``render_k2`` for the legacy format.
- Parsing: ``parse_k3`` / ``K3StreamParser`` (events), ``parse_k2`` / ``K2StreamParser``.
- Thinking budget: ``ThinkingBudget.k3(tok, budget).start(prompt_ids)`` → ``state.step(id)``.

Pure Python: importing this package never imports JAX (tiktoken is imported only when a
``KimiTokenizer`` is built).
"""

from k31jax.chat._byte_tokenizer import ByteTokenizer
from k31jax.chat._k2 import K2_DEFAULT_SYSTEM, K2StreamParser, parse_k2, render_k2
from k31jax.chat._k3_output import K3StreamParser, k3_reasoning_ended, parse_k3
from k31jax.chat._parse import (ContentDelta, ParsedMessage, ParseEvent, ReasoningDelta,
                                ToolCall, ToolCallArgsDelta, ToolCallEnd, ToolCallStart,
                                collect_events, new_tool_call_id)
from k31jax.chat._render import (IMAGE_PLACEHOLDER, THINKING_EFFORTS, ChatTemplateError,
                                 MissingReasoningError, apply_chat_template, render_k3,
                                 render_k3_text, reorder_tool_results, resolve_reasoning_effort)
from k31jax.chat._specials import (K2_SPECIAL_TOKENS, K3_NUM_BASE_TOKENS, K3_SPECIAL_TOKENS,
                                   K3_VOCAB_SIZE, NUM_RESERVED_SPECIAL_TOKENS,
                                   PRETOKENIZE_PATTERN, pretokenize)
from k31jax.chat._thinking import ThinkingBudget, ThinkingBudgetState, ThinkPhase
from k31jax.chat._tokenizer import (KimiTokenizer, Segment, StreamDecoder, TokenizerBase,
                                    load_tiktoken_ranks, segments_to_text, split_for_encoding)

__all__ = [
    # tokenizers
    "KimiTokenizer", "ByteTokenizer", "TokenizerBase", "StreamDecoder", "Segment",
    "segments_to_text", "load_tiktoken_ranks", "split_for_encoding", "pretokenize",
    "PRETOKENIZE_PATTERN", "K3_SPECIAL_TOKENS", "K2_SPECIAL_TOKENS", "K3_NUM_BASE_TOKENS",
    "K3_VOCAB_SIZE", "NUM_RESERVED_SPECIAL_TOKENS",
    # K3 rendering
    "render_k3", "render_k3_text", "apply_chat_template", "resolve_reasoning_effort",
    "reorder_tool_results", "ChatTemplateError", "MissingReasoningError", "THINKING_EFFORTS",
    "IMAGE_PLACEHOLDER",
    # parsing
    "parse_k3", "K3StreamParser", "k3_reasoning_ended", "ParsedMessage", "ToolCall",
    "ParseEvent", "ReasoningDelta", "ContentDelta", "ToolCallStart", "ToolCallArgsDelta",
    "ToolCallEnd", "collect_events", "new_tool_call_id",
    # K2 legacy
    "render_k2", "parse_k2", "K2StreamParser", "K2_DEFAULT_SYSTEM",
    # thinking budget
    "ThinkingBudget", "ThinkingBudgetState", "ThinkPhase",
]

