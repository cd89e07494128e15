"""The K3 XTML output grammar: ``parse_k3``, ``parse_k3_segments``, ``K3StreamParser``.

Markers tolerate ``\\s*`` between their parts (``<|close|> think <|sep|>``). Their special parts
(``<|open|>``, ``<|close|>``, ``<|sep|>``, ``<|end_of_msg|>``, ``[EOS]``) count only where they
are special ids (``_markup``); tag names and attributes are text. See ``_parse`` for the
whole-parse rules shared with K2.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import regex

from k31jax.chat._markup import MARK_CLASS, Markup
from k31jax.chat._parse import (Grammar, IdFactory, ParsedMessage, StreamParser, ToolCall,
                                parse_output)
from k31jax.chat._tokenizer import Segment

K3_MARKUP = Markup(("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]"))
_O, _C, _S = K3_MARKUP("<|open|>"), K3_MARKUP("<|close|>"), K3_MARKUP("<|sep|>")
_END = f'{K3_MARKUP("<|end_of_msg|>")}|{K3_MARKUP("[EOS]")}'
# Attribute list: names and unquoted values hold no markup; quoted values may hold any
# markup but an END (so the turn end is never hidden).
_NAME, _BARE = rf'[^\s=<>"|\[{MARK_CLASS[1:-1]}]+', rf'[^\s"<>|\[{MARK_CLASS[1:-1]}]+'
_ATTRS = rf'(?:\s+{_NAME}\s*=\s*(?:"(?:(?!{_END})[^"])*"|{_BARE}))*'


def _open(name: str) -> str:
    return rf"{_O}\s*{name}\s*{_S}"


def _close(name: str) -> str:
    return rf"{_C}\s*{name}\s*{_S}"


OPEN_THINK, CLOSE_THINK = _open("think"), _close("think")
OPEN_RESPONSE, CLOSE_RESPONSE = _open("response"), _close("response")
OPEN_TOOLS, CLOSE_TOOLS = _open("tools"), _close("tools")
CLOSE_MESSAGE = _close("message")
OPEN_CALL = rf"{_O}\s*call(?P<call_attrs>{_ATTRS})\s*{_S}"
CLOSE_CALL = _close("call")

_ATTR = regex.compile(rf'({_NAME})\s*=\s*(?:"([^"]*)"|({_BARE}))')
_CALL_HEADER = regex.compile(OPEN_CALL, regex.DOTALL)
_ARG_OPEN = regex.compile(rf"{_O}\s*argument(?P<attrs>{_ATTRS})\s*{_S}", regex.DOTALL)
_ARG_CLOSE = regex.compile(_close("argument"))
_JSON_OPEN = regex.compile(rf"{_O}\s*json(?P<attrs>{_ATTRS})\s*{_S}", regex.DOTALL)
_JSON_CLOSE = regex.compile(_close("json"))


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def parse_attrs(internal: str) -> dict[str, str]:
    """``key="value"`` pairs of a tag (internal form), as text, unescaped (``&quot;`` then
    ``&amp;``)."""
    return {m.group(1): _unescape(K3_MARKUP.restore(m.group(2) if m.group(2) is not None else m.group(3)))
            for m in _ATTR.finditer(internal)}


def _value(raw: str, kind: str | None) -> Any:
    raw = K3_MARKUP.restore(raw)
    if kind in (None, "string"):
        return raw  # raw text, no unescaping
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_k3_arguments(body: str) -> str:
    """The OpenAI ``arguments`` string of a call body in the internal form (``argument``
    blocks or one ``json`` block)."""
    j = _JSON_OPEN.search(body)
    a = _ARG_OPEN.search(body)
    if j is not None and (a is None or j.start() < a.start()):
        c = _JSON_CLOSE.search(body, j.end())
        raw = K3_MARKUP.restore(body[j.end() : c.start() if c else len(body)])
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
    markup=K3_MARKUP,
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
    """Parse one complete K3 assistant output **given as text** (decoded with specials kept).

    The text is trusted: every special name in it is markup, including any the model wrote
    with ordinary tokens. For model output, parse the ids instead
    (``parse_k3_segments(tokenizer.decode_segments(ids))``). ``thinking`` says whether the
    prompt opened the think channel. Tool-call ids come from ``id_factory`` (default
    ``call_<24 hex>``).
    """
    return parse_output(K3_GRAMMAR, K3_MARKUP.whole_trusted(text), thinking=thinking,
                        id_factory=id_factory)


def parse_k3_segments(segments: Iterable[Segment | tuple[str, bool]], *, thinking: bool = True,
                      id_factory: IdFactory | None = None) -> ParsedMessage:
    """Parse one complete K3 output from decoded segments (``TokenizerBase.decode_segments``):
    markup comes only from special segments, so text that spells ``<|open|>`` stays text."""
    return parse_output(K3_GRAMMAR, K3_MARKUP.from_segments(segments), thinking=thinking,
                        id_factory=id_factory)


class K3StreamParser(StreamParser):
    """Streaming K3 parser: ``feed_segments`` decoded pieces (or ``feed`` trusted text), then
    ``finish``."""

    def __init__(self, *, thinking: bool = True, id_factory: IdFactory | None = None):
        super().__init__(K3_GRAMMAR, thinking=thinking, id_factory=id_factory)


_CHANNEL = regex.compile(
    "|".join(f"(?P<{k}>{p})" for k, p in {
        "open_think": OPEN_THINK, "close_think": CLOSE_THINK, "open_response": OPEN_RESPONSE,
        "close_response": CLOSE_RESPONSE, "open_tools": OPEN_TOOLS, "close_tools": CLOSE_TOOLS,
    }.items()))


def k3_last_channel(output: str | Iterable[Segment | tuple[str, bool]]) -> str | None:
    """Kind of the last channel marker (``"open_think"``, ``"close_think"``,
    ``"open_response"`` …) in a prompt(+output), or None. A ``str`` is trusted text; segments
    (``decode_segments``) take markup from special ids only."""
    internal = (K3_MARKUP.whole_trusted(output) if isinstance(output, str)
                else K3_MARKUP.from_segments(output))
    last = None
    for last in _CHANNEL.finditer(internal):
        pass
    return None if last is None else last.lastgroup


def k3_reasoning_ended(output: str | Iterable[Segment | tuple[str, bool]]) -> bool:
    """Whether reasoning is over: the **last** channel marker exists and is not
    ``<|open|>think<|sep|>`` (earlier turns' think closes don't count)."""
    last = k3_last_channel(output)
    return last is not None and last != "open_think"
