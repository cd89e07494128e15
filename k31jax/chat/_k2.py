"""Legacy K2 format (K2 / K2.5 / Kimi Linear chat models), chat_format.md §5.

Best-effort reproduction of the K2 family's Jinja templates: template details vary between
K2-Instruct, K2-Thinking and K2.5, so the thinking variants are options here. Adjacent text
pieces are merged into one segment, as the HF template renders one string before encoding
(ids match the HF path for text without injected specials).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import regex

from k31jax.chat._parse import (Grammar, IdFactory, ParsedMessage, StreamParser, ToolCall,
                                parse_output)
from k31jax.chat._render import (ChatTemplateError, MediaPrompt, MissingReasoningError,
                                 _call_fields, _content)
from k31jax.chat._tokenizer import Segment

K2_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
_ROLE_TOKEN = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}


def _merge(segments: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for s in segments:
        if out and not s.special and not out[-1].special:
            out[-1] = Segment(out[-1].text + s.text, False)
        elif s.text:
            out.append(s)
    return out


def _k2_args(args: Any) -> str:
    if args is None:
        return "{}"
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def render_k2(
    messages: Sequence[Mapping[str, Any]],
    tools: Any = None,
    *,
    thinking: bool | None = None,
    preserve_thinking: bool = False,
    add_generation_prompt: bool = True,
    default_system: str | None = K2_DEFAULT_SYSTEM,
    media_prompt: MediaPrompt | None = None,
    require_reasoning: bool = True,
) -> list[Segment]:
    """Render a conversation in the K2 format.

    ``thinking=None``: K2-Instruct (no think tags). ``True`` / ``False``: K2.5-style think
    blocks; every assistant message opens with ``<think>…</think>``, but the reasoning is kept
    only for messages after the last assistant message without tool calls (the in-progress
    agentic turn), or for all of them with ``preserve_thinking``. The generation prompt ends
    with ``<think>`` (thinking) or ``<think></think>`` (instant). Tool-call ids are rendered
    verbatim (``functions.NAME:IDX``; synthesised in that form when missing).
    """
    out: list[Segment] = []

    def add(*pieces: str | Segment) -> None:
        """Literal K2 markers are control segments; every ``txt(...)`` piece is plain text."""
        for p in pieces:
            out.append(p if isinstance(p, Segment) else Segment(p, True))

    def txt(text: str) -> Segment:
        return Segment(text, False)

    if tools:
        add("<|im_system|>", txt("tool_declare"), "<|im_middle|>",
            txt(json.dumps(tools, separators=(",", ":"), ensure_ascii=False)), "<|im_end|>")
    if messages and default_system is not None and messages[0].get("role") != "system":
        add("<|im_system|>", txt("system"), "<|im_middle|>", txt(default_system), "<|im_end|>")

    last_final = max((i for i, m in enumerate(messages)
                      if m.get("role") == "assistant" and not m.get("tool_calls")), default=-1)
    n_calls = 0
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise ChatTemplateError(f"messages[{i}] has unsupported role {role!r}")
        where = f"messages[{i}] ({role})"
        add(_ROLE_TOKEN.get(role, "<|im_system|>"), txt(m.get("name") or role), "<|im_middle|>")
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if thinking is not None:
                keep = thinking and (preserve_thinking or i > last_final)
                rc = m.get("reasoning_content", m.get("reasoning"))
                if keep and rc is None and calls and require_reasoning:
                    raise MissingReasoningError(
                        f"{where} has tool_calls but no reasoning_content; pass the assistant "
                        "turn back unchanged or render with thinking=False")
                add("<think>", txt((rc or "") if keep else ""), "</think>")
            _content(out, m.get("content"), where, media_prompt)
            if calls:
                add("<|tool_calls_section_begin|>")
                for k, call in enumerate(calls):
                    name, args = _call_fields(call, f"{where} tool_calls[{k}]")
                    call_id = call.get("id") or f"functions.{name}:{n_calls}"
                    n_calls += 1
                    add("<|tool_call_begin|>", txt(call_id), "<|tool_call_argument_begin|>",
                        txt(_k2_args(args)), "<|tool_call_end|>")
                add("<|tool_calls_section_end|>")
        elif role == "tool":
            add(txt(f"## Return of {m.get('tool_call_id', '')}\n"))
            _content(out, m.get("content"), where, media_prompt)
        else:
            _content(out, m.get("content"), where, media_prompt)
        add("<|im_end|>")
    if add_generation_prompt:
        add("<|im_assistant|>", txt("assistant"), "<|im_middle|>")
        if thinking is not None:
            add("<think>") if thinking else add("<think>", "</think>")
    return _merge(out)


# ---- output grammar --------------------------------------------------------------------
_SECTION_BEGIN = r"<\|tool_calls_section_begin\|>"
_ARG_BEGIN = "<|tool_call_argument_begin|>"
_FUNC_ID = regex.compile(r"^(?:functions\.)?(?P<name>.+?)(?::\d+)?$", regex.DOTALL)


def _make_k2_call(header: str, body: str, new_id: IdFactory) -> ToolCall | None:
    del header, new_id  # K2 ids come from the model and must round-trip verbatim
    call_id, _, args = body.partition(_ARG_BEGIN)
    call_id = call_id.strip()
    m = _FUNC_ID.match(call_id)
    if not call_id or m is None:
        return None
    return ToolCall(call_id, m.group("name"), args.strip() or "{}")


K2_GRAMMAR = Grammar(
    open_think=r"<think>",
    open_response=None,
    reasoning_end={"close_think": r"</think>", "open_tools": _SECTION_BEGIN},
    content_end={"open_tools": _SECTION_BEGIN},
    open_tools=_SECTION_BEGIN,
    tool_markers={"open_call": r"<\|tool_call_begin\|>", "close_call": r"<\|tool_call_end\|>",
                  "close_tools": r"<\|tool_calls_section_end\|>"},
    end=r"<\|im_end\|>|\[EOS\]",
    make_call=_make_k2_call,
)


def parse_k2(text: str, *, thinking: bool = False) -> ParsedMessage:
    """Parse one complete K2 output. ``thinking``: the output starts in (or with) ``<think>``."""
    return parse_output(K2_GRAMMAR, text, thinking=thinking)


class K2StreamParser(StreamParser):
    def __init__(self, *, thinking: bool = False):
        super().__init__(K2_GRAMMAR, thinking=thinking)
