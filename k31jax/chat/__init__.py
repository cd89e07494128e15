"""Tokenizer, K3 XTML chat format, output parsing and thinking budget (chat_format.md).

- Tokenizers: ``KimiTokenizer.from_dir`` (tiktoken BPE + 256 special slots) and
  ``ByteTokenizer`` (tiny models) share one interface: ``encode`` (specials are plain text
  unless ``allow_special=True``), ``encode_segments``, ``decode``, ``stream_decoder``,
  ``stop_ids``, ``special_id``. ``train_bpe`` + ``write_tiktoken_model`` make a small BPE in
  the release format (the embedded default model's tokenizer).
- Rendering: ``render_k3`` → ``list[Segment]``; ``render_k3_text``; ``apply_chat_template``
  (effort defaults to ``"max"``; ``resolve_reasoning_effort`` maps an API's ``reasoning_effort``);
  ``open_tag`` / ``close_tag`` / ``escape_attr`` spell one XTML tag as segments; ``render_k2``
  for the legacy format.
- Parsing: ``K3StreamParser.feed_segments`` (events) / ``parse_k3_segments`` take markup only
  from special ids (``StreamDecoder.step_pieces``, ``decode_segments``): the path for model
  output. ``parse_k3(text)`` / ``feed(text)`` trust a plain string (every special name in it is
  markup). ``k3_last_channel``: the last channel marker of a prompt(+output). K2:
  ``parse_k2_segments`` / ``parse_k2`` / ``K2StreamParser``.
- Thinking budget: ``ThinkingBudget.k3(tok, budget).start(prompt_ids)`` → ``state.step(id)``.
- Compaction: ``compact_history`` replaces chosen documents (tool results, user text parts marked
  with a ``document_id``) with stubs, every call kept, so the history's head renders as before
  (a server resumes it from its stored state; ``document_messages`` says where to store it).

Pure Python: importing this package never imports JAX (tiktoken is imported only when a
``KimiTokenizer`` is built).
"""

from k31jax.chat._bpe import train_bpe, write_tiktoken_model
from k31jax.chat._byte_tokenizer import ByteTokenizer
from k31jax.chat._compaction import DEFAULT_DOCUMENT_STUB, DEFAULT_STUB, compact_history, document_messages
from k31jax.chat._k2 import K2StreamParser, parse_k2, parse_k2_segments, render_k2
from k31jax.chat._k3_output import K3StreamParser, k3_last_channel, parse_k3, parse_k3_segments
from k31jax.chat._media import IMAGE_PART_TYPES, MediaPartError, image_part_bytes, media_block
from k31jax.chat._parse import (ContentDelta, ParsedMessage, ParseEvent, ReasoningDelta, ToolCall, ToolCallArgsDelta,
                                ToolCallEnd, ToolCallStart, collect_events)
from k31jax.chat._render import (THINKING_EFFORTS, ChatTemplateError, MissingReasoningError, apply_chat_template,
                                 close_tag, escape_attr, open_tag, render_k3, render_k3_text, resolve_reasoning_effort)
from k31jax.chat._specials import K2_SPECIAL_TOKENS, K3_SPECIAL_TOKENS
from k31jax.chat._thinking import ThinkingBudget, ThinkPhase
from k31jax.chat._tokenizer import KimiTokenizer, Segment, TokenizerBase

__all__ = [
    # tokenizers
    "ByteTokenizer", "K2_SPECIAL_TOKENS", "K3_SPECIAL_TOKENS", "KimiTokenizer", "Segment", "TokenizerBase",
    "train_bpe", "write_tiktoken_model",
    # K3 rendering
    "THINKING_EFFORTS", "ChatTemplateError", "MissingReasoningError", "apply_chat_template", "render_k3",
    "render_k3_text", "resolve_reasoning_effort",
    # XTML tags as segments (forced output: a tool call's opening)
    "close_tag", "escape_attr", "open_tag",
    # parsing
    "ContentDelta", "K3StreamParser", "ParseEvent", "ParsedMessage", "ReasoningDelta", "ToolCall",
    "ToolCallArgsDelta", "ToolCallEnd", "ToolCallStart", "collect_events", "k3_last_channel", "parse_k3",
    "parse_k3_segments",
    # image parts and the K3 media block
    "IMAGE_PART_TYPES", "MediaPartError", "image_part_bytes", "media_block",
    # K2 legacy
    "K2StreamParser", "parse_k2", "parse_k2_segments", "render_k2",
    # thinking budget
    "ThinkPhase", "ThinkingBudget",
    # compaction of an agent's history
    "DEFAULT_DOCUMENT_STUB", "DEFAULT_STUB", "compact_history", "document_messages",
]
