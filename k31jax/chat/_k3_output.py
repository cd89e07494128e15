"""The K3 XTML output grammar: ``parse_k3``, ``K3StreamParser``, ``k3_reasoning_ended``.

Markers tolerate ``\\s*`` between their parts (``<|close|> think <|sep|>``). See ``_parse``
for the whole-parse rules shared with K2.
"""

from __future__ import annotations

import json
from typing import Any

import regex

from k31jax.chat._parse import (Grammar, IdFactory, ParsedMessage, StreamParser, ToolCall,
                                parse_output)

_END = r"<\|end_of_msg\|>|\[EOS\]"
# Attribute list; values may not contain an END marker (so the turn end is never hidden).
_ATTRS = (r'(?:\s+[^\s=<>"|\[]+\s*=\s*(?:"(?:(?!<\|end_of_msg\|>|\[EOS\])[^"])*"'
          r'|[^\s"<>|\[]+))*')


def _open(name: str) -> str:
    return rf"<\|open\|>\s*{name}\s*<\|sep\|>"


def _close(name: str) -> str:
    return rf"<\|close\|>\s*{name}\s*<\|sep\|>"


OPEN_THINK, CLOSE_THINK = _open("think"), _close("think")
OPEN_RESPONSE, CLOSE_RESPONSE = _open("response"), _close("response")
OPEN_TOOLS, CLOSE_TOOLS = _open("tools"), _close("tools")
CLOSE_MESSAGE = _close("message")
OPEN_CALL = rf"<\|open\|>\s*call(?P<call_attrs>{_ATTRS})\s*<\|sep\|>"
CLOSE_CALL = _close("call")

_ATTR = regex.compile(r'([^\s=<>"|\[]+)\s*=\s*(?:"([^"]*)"|([^\s"<>|\[]+))')
_CALL_HEADER = regex.compile(OPEN_CALL, regex.DOTALL)
_ARG_OPEN = regex.compile(rf"<\|open\|>\s*argument(?P<attrs>{_ATTRS})\s*<\|sep\|>", regex.DOTALL)
_ARG_CLOSE = regex.compile(_close("argument"))
_JSON_OPEN = regex.compile(rf"<\|open\|>\s*json(?P<attrs>{_ATTRS})\s*<\|sep\|>", regex.DOTALL)
_JSON_CLOSE = regex.compile(_close("json"))


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def parse_attrs(text: str) -> dict[str, str]:
    """``key="value"`` pairs of a tag, unescaped (``&quot;`` then ``&amp;``)."""
    return {m.group(1): _unescape(m.group(2) if m.group(2) is not None else m.group(3))
            for m in _ATTR.finditer(text)}


def _value(raw: str, kind: str | None) -> Any:
    if kind in (None, "string"):
        return raw  # raw text, no unescaping
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_k3_arguments(body: str) -> str:
    """The OpenAI ``arguments`` string of a call body (``argument`` blocks or one ``json`` block)."""
    j = _JSON_OPEN.search(body)
    a = _ARG_OPEN.search(body)
    if j is not None and (a is None or j.start() < a.start()):
        c = _JSON_CLOSE.search(body, j.end())
        raw = body[j.end() : c.start() if c else len(body)]
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            return raw  # the renderer wrote an unparseable string verbatim
        return json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else raw
    args: dict[str, Any] = {}
    while a is not None:
        c = _ARG_CLOSE.search(body, a.end())
        if c is not None:
            raw, nxt = body[a.end() : c.start()], c.end()
        else:  # missing close: the value runs to the next argument or the end
            n = _ARG_OPEN.search(body, a.end())
            nxt = n.start() if n else len(body)
            raw = body[a.end() : nxt]
        attrs = parse_attrs(a.group("attrs"))
        if "key" in attrs:
            args[attrs["key"]] = _value(raw, attrs.get("type"))
        a = _ARG_OPEN.search(body, nxt)
    return json.dumps(args, ensure_ascii=False)


def _make_call(header: str, body: str, new_id: IdFactory) -> ToolCall | None:
    m = _CALL_HEADER.match(header)
    name = parse_attrs(m.group("call_attrs")).get("tool") if m else None
    if not name:
        return None  # a call without a name is dropped
    return ToolCall(new_id(), name, parse_k3_arguments(body))


K3_GRAMMAR = Grammar(
    open_think=OPEN_THINK,
    open_response=OPEN_RESPONSE,
    reasoning_end={"close_think": CLOSE_THINK, "open_response": OPEN_RESPONSE,
                   "close_response": CLOSE_RESPONSE, "open_tools": OPEN_TOOLS,
                   "close_message": CLOSE_MESSAGE},
    content_end={"close_response": CLOSE_RESPONSE, "close_message": CLOSE_MESSAGE,
                 "open_tools": OPEN_TOOLS},
    open_tools=OPEN_TOOLS,
    tool_markers={"open_call": OPEN_CALL, "close_call": CLOSE_CALL, "close_tools": CLOSE_TOOLS,
                  "close_message": CLOSE_MESSAGE},
    end=_END,
    make_call=_make_call,
)


def parse_k3(text: str, *, thinking: bool = True, id_factory: IdFactory | None = None) -> ParsedMessage:
    """Parse one complete K3 assistant output (decoded with specials kept).

    ``thinking`` says whether the prompt opened the think channel. Tool-call ids come from
    ``id_factory`` (default ``call_<24 hex>``).
    """
    return parse_output(K3_GRAMMAR, text, thinking=thinking, id_factory=id_factory)


class K3StreamParser(StreamParser):
    """Streaming K3 parser; ``feed`` decoded text, then ``finish``."""

    def __init__(self, *, thinking: bool = True, id_factory: IdFactory | None = None):
        super().__init__(K3_GRAMMAR, thinking=thinking, id_factory=id_factory)


_CHANNEL = regex.compile(
    "|".join(f"(?P<{k}>{p})" for k, p in {
        "open_think": OPEN_THINK, "close_think": CLOSE_THINK, "open_response": OPEN_RESPONSE,
        "close_response": CLOSE_RESPONSE, "open_tools": OPEN_TOOLS, "close_tools": CLOSE_TOOLS,
    }.items()))


def k3_reasoning_ended(text: str) -> bool:
    """Whether reasoning is over in a prompt(+output) text: the **last** channel marker exists
    and is not ``<|open|>think<|sep|>`` (earlier turns' think closes don't count)."""
    last = None
    for last in _CHANNEL.finditer(text):
        pass
    return last is not None and last.lastgroup != "open_think"
