"""Legacy K2 format (K2 / K2.5 / Kimi Linear chat models), chat_format.md §5.

Best-effort reproduction of the K2 family's Jinja templates: template details vary between
K2-Instruct, K2-Thinking and K2.5, so the thinking variants are options here. Adjacent text
pieces are merged into one segment, as the HF template renders one string before encoding
(ids match the HF path for text without injected specials).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import regex

from k31jax.chat._markup import Markup
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
    require_reasoning: bool = False,
) -> list[Segment]:
    """Render a conversation in the K2 format.

    ``thinking=None``: K2-Instruct (no think tags). ``True`` / ``False``: K2.5-style think
    blocks; every assistant message opens with ``<think>…</think>``, but the reasoning is kept
    only for messages after the last assistant message without tool calls (the in-progress
    agentic turn), or for all of them with ``preserve_thinking``. The generation prompt ends
    with ``<think>`` (thinking) or ``<think></think>`` (instant). Tool-call ids are rendered
    verbatim (``functions.NAME:IDX``; synthesised in that form when missing). A kept
    reasoning that is missing renders as ``<think></think>``; ``require_reasoning=True``
    makes that an error for a tool-call turn (``MissingReasoningError``).
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
K2_MARKUP = Markup(("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_end|>", "[EOS]",
                    "<think>", "</think>"))
_SECTION_BEGIN, _SECTION_END = K2_MARKUP("<|tool_calls_section_begin|>"), K2_MARKUP("<|tool_calls_section_end|>")
_CALL_BEGIN = K2_MARKUP("<|tool_call_begin|>")
# In content, a section begin opens a section only when a call or the section end follows it
# (after optional whitespace); otherwise it is a stray marker and stays text (chat_format.md §5 says nothing
# about removing one). Reasoning ends at any section begin (§5).
_SECTION_OPEN = rf"{_SECTION_BEGIN}\s*(?={_CALL_BEGIN}|{_SECTION_END})"
_ARG_BEGIN = K2_MARKUP.from_trusted("<|tool_call_argument_begin|>")
# functions.NAME:IDX (chat_format.md §5); a malformed id loses only what is there of the prefix and index.
_FUNC_ID = regex.compile(r"(?:functions\.)?(?P<name>.+?)(?::\d+)?", regex.DOTALL)


def _make_k2_call(header: str, body: str, new_id: IdFactory) -> ToolCall | None:
    """A call from ``ID<|tool_call_argument_begin|>ARGS`` (internal form).

    The id is kept verbatim whatever its form: §5 requires ids to round-trip verbatim, and a
    replaced id would change what the model sees of its own turn. The name is the id without
    a ``functions.`` prefix and ``:IDX`` suffix where present (``get_weather:0`` and
    ``functions.get_weather`` give ``get_weather``); an id in another form (``call_x``,
    ``functions_f_1``) is the name as it stands. A call with an empty id has no name and is
    dropped, as K3 drops a nameless call.
    """
    del header, new_id  # K2 ids come from the model
    raw_id, _, args = body.partition(_ARG_BEGIN)
    call_id = K2_MARKUP.restore(raw_id).strip()
    if not call_id:
        return None
    name = _FUNC_ID.fullmatch(call_id).group("name")
    return ToolCall(call_id, name, K2_MARKUP.restore(args).strip() or "{}")


K2_GRAMMAR = Grammar(
    markup=K2_MARKUP,
    open_think=K2_MARKUP("<think>"),
    open_response=None,
    reasoning_end={"close_think": K2_MARKUP("</think>"), "open_tools": _SECTION_BEGIN},
    content_end={"open_tools": _SECTION_OPEN},
    open_tools=_SECTION_OPEN,
    tool_markers={"open_call": _CALL_BEGIN, "close_call": K2_MARKUP("<|tool_call_end|>"),
                  "close_tools": _SECTION_END},
    end=f'{K2_MARKUP("<|im_end|>")}|{K2_MARKUP("[EOS]")}',
    make_call=_make_k2_call,
    repeat_sections=True,
)


def parse_k2(text: str, *, thinking: bool = False) -> ParsedMessage:
    """Parse one complete K2 output **given as text**; the text is trusted (every special name
    in it is markup). For model output use ``parse_k2_segments``. ``thinking``: the output
    starts in (or with) ``<think>``.

    Several tool-call sections give all their calls in order, and the text between them is
    content (verbatim, joined). Calls keep the model's ids (see ``_make_k2_call``). Section
    markers that form no section stay in the content as text.
    """
    return parse_output(K2_GRAMMAR, K2_MARKUP.whole_trusted(text), thinking=thinking)


def parse_k2_segments(segments: Iterable[Segment | tuple[str, bool]], *,
                      thinking: bool = False) -> ParsedMessage:
    """``parse_k2`` of decoded segments: markup comes only from special segments."""
    return parse_output(K2_GRAMMAR, K2_MARKUP.from_segments(segments), thinking=thinking)


class K2StreamParser(StreamParser):
    """Streaming K2 parser: ``feed_segments`` decoded pieces (or ``feed`` trusted text)."""

    def __init__(self, *, thinking: bool = False):
        super().__init__(K2_GRAMMAR, thinking=thinking)
