"""OpenAI Responses (``/v1/responses``): request → chat history → ``GenSpec``; results → response
objects, output items and the documented stream events; stored responses for
``previous_response_id``.

Input: a string (one user message) or items: messages (``role`` user / system / developer /
assistant, text as a string or ``input_text`` / ``output_text`` parts, ``input_image`` parts),
``reasoning`` items (their ``content`` text, else their ``summary``: the next assistant turn's
reasoning, which K3 keeps in its history), ``function_call`` items (that turn's calls) and
``function_call_output`` items (tool results). ``instructions`` become the system message of
this request only (a response that continues it does not inherit them, as the API says).

The request is then a chat completion (``_openai.chat_spec``): ``tools`` (function tools;
``strict`` defaults to true here, as in the API: the arguments are held to the schema by
constrained decoding), ``tool_choice``, ``parallel_tool_calls``, ``reasoning.effort``,
``text.format`` (``json_object`` / ``json_schema``), ``max_output_tokens``, ``temperature``,
``top_p``. Output: a ``reasoning`` item whose ``content`` is the whole reasoning (K3's must come
back on the next turn; its ``summary`` is empty), a ``message`` with one ``output_text`` part, and
one ``function_call`` item per call.

``store`` (default true) keeps the response and its conversation (``ResponseStore``, the most
recent ``max_entries``), so ``previous_response_id`` continues it with only the new items sent;
the scheduler's prefix cache then resumes the whole history. ``GET /v1/responses/{id}`` returns a
stored response.

Compaction (``POST /v1/responses/{id}/compact``, this server's extension; ``compact``): a stored
conversation with documents replaced by stubs (``k31jax.chat.compact_history``): tool results,
and ``input_text`` parts of user messages the client marked with a ``document_id``; named by
``documents`` (call ids, document ids), all but the last ``keep_last`` (default 1), or the
oldest first until it fits ``max_input_tokens``; ``stub`` / ``document_stub`` say what replaces
them. The result is stored as a new response to continue from. Every call stays in the history,
and the history up to the first replaced document renders as before, so the next turn resumes
from the state stored where the message holding that document began.
"""

from __future__ import annotations

import collections
import json
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..chat import DEFAULT_DOCUMENT_STUB, DEFAULT_STUB, ParsedMessage, apply_chat_template, compact_history
from . import _openai as oai
from ._protocol import APIError, GenSpec, get, invalid

# Fields of a Responses request this server cannot honour: (name, accepted, why).
RESPONSES_UNSUPPORTED = (
    ("background", lambda v: v is False, "responses run in the foreground (background: false)"),
    ("conversation", lambda v: False, "conversations are not stored: continue with previous_response_id"),
    ("prompt", lambda v: False, "stored prompt templates are not supported: send input"),
    ("include", lambda v: not v, "no extra output fields are produced (the reasoning item always has its content)"),
)


class ResponseStore:
    """Stored responses (``store: true``): id → (the response object, its conversation in chat
    form, the reply included, without the request's instructions). The most recent
    ``max_entries`` are kept."""

    def __init__(self, max_entries: int = 1024):
        self.max_entries = max_entries
        self._items: collections.OrderedDict[str, tuple[dict, list]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list]:
        with self._lock:
            entry = self._items.get(rid)
        if entry is None:
            raise APIError("not_found", f"response '{rid}' is not stored on this server (store: true keeps the "
                                        f"{self.max_entries} most recent)", param="previous_response_id")
        return entry


def _text_of(content: Any, where: str, images: list | None = None) -> str | list:
    """A message's content in chat form: a string, or parts (text and image_url)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or an array of parts", f"{where}.content")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "text"):
            text = get(part, "text", str, required=True, where=f"{where}.content[{k}].")
            document = get(part, "document_id", str, where=f"{where}.content[{k}].")
            parts.append({"type": "text", "text": text} | ({"document_id": document} if document is not None else {}))
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise invalid(f"{where}.content[{k}] (input_image) needs an image_url (a data: URL)",
                              f"{where}.content[{k}].image_url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise invalid(f"{where}.content[{k}].type must be input_text, output_text or input_image; got {kind!r}",
                          f"{where}.content[{k}].type")
    if all(p["type"] == "text" and "document_id" not in p for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The chat-form messages of a Responses ``input``."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("field 'input' must be a string or a non-empty array of items", "input")
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def assistant() -> dict[str, Any]:
        """The assistant turn the next reasoning / call / output text belongs to."""
        if not out or out[-1]["role"] != "assistant" or out[-1].get("_closed"):
            out.append({"role": "assistant", "content": ""})
        msg = out[-1]
        if reasoning:
            msg["reasoning_content"] = (msg.get("reasoning_content") or "") + "".join(reasoning)
            reasoning.clear()
        return msg

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise invalid(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant; got {role!r}",
                              f"{where}.role")
            content = _text_of(item.get("content"), where)
            if role == "assistant":
                msg = assistant()
                if msg.get("tool_calls"):  # text after this turn's calls starts a new turn
                    msg["_closed"] = True
                    msg = assistant()
                msg["content"] = (msg["content"] or "") + (content if isinstance(content, str) else "")
            else:
                if out and out[-1]["role"] == "assistant":
                    out[-1]["_closed"] = True
                out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "reasoning":
            texts = [p.get("text", "") for p in item.get("content") or [] if isinstance(p, Mapping)]
            if not texts:
                texts = [p.get("text", "") for p in item.get("summary") or [] if isinstance(p, Mapping)]
            if out and out[-1]["role"] == "assistant" and (out[-1].get("tool_calls") or out[-1]["content"]):
                out[-1]["_closed"] = True
            reasoning.append("".join(texts))
        elif kind == "function_call":
            msg = assistant()
            msg.setdefault("tool_calls", []).append({
                "id": get(item, "call_id", str, required=True, where=f"{where}."), "type": "function",
                "function": {"name": get(item, "name", str, required=True, where=f"{where}."),
                             "arguments": get(item, "arguments", str, "", where=f"{where}.")}})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _text_of(output, where)
            if not isinstance(output, str):
                raise invalid(f"{where}.output must be a string", f"{where}.output")
            if out and out[-1]["role"] == "assistant":
                out[-1]["_closed"] = True
            out.append({"role": "tool", "tool_call_id": get(item, "call_id", str, required=True, where=f"{where}."),
                        "content": output})
        else:
            raise invalid(f"{where}.type must be message, reasoning, function_call or function_call_output; "
                          f"got {kind!r}", f"{where}.type")
    if reasoning:
        raise invalid("a reasoning item must be followed by the assistant output it belongs to", "input")
    for m in out:
        m.pop("_closed", None)
    return out


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("field 'tools' must be an array", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, Mapping) else None
            raise invalid(f"tools[{i}].type = {kind!r} is not supported: this server runs function tools only",
                          f"tools[{i}].type")
        fn = {"name": get(t, "name", str, required=True, where=f"tools[{i}]."),
              "parameters": get(t, "parameters", dict, {"type": "object", "properties": {}}, where=f"tools[{i}]."),
              "strict": get(t, "strict", bool, True, where=f"tools[{i}].")}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = get(text, "format", dict, where="text.") if isinstance(text, Mapping) else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return dict(fmt)


def responses_spec(body: Mapping[str, Any], tokenizer, max_len: int, store: ResponseStore, *,
                   image_dir: str | None = None, default_max_tokens: int | None = None,
                   grammar: bool = True) -> tuple[GenSpec, list[dict[str, Any]]]:
    """(the generation, the conversation it continues: stored history + this input, without
    the instructions)."""
    for name, accepted, why in RESPONSES_UNSUPPORTED:
        if body.get(name) is not None and not accepted(body[name]):
            raise invalid(f"field '{name}' = {json.dumps(body[name])[:80]} is not supported: {why}", name)
    previous = get(body, "previous_response_id", str)
    history = list(store.get(previous)[1]) if previous else []
    conversation = history + input_messages(body.get("input"))
    instructions = get(body, "instructions", str)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    reasoning = get(body, "reasoning", dict, {})
    chat = {"model": body.get("model"), "messages": messages, "tools": _chat_tools(body.get("tools")),
            "tool_choice": _chat_tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls"),
            "reasoning_effort": get(reasoning, "effort", str, where="reasoning."),
            "max_completion_tokens": get(body, "max_output_tokens", int),
            "response_format": _response_format(get(body, "text", dict)),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "top_k": body.get("top_k"), "seed": body.get("seed"), "thinking_budget": body.get("thinking_budget")}
    spec = oai.chat_spec({k: v for k, v in chat.items() if v is not None}, tokenizer, max_len, image_dir=image_dir,
                         default_max_tokens=default_max_tokens, grammar=grammar)
    return spec, conversation


# ---- results -----------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def reasoning_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": rid, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(mid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(fid: str, call, status: str = "completed") -> dict[str, Any]:
    return {"id": fid, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def output_items(parsed: ParsedMessage, calls) -> list[dict[str, Any]]:
    items = []
    if parsed.reasoning_content:
        items.append(reasoning_item(new_id("rs"), parsed.reasoning_content))
    if parsed.content or not calls:
        items.append(message_item(new_id("msg"), parsed.content or ""))
    items += [call_item(new_id("fc"), c) for c in calls]
    return items


def assistant_message(parsed: ParsedMessage, calls) -> dict[str, Any]:
    """The reply as the next turn's history (reasoning kept: K3 renders it)."""
    msg = oai.chat_message(parsed, calls)
    msg["content"] = msg.get("content") or ""
    return msg


def usage(prompt_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(rid: str, model: str, created: float, body: Mapping[str, Any], output: list, status: str,
                    usage_: dict[str, Any] | None, incomplete: str | None = None) -> dict[str, Any]:
    tools = body.get("tools") or []
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "output": output, "usage": usage_, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.get("instructions"), "previous_response_id": body.get("previous_response_id"),
            "tools": tools, "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "max_output_tokens": body.get("max_output_tokens"), "store": body.get("store", True),
            "reasoning": body.get("reasoning"), "text": body.get("text") or {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {}, "truncation": "disabled"}


def compact(store: ResponseStore, rid: str, body: Mapping[str, Any], tokenizer, model: str) -> dict[str, Any]:
    """A stored conversation compacted (module docstring), stored as a new response: its object."""
    _, conversation = store.get(rid)
    documents = get(body, "documents", list)
    keep_last = get(body, "keep_last", int)
    max_tokens = get(body, "max_input_tokens", int)
    if documents is None and keep_last is None and max_tokens is None:
        keep_last = 1
    stub = get(body, "stub", str, DEFAULT_STUB)
    document_stub = get(body, "document_stub", str, DEFAULT_DOCUMENT_STUB)
    for name, text in (("stub", stub), ("document_stub", document_stub)):
        try:
            text.format(name="", tokens=0, call_id="")
        except (KeyError, IndexError, ValueError) as e:
            raise invalid(f"field '{name}' does not format ({e!r}): only {{name}}, {{tokens}} and {{call_id}} "
                          "are known", name) from None
    field = "documents" if documents is not None else "keep_last" if keep_last is not None else "max_input_tokens"
    try:
        compacted, done = compact_history(conversation, tokenizer, documents=documents, keep_last=keep_last,
                                          max_tokens=max_tokens, stub=stub, document_stub=document_stub)
    except ValueError as e:
        raise invalid(str(e), field) from None
    size = lambda conv: len(apply_chat_template(tokenizer, conv, add_generation_prompt=False))  # noqa: E731
    response = response_object(new_id("resp"), model, now(), {"previous_response_id": rid}, [], "completed", None)
    response["compaction"] = {"documents": done, "tokens_before": size(conversation), "tokens_after": size(compacted)}
    store.put(response, compacted)
    return response


def status_of(finish_reason: str) -> tuple[str, str | None]:
    """(status, incomplete reason): max_output_tokens ended the turn → incomplete."""
    return ("incomplete", "max_output_tokens") if finish_reason == "length" else ("completed", None)


def event(kind: str, seq: int, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **data}, ensure_ascii=False)}\n\n"


def now() -> float:
    return float(int(time.time()))
