"""K3 XTML prompt rendering (chat_format.md §2).

``render_k3`` turns OpenAI-style messages into a list of ``Segment``s: control segments
(``<|open|>``, ``<|close|>``, ``<|sep|>``, ``<|end_of_msg|>``, pre-built media blocks) and
text segments (tag names, attribute pieces, message text), each BPE'd on its own by
``encode_segments``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from k31jax.chat._media import VIDEO_PART_TYPES
from k31jax.chat._tokenizer import Segment, TokenizerBase, segments_to_text

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_CHAT_EFFORT = "max"

MediaPrompt = Callable[[Mapping[str, Any]], str]


class ChatTemplateError(ValueError):
    """A conversation that cannot be rendered; the message names the message index."""


class MissingReasoningError(ChatTemplateError):
    """An assistant tool-call turn came back without its ``reasoning_content`` (raised only
    with ``require_reasoning=True``)."""


# ---- building blocks ------------------------------------------------------------------
def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _text(out: list[Segment], text: str) -> None:
    if text:  # an empty text piece produces no segment
        out.append(Segment(text, False))


def open_tag(name: str, attrs: Sequence[tuple[str, str]] = ()) -> list[Segment]:
    out = [Segment(OPEN, True)]
    _text(out, name)
    for key, value in attrs:
        _text(out, f" {key}")
        _text(out, '="')
        _text(out, escape_attr(str(value)))
        _text(out, '"')
    out.append(Segment(SEP, True))
    return out


def close_tag(name: str) -> list[Segment]:
    return [Segment(CLOSE, True), Segment(name, False), Segment(SEP, True)]


def _close_message() -> list[Segment]:
    return close_tag("message") + [Segment(END_OF_MSG, True)]


def canonical_json(obj: Any) -> str:
    """Recursively key-sorted, compact, non-ASCII kept (TOOLS / SCHEMA serialisation)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _wrap_tools(tools: Any) -> Any:
    if isinstance(tools, Mapping):  # a tools dict is rendered as given
        return tools
    return [
        t if (isinstance(t, Mapping) and "function" in t) else {"type": "function", "function": t}
        for t in tools
    ]


# ---- system bodies (literal texts of chat_format.md §2.2) --------------------------------
def _tool_declare_body(tools: Any) -> str:
    return (
        "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
        f"```json\n{canonical_json(_wrap_tools(tools))}\n```"
    )


def _dynamic_tool_declare_body(tools: Any) -> str:
    return (
        "## New Tools Available\n"
        "The system dynamically extends the toolset via lazy-loading.\n"
        "You have access to all existing and extended tools.\n"
        "Here are the specs for the extended tools.\n\n"
        f"```json\n{canonical_json(_wrap_tools(tools))}\n```"
    )


def _effort_body(effort: str) -> str:
    return (
        "`thinking_effort` guides on how much to think in your thinking channel (not including "
        "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
        f"Now the system is invoked with `thinking_effort={effort}`."
    )


def _tool_choice_body(choice: str) -> str:
    rule = "You MUST call tools" if choice == "required" else "You MUST NOT call any tools"
    return f"The system is invoked with `tool_choice={choice}`.\n{rule} in the next message."


def _response_format_body(response_format: Mapping[str, Any], response_schema: Any) -> str | None:
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind not in ("json_object", "json_schema"):
        raise ChatTemplateError(f"response_format.type {kind!r} is not text, json_object or json_schema")
    body = (
        f"The system is invoked with `response_format={kind}`.\n"
        "Your response must be raw JSON data without markdown code blocks (```json) or any "
        "additional formatting."
    )
    if kind == "json_schema":
        schema = response_schema
        if schema is None:
            js = response_format.get("json_schema") or {}
            schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            raise ChatTemplateError(
                "response_format json_schema needs response_schema, json_schema.schema or "
                "json_schema.json_schema"
            )
        body += f"\nThe JSON data must match the following schema:\n```json\n{canonical_json(schema)}\n```"
    return body


def _system_message(kind: str, body: str) -> list[Segment]:
    out = open_tag("message", [("role", "system"), ("type", kind)])
    _text(out, body.strip())
    return out + _close_message()


# ---- argument validation ---------------------------------------------------------------
def validate_effort(effort: str | None) -> str | None:
    if effort is not None and effort not in THINKING_EFFORTS:
        raise ChatTemplateError(
            f"thinking_effort {effort!r} is not supported; use one of {list(THINKING_EFFORTS)}"
        )
    return effort


def resolve_reasoning_effort(
    reasoning_effort: str | None, default: str = DEFAULT_CHAT_EFFORT
) -> tuple[bool, str | None]:
    """Map OpenAI ``reasoning_effort`` to ``(thinking, thinking_effort)`` (chat_format.md §4).

    ``None`` → thinking on with ``default``; ``"none"`` → thinking off; low/high/max as is;
    anything else (``medium``, ``xhigh``, ``minimal`` …) raises ``ChatTemplateError``
    (an HTTP 400 for a server).
    """
    if reasoning_effort is None:
        return True, validate_effort(default)
    if reasoning_effort == "none":
        return False, None
    return True, validate_effort(reasoning_effort)


def _tool_choice_kind(tool_choice: Any) -> str | None:
    if tool_choice is None or tool_choice == "auto" or isinstance(tool_choice, Mapping):
        return None  # auto and named choices render nothing
    if tool_choice in ("required", "none"):
        return tool_choice
    raise ChatTemplateError(f"tool_choice {tool_choice!r} is not auto, none, required or a named tool")


# ---- content ---------------------------------------------------------------------------
def _content(out: list[Segment], content: Any, where: str, media_prompt: MediaPrompt | None) -> None:
    if content is None or isinstance(content, str):
        _text(out, content or "")
        return
    if not isinstance(content, Sequence):
        raise ChatTemplateError(f"{where}: content must be a string or a list of parts")
    for j, part in enumerate(content):
        if isinstance(part, str):
            _text(out, part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            _text(out, part.get("text") or "")  # each text part is its own segment
        elif kind in VIDEO_PART_TYPES:
            raise ChatTemplateError(f"{where}: content part {j} is a {kind} part: K3 accepts images only")
        elif media_prompt is not None and kind is not None:
            try:
                block = media_prompt(part)
            except ValueError as e:  # the image's own error (unreadable, too large, ...), located
                raise ChatTemplateError(f"{where}: content part {j} ({kind}): {e}") from e
            out.append(Segment(block, True))
        elif kind in ("image", "image_url"):
            _text(out, IMAGE_PLACEHOLDER)
        else:
            raise ChatTemplateError(f"{where}: content part {j} has unsupported type {kind!r}")


def _call_fields(call: Mapping[str, Any], where: str) -> tuple[str, Any]:
    fn = call.get("function", call)
    name = fn.get("name")
    if not name:
        raise ChatTemplateError(f"{where}: tool call has no function name")
    return name, fn.get("arguments")


_JSON_TYPES = ((bool, "boolean"), ((int, float), "number"), (str, "string"), (Mapping, "object"),
               ((list, tuple), "array"))


def _arguments(out: list[Segment], args: Any, where: str) -> None:
    if args is None:
        return
    if isinstance(args, str):
        if not args.strip():
            return
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            out.extend(open_tag("json", [("type", "object")]))
            _text(out, args)  # unparseable: emitted verbatim
            out.extend(close_tag("json"))
            return
        if not isinstance(parsed, dict):
            raise ChatTemplateError(f"{where}: arguments parse to {type(parsed).__name__}, not an object")
        args = parsed
    if not isinstance(args, Mapping):
        raise ChatTemplateError(f"{where}: arguments must be a dict or a JSON string")
    for key, value in args.items():
        if value is None:
            kind = "null"
        else:
            kind = next((k for t, k in _JSON_TYPES if isinstance(value, t)), None)
            if kind is None:
                raise ChatTemplateError(f"{where}: argument {key!r} has non-JSON type {type(value).__name__}")
        out.extend(open_tag("argument", [("key", str(key)), ("type", kind)]))
        _text(out, value if kind == "string" else json.dumps(value, ensure_ascii=False))
        out.extend(close_tag("argument"))


def _call_id(m: Mapping[str, Any]) -> Any:
    return m.get("tool_call_id", m.get("id"))


def reorder_tool_results(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Put each run of tool messages in the call order of the preceding assistant message.

    A run is left unchanged when any of its ids does not match a call id. Matched messages
    take the call's function name (as ``name``). The input list is never mutated.
    """
    out = list(messages)
    calls: list[Mapping[str, Any]] = []
    i = 0
    while i < len(out):
        role = out[i].get("role")
        if role == "assistant":
            calls = list(out[i].get("tool_calls") or [])
        if role != "tool":
            i += 1
            continue
        j = i
        while j < len(out) and out[j].get("role") == "tool":
            j += 1
        order = {c.get("id"): k for k, c in enumerate(calls) if c.get("id") is not None}
        run = out[i:j]
        if run and all(_call_id(m) in order for m in run):
            run = sorted(run, key=lambda m: order[_call_id(m)])
            named = []
            for m in run:
                call = calls[order[_call_id(m)]]
                name = call.get("function", call).get("name")
                named.append({**m, "name": name} if name else m)
            out[i:j] = named
        i = j
    return out


# ---- per-role rendering ----------------------------------------------------------------
def _name_attr(m: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [("name", m["name"])] if m.get("name") else []


def _assistant(out: list[Segment], m: Mapping[str, Any], i: int, thinking: bool,
               require_reasoning: bool, media_prompt: MediaPrompt | None) -> None:
    where = f"messages[{i}] (assistant)"
    calls = m.get("tool_calls") or []
    out.extend(open_tag("message", [("role", "assistant"), *_name_attr(m)]))
    if thinking:
        reasoning = m.get("reasoning_content")
        if reasoning is None:
            reasoning = m.get("reasoning")
        if reasoning is None and calls and require_reasoning:
            raise MissingReasoningError(
                f"{where} has tool_calls but no reasoning_content. With thinking on, K3 renders "
                "every past reasoning: pass each assistant turn back unchanged (content, "
                "reasoning_content and tool_calls with their ids), render with thinking=False, "
                "or drop require_reasoning=True to render an empty think block as the release does."
            )
        out.extend(open_tag("think"))
        if reasoning and reasoning.strip():
            _text(out, reasoning)
        out.extend(close_tag("think"))
    out.extend(open_tag("response"))
    _content(out, m.get("content"), where, media_prompt)
    out.extend(close_tag("response"))
    if calls:
        out.extend(open_tag("tools"))
        for k, call in enumerate(calls, 1):
            name, args = _call_fields(call, f"{where} tool_calls[{k - 1}]")
            out.extend(open_tag("call", [("tool", name), ("index", str(k))]))
            _arguments(out, args, f"{where} tool_calls[{k - 1}] ({name})")
            out.extend(close_tag("call"))
        out.extend(close_tag("tools"))
    out.extend(_close_message())


def render_k3(
    messages: Sequence[Mapping[str, Any]],
    tools: Any = None,
    *,
    thinking: bool = True,
    thinking_effort: str | None = None,
    tool_choice: Any = None,
    response_format: Mapping[str, Any] | None = None,
    response_schema: Any = None,
    add_generation_prompt: bool = True,
    media_prompt: MediaPrompt | None = None,
    require_reasoning: bool = False,
) -> list[Segment]:
    """Render a conversation to K3 XTML segments (chat_format.md §2).

    ``thinking_effort=None`` (the release's ``build_chat_segments`` default) renders no
    effort message; ``apply_chat_template`` defaults to ``"max"``. ``media_prompt(part)``,
    if given, returns the pre-built media block for a non-text content part (a control
    segment); otherwise image parts become the text ``<|kimi_image_placeholder|>``.
    With thinking on, an assistant message without ``reasoning_content`` (or ``reasoning``)
    gets an empty think block, ``<|open|>think<|sep|><|close|>think<|sep|>``, as in the release
    template (OpenAI-style clients often drop ``reasoning_content``). With
    ``require_reasoning=True`` such a message that has ``tool_calls`` raises
    ``MissingReasoningError`` instead: the model did reason there, so the prompt differs from
    what it generated (and prefix caching misses).
    """
    validate_effort(thinking_effort)
    choice = _tool_choice_kind(tool_choice)
    out: list[Segment] = []
    if tools:
        out.extend(_system_message("tool-declare", _tool_declare_body(tools)))
    if thinking and thinking_effort is not None:
        out.extend(_system_message("thinking-effort", _effort_body(thinking_effort)))

    tool_n = 0
    last_calls: list[Mapping[str, Any]] = []
    for i, m in enumerate(reorder_tool_results(messages)):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] is a {type(m).__name__}, not a mapping")
        role = m.get("role")
        if role == "system" and m.get("tools"):
            out.extend(_system_message("tool-declare", _dynamic_tool_declare_body(m["tools"])))
        elif role in ("system", "user"):
            out.extend(open_tag("message", [("role", role), *_name_attr(m)]))
            _content(out, m.get("content"), f"messages[{i}] ({role})", media_prompt)
            out.extend(_close_message())
        elif role == "assistant":
            _assistant(out, m, i, thinking, require_reasoning, media_prompt)
            tool_n, last_calls = 0, list(m.get("tool_calls") or [])
        elif role == "tool":
            tool_n += 1
            name = m.get("tool") or m.get("name")
            if not name and tool_n <= len(last_calls):
                name = last_calls[tool_n - 1].get("function", last_calls[tool_n - 1]).get("name")
            if not name:
                raise ChatTemplateError(
                    f"messages[{i}] (tool): no tool name: give 'tool' or 'name', or a "
                    f"tool_call_id matching call {tool_n} of the preceding assistant message"
                )
            out.extend(open_tag("message", [("role", "tool"), ("tool", name), ("index", str(tool_n))]))
            _content(out, m.get("content"), f"messages[{i}] (tool)", media_prompt)
            out.extend(_close_message())
        else:
            raise ChatTemplateError(f"messages[{i}] has unsupported role {role!r}")

    if choice is not None:
        out.extend(_system_message("tool-choice", _tool_choice_body(choice)))
    if response_format:
        body = _response_format_body(response_format, response_schema)
        if body is not None:
            out.extend(_system_message("response-format", body))
    if add_generation_prompt:
        out.extend(open_tag("message", [("role", "assistant")]))
        out.extend(open_tag("think" if thinking else "response"))
    return out


def render_k3_text(messages: Sequence[Mapping[str, Any]], tools: Any = None, **kwargs: Any) -> str:
    """``render_k3`` as one string (segment boundaries lost)."""
    return segments_to_text(render_k3(messages, tools, **kwargs))


def apply_chat_template(
    tokenizer: TokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Any = None,
    *,
    thinking: bool = True,
    thinking_effort: str | None = DEFAULT_CHAT_EFFORT,
    tokenize: bool = True,
    **kwargs: Any,
) -> list[int] | str:
    """Tokenizer-level chat template: like ``render_k3`` but the effort defaults to ``"max"``.
    Other keywords go to ``render_k3`` (``require_reasoning=True`` for the strict check).

    Returns token ids (``encode_segments``), or the prompt string with ``tokenize=False``.
    """
    segs = render_k3(messages, tools, thinking=thinking, thinking_effort=thinking_effort, **kwargs)
    return tokenizer.encode_segments(segs) if tokenize else segments_to_text(segs)
