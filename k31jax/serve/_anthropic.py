"""Anthropic Messages: request → OpenAI-form history → ``GenSpec``; results → message objects
and the documented stream events.

History conversion (chat_format.md §6): an assistant turn's ``thinking`` blocks become its
``reasoning_content`` (first), ``text`` blocks its content and ``tool_use`` blocks its tool
calls; a user turn's ``tool_result`` blocks become tool messages, in order, before its text.
Effort: ``output_config.effort`` (low → low, medium / high → high, max → max:
``_protocol.ANTHROPIC_EFFORTS``); ``thinking: {"type": "disabled"}`` turns thinking off and
``{"type": "enabled", "budget_tokens": N}`` caps it at N tokens and, without an explicit effort,
sets one from N (``_protocol.BUDGET_EFFORTS``: below 4096 low, below 16384 high, else max).
``tool_choice.disable_parallel_tool_use`` returns the first call only. Structured output
(``output_config.format`` or ``output_format``: ``{"type": "json_schema", "schema": ...}``) and
``tools[].strict`` (the call's ``input`` valid against ``input_schema``) are held by constrained
decoding (``_protocol.output_grammar``). User ``image`` blocks (``source.type: base64``) go to
the prompt as they are (``_protocol.RequestImages``). Fields this server cannot honour (server
tools, MCP servers, containers, context management) are refused with a 400 naming them
(``MESSAGES_UNSUPPORTED``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

from ..chat import ParsedMessage
from ..generate import Request
from ._protocol import (ANTHROPIC_EFFORTS, GenSpec, RequestImages, budget_effort, check_context, effort_settings,
                        get, in_range, invalid, max_tool_calls, output_grammar, refuse_unsupported, render_prompt,
                        sampling, stop_list, tool_choice_spec)

STOP_REASON = {"length": "max_tokens"}


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or an array of content blocks", where)
    parts = []
    for j, b in enumerate(content):
        if not isinstance(b, Mapping) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise invalid(f"{where}[{j}] must be a text block", f"{where}[{j}]")
        parts.append(b["text"])
    return "".join(parts)


def _user(m: Mapping[str, Any], i: int) -> list[dict[str, Any]]:
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise invalid(f"messages.{i}.content must be a string or an array of content blocks",
                      f"messages.{i}.content")
    tools, parts = [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, Mapping) else None
        where = f"messages.{i}.content.{j}"
        if kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise invalid(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
            text = _text_of(b.get("content") or "", f"{where}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            tools.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image":
            parts.append(dict(b))  # read (or refused, naming the field) when the prompt renders
        else:
            raise invalid(f"{where}: unsupported user content block type {kind!r}", where)
    return tools + ([{"role": "user", "content": parts}] if parts else [])


def _assistant(m: Mapping[str, Any], i: int) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise invalid(f"messages.{i}.content must be a string or an array of content blocks",
                      f"messages.{i}.content")
    thinking, text, calls = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, Mapping) else None
        where = f"messages.{i}.content.{j}"
        if kind == "thinking":
            thinking.append(str(b.get("thinking") or ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "text":
            text.append(str(b.get("text") or ""))
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), Mapping):
                raise invalid(f"{where}: a tool_use block needs a string 'name' and an object 'input'", where)
            calls.append({"id": str(b.get("id") or ""), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {},
                                                                                  ensure_ascii=False)}})
        else:
            raise invalid(f"{where}: unsupported assistant content block type {kind!r}", where)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def to_openai_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = get(body, "messages", list, required=True)
    if not messages:
        raise invalid("messages: at least one message is required", "messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, Mapping) else None
        if role == "user":
            out.extend(_user(m, i))
        elif role == "assistant":
            out.append(_assistant(m, i))
        else:
            raise invalid(f"messages.{i}.role must be 'user' or 'assistant', got {role!r}", f"messages.{i}.role")
    return out


def _tools(body) -> list[dict[str, Any]] | None:
    tools = get(body, "tools", list)
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or not isinstance(t.get("name"), str) or not t["name"]:
            raise invalid(f"tools.{i} must be an object with a 'name'", f"tools.{i}")
        if t.get("type") not in (None, "custom"):
            raise invalid(f"tools.{i}.type = {t['type']!r} is not supported: this server runs no server tools "
                          "(web search, code execution, ...); declare custom tools with an input_schema",
                          f"tools.{i}.type")
        schema = get(t, "input_schema", dict, {"type": "object"}, where=f"tools.{i}.")
        fn = {"name": t["name"], "parameters": schema}
        if get(t, "strict", bool, False, where=f"tools.{i}."):
            fn["strict"] = True
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _parallel(body) -> bool:
    tc = get(body, "tool_choice", dict) or {}
    return not get(tc, "disable_parallel_tool_use", bool, False, where="tool_choice.")


def _tool_choice(body) -> Any:
    tc = get(body, "tool_choice", dict)
    if tc is None:
        return None
    kind = tc.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return {"type": "function", "function": {"name": tc.get("name")}}
    raise invalid(f"tool_choice.type must be auto, any, tool or none; got {kind!r}", "tool_choice.type")


# Fields that change what the client gets, refused rather than ignored; (name, accepted, why).
MESSAGES_UNSUPPORTED = (
    ("mcp_servers", lambda v: v == [], "this server connects to no MCP servers"),
    ("container", lambda v: False, "this server runs no code execution container"),
    ("context_management", lambda v: False, "this server does not edit the context"),
)


def _thinking(body) -> tuple[bool, str | None, int | None]:
    """(thinking, effort, budget) from `thinking` and `output_config.effort` (module docstring)."""
    cfg = get(body, "thinking", dict, {})
    output_config = get(body, "output_config", dict, {})
    effort = get(output_config, "effort", str, where="output_config.")
    kind = get(cfg, "type", str, "enabled", where="thinking.")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise invalid(f"thinking.type must be enabled, disabled or adaptive; got {kind!r}", "thinking.type")
    if kind == "disabled":
        return False, None, None
    budget = get(cfg, "budget_tokens", int, where="thinking.")
    in_range("thinking.budget_tokens", budget, 0, 1 << 30)
    if effort is None and budget is not None:
        return True, budget_effort(budget), budget
    return (*effort_settings(effort, "output_config.effort", ANTHROPIC_EFFORTS), budget)


def _output_schema(body) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the JSON schema of structured output: ``output_config.format`` or the beta
    ``output_format``, the chat template's ``response_format`` telling the model), or Nones."""
    output_config = get(body, "output_config", dict, {})
    where = "output_config.format" if output_config.get("format") is not None else "output_format"
    fmt = get(output_config, "format", dict) or get(body, "output_format", dict)
    if fmt is None:
        return None, None
    if fmt.get("type") != "json_schema":
        raise invalid(f"{where}.type must be 'json_schema', got {fmt.get('type')!r}", f"{where}.type")
    schema = get(fmt, "schema", dict, required=True, where=f"{where}.")
    return schema, {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def messages_spec(body: Mapping[str, Any], tokenizer, max_len: int, *, image_dir: str | None = None,
                  grammar: bool = True) -> GenSpec:
    """A Messages request; `grammar`: hold the reply to its strict tools and structured output
    by constrained decoding."""
    refuse_unsupported(body, MESSAGES_UNSUPPORTED)
    messages = to_openai_messages(body)
    max_tokens = get(body, "max_tokens", int, required=True)
    in_range("max_tokens", max_tokens, 1, 1 << 30)
    tools = _tools(body)
    thinking, effort, budget = _thinking(body)
    template_choice, forced = tool_choice_spec(_tool_choice(body), tools, "tool_choice")
    content_schema, response_format = _output_schema(body)
    temperature = get(body, "temperature", float)
    in_range("temperature", temperature, 0, 1)
    top_p = get(body, "top_p", float)
    in_range("top_p", top_p, 0, 1)
    top_k = get(body, "top_k", int)
    in_range("top_k", top_k, 0, 1 << 30)
    stop = stop_list(body.get("stop_sequences"), "stop_sequences", 16)
    get(body, "stream", bool)
    images = RequestImages(image_dir)
    prompt = render_prompt(tokenizer, messages, tools, thinking=thinking, effort=effort,
                           tool_choice=template_choice, images=images, response_format=response_format)
    max_tokens = check_context(len(prompt.ids), max_tokens, max_len, "max_tokens")
    parallel = _parallel(body)
    req = Request(prompt.ids, sampling(temperature, top_p, top_k, get(body, "seed", int)), max_tokens, None,
                  stop, budget, parse=True, chat_format="k3", markup="ids", images=tuple(images.images),
                  snapshot_at=prompt.marks,
                  grammar=output_grammar(tools, forced, parallel, content_schema) if grammar else None)
    return GenSpec(req, forced, max_tool_calls(forced, parallel), False, 0)


def count_tokens(body: Mapping[str, Any], tokenizer, *, image_dir: str | None = None) -> int:
    messages = to_openai_messages(body)
    tools = _tools(body)
    thinking, effort, _ = _thinking(body)
    template_choice, _ = tool_choice_spec(_tool_choice(body), tools, "tool_choice")
    return len(render_prompt(tokenizer, messages, tools, thinking=thinking, effort=effort,
                             tool_choice=template_choice, images=RequestImages(image_dir),
                             response_format=_output_schema(body)[1]).ids)


# ---- responses ---------------------------------------------------------------------------
def new_id() -> str:
    return "msg_" + secrets.token_hex(12)


def stop_reason(reason: str, stop: Any, calls) -> tuple[str, str | None]:
    """`max_tokens` when the limit ended the turn (a call it cut may be incomplete), else
    `tool_use` when the reply has calls, else the stop sequence or `end_turn`."""
    if calls and reason != "length":
        return "tool_use", None
    if reason == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return STOP_REASON.get(reason, "end_turn"), None


def content_blocks(parsed: ParsedMessage, calls) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning_content is not None:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning_content, "signature": ""})
    if parsed.content:
        blocks.append({"type": "text", "text": parsed.content})
    for c in calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)})
    return blocks


def _input(arguments: str) -> dict[str, Any]:
    try:
        obj = json.loads(arguments)
    except json.JSONDecodeError:
        return {"_raw": arguments}
    return obj if isinstance(obj, dict) else {"_value": obj}


def message(mid: str, model: str, blocks, reason: str | None, stop_seq: str | None,
            input_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": stop_seq,
            "usage": {"input_tokens": input_tokens - cached, "output_tokens": output_tokens,
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"
