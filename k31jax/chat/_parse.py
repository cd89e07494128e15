"""Output parsing, whole and streaming (chat_format.md §3), for the K3 and K2 grammars.

Markers are matched on text (tag names and attributes are BPE text, and whitespace is tolerated
inside markers), but their special parts (``<|open|>``, ``<|sep|>``, ``<|end_of_msg|>`` …) count
only where they came from special ids: the parse runs on the internal form of ``_markup``,
built from decoded segments (engine) or from a trusted string (stored text). One grammar object
describes a format; ``parse_output`` is the whole parser and ``StreamParser`` the incremental
one. Streaming holds back any suffix that could still become a marker and emits a tool call
only once it is complete, so the concatenated stream always equals the whole parse of the same
output, however it is split.

Whole-parse semantics (both formats):
1. The turn ends at the first END marker (``<|end_of_msg|>``/``<|im_end|>`` or ``[EOS]``); the
   rest is ignored.
2. Thinking on: an open-think marker is skipped **only at the very start** (after whitespace).
   Reasoning runs to the first reasoning-end marker. A close-think is consumed; the implicit
   ends (response/tools open, response/message close) stay for the next phase. No end at all:
   everything is reasoning and ``content`` is ``None``.
3. Content: a response-open marker is skipped only at the start of the content region. Content
   runs to the first content-end marker (response close, message close, tools open).
4. Tools start at the first tools-open marker after the content and end at the tools close (or
   message close, or the end of the text). A call ends at its close marker, or implicitly at
   the next call open, the tools/message close or END; a call cut off by truncation is dropped.
   With ``repeat_sections`` (K2), content resumes after a tools close: text between sections
   is content and every section's calls are kept, in order.
5. Truncation (no END): a trailing partial marker (it starts with a special id) is stripped
   from reasoning or content that has no end marker.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import regex

from k31jax.chat._markup import MARK_CLASS, Markup
from k31jax.chat._tokenizer import Segment

IdFactory = Callable[[], str]


def new_tool_call_id() -> str:
    """``call_<24 hex>``: the server-minted K3 tool-call id (K3 emits none)."""
    return "call_" + secrets.token_hex(12)


# ---- results and events ----------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text (OpenAI ``function.arguments``)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        """An OpenAI assistant message, fit to be passed back unchanged in the next request."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


ParseEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd

# ---- grammar ---------------------------------------------------------------------------
# kinds: close_think (consumed), open_response, close_response, open_tools, close_tools,
# close_message, open_call, close_call, end. Patterns are written in the internal form
# (``markup(name)`` for a special name); make_call gets a call's header and body in that form.
MakeCall = Callable[[str, str, IdFactory], "ToolCall | None"]


def _alt(patterns: Mapping[str, str]) -> regex.Pattern:
    return regex.compile("|".join(f"(?P<{k}>{p})" for k, p in patterns.items()), regex.DOTALL)


class Grammar:
    """Compiled marker sets of one output format (patterns over ``markup``'s internal form)."""

    def __init__(self, *, markup: Markup, open_think: str | None, open_response: str | None,
                 reasoning_end: Mapping[str, str], content_end: Mapping[str, str],
                 open_tools: str, tool_markers: Mapping[str, str], end: str,
                 make_call: MakeCall, repeat_sections: bool = False):
        self.markup = markup
        self.repeat_sections = repeat_sections
        self.start_think = regex.compile(rf"\s*(?:{open_think})") if open_think else None
        self.start_response = regex.compile(rf"\s*(?:{open_response})") if open_response else None
        self.end = regex.compile(end)
        self.reasoning = _alt({**reasoning_end, "end": end})
        self.content = _alt({**content_end, "end": end})
        self.after_content = _alt({"open_tools": open_tools, "end": end})
        self.tools = _alt({**tool_markers, "end": end})
        self.make_call = make_call

    @staticmethod
    def kind(m: regex.Match) -> str:
        for k, v in m.groupdict().items():
            if v is not None and k in _KINDS:
                return k
        raise AssertionError(m)


_KINDS = frozenset({"close_think", "open_response", "close_response", "open_tools",
                    "close_tools", "close_message", "open_call", "close_call", "end"})


def strip_partial_tail(rx: regex.Pattern, text: str) -> str:
    """Drop a trailing partial marker of ``rx`` (it starts with a special id)."""
    m = rx.search(text, partial=True)
    if m is not None and m.partial and _MARKER_START.match(text, m.start()):
        return text[: m.start()]
    return text


def leftmost_marker(rx: regex.Pattern, text: str, pos: int, final: bool) -> regex.Match | None:
    """The leftmost complete **or partial** match of ``rx`` in ``text[pos:]``.

    A partial match (``m.partial``) is a suffix of ``text`` that is a proper prefix of a
    marker: text from there on must be held back. ``regex``'s own partial search prefers a
    complete match anywhere over an earlier partial one (a quoted attribute value can contain
    a complete marker), so earlier marker starts are checked explicitly. With ``final`` only
    complete matches count.
    """
    if final:
        return rx.search(text, pos)
    m = rx.search(text, pos, partial=True)
    if m is None or m.partial:
        return None if m is None or m.start() == len(text) else m
    for c in _MARKER_START.finditer(text, pos, m.start()):
        p = rx.match(text, c.start(), partial=True)
        if p is not None and p.partial:
            return p
    return m


_MARKER_START = regex.compile(MARK_CLASS)  # every marker starts with a special id


def header_end(rx: regex.Pattern | None, text: str, pos: int, truncated: bool) -> int:
    """Where the content after an optional channel header (``rx``, anchored at ``pos``)
    starts. In truncated output, a header cut off mid-way (all the rest of ``text`` is a
    proper prefix of it, e.g. a forced ``<|open|>response`` that ran out of tokens before
    ``<|sep|>``) is markup, not text: it is consumed."""
    if rx is None:
        return pos
    m = rx.match(text, pos, partial=truncated)
    return pos if m is None else len(text) if m.partial else m.end()


# ---- whole parse -----------------------------------------------------------------------
def parse_output(g: Grammar, internal: str, *, thinking: bool = True,
                 id_factory: IdFactory | None = None) -> ParsedMessage:
    """Parse one complete output given in ``g.markup``'s internal form."""
    new_id = id_factory or new_tool_call_id
    restore = g.markup.restore
    e = g.end.search(internal)
    ended = e is not None
    body = internal[: e.start()] if ended else internal

    reasoning: str | None = None
    pos = 0
    if thinking:
        start = header_end(g.start_think, body, 0, not ended)
        m = g.reasoning.search(body, start)
        if m is None:
            tail = body[start:]
            return ParsedMessage(restore(tail if ended else strip_partial_tail(g.reasoning, tail)), None, [])
        reasoning = restore(body[start : m.start()])
        pos = m.end() if g.kind(m) == "close_think" else m.start()

    content: list[str] = []
    calls: list[ToolCall] = []
    pos = header_end(g.start_response, body, pos, not ended)
    while pos is not None:
        m = g.content.search(body, pos)
        if m is None:
            tail = body[pos:]
            content.append(tail if ended else strip_partial_tail(g.content, tail))
            break
        content.append(body[pos : m.start()])
        t = m if g.kind(m) == "open_tools" else g.after_content.search(body, m.end())
        pos = None if t is None else _parse_tools(g, body, t.end(), ended, new_id, calls)
    return ParsedMessage(reasoning, restore("".join(content)), calls)


def _parse_tools(g: Grammar, body: str, pos: int, ended: bool, new_id: IdFactory,
                 calls: list[ToolCall]) -> int | None:
    """Append the calls of the tools section starting at ``pos``; returns where content
    resumes (after a tools close, with ``repeat_sections``), else None (the message is over)."""
    cur: regex.Match | None = None
    for mm in g.tools.finditer(body, pos):
        kind = g.kind(mm)
        if cur is not None:
            call = g.make_call(cur.group(), body[cur.end() : mm.start()], new_id)
            calls.extend([call] if call is not None else [])
            cur = None
        if kind == "open_call":
            cur = mm
        elif kind == "close_tools" and g.repeat_sections:
            return mm.end()
        elif kind in ("close_tools", "close_message"):
            return None
    if cur is not None and ended:  # implicitly closed by END; truncation drops it
        call = g.make_call(cur.group(), body[cur.end() :], new_id)
        calls.extend([call] if call is not None else [])
    return None


# ---- streaming parse -------------------------------------------------------------------
_PRE_REASON, _REASON, _PRE_CONTENT, _CONTENT, _AFTER_CONTENT, _TOOLS, _DONE = range(7)


class StreamParser:
    """Incremental parser: ``feed_segments`` / ``feed`` → events, then ``finish()`` → events.

    ``feed_segments(pieces)`` takes decoded pieces that mark which text came from special ids
    (``StreamDecoder.step_pieces``): only those are markup, so ordinary tokens that spell
    ``<|open|>`` stay text. This is the path for model output. ``feed(text)`` takes plain text
    and **trusts** it: every special name in it is markup (stored transcripts, text decoded
    with specials kept). Pieces may be split anywhere. ``result()`` is the message so far;
    after ``finish()`` it equals the whole parse of the same input.
    """

    def __init__(self, grammar: Grammar, *, thinking: bool = True,
                 id_factory: IdFactory | None = None):
        self._g = grammar
        self._thinking = thinking
        self._new_id = id_factory or new_tool_call_id
        self._buf = ""  # internal form (see _markup)
        self._held = ""  # trusted text that may still grow into a special name
        self._phase = _PRE_REASON if thinking else _PRE_CONTENT
        self._pos = self._emitted = self._scan = 0
        self._call: tuple[str, int] | None = None  # (header, body start)
        self._reasoning: list[str] = []
        self._content: list[str] | None = None
        self._calls: list[ToolCall] = []
        self._finished = False

    @property
    def done(self) -> bool:
        """The turn has ended (END seen, tools closed, or ``finish`` called)."""
        return self._phase == _DONE

    def feed(self, text: str) -> list[ParseEvent]:
        """Feed trusted text: special names in it are markup."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if not text or self._phase == _DONE:
            return []
        internal, self._held = self._g.markup.split_trusted(self._held + text)
        return self._add(internal)

    def feed_segments(self, segments: Iterable[Segment | tuple[str, bool]]) -> list[ParseEvent]:
        """Feed decoded pieces: markup comes only from the special ones."""
        if self._finished:
            raise RuntimeError("feed_segments() after finish()")
        if self._phase == _DONE:
            return []
        held, self._held = [(self._held, False)], ""  # trusted text cannot go on across segments
        return self._add(self._g.markup.from_segments(held + list(segments)))

    def feed_all(self, pieces: Iterable[str]) -> list[ParseEvent]:
        return [e for p in pieces for e in self.feed(p)]

    def finish(self) -> list[ParseEvent]:
        if self._finished:
            return []
        if self._phase != _DONE:
            self._buf += self._g.markup.end_trusted(self._held)
        events = self._run(final=True)
        self._finished = True
        self._phase = _DONE
        self._buf = self._held = ""
        return events

    def result(self) -> ParsedMessage:
        return ParsedMessage(
            "".join(self._reasoning) if self._thinking else None,
            None if self._content is None else "".join(self._content),
            list(self._calls),
        )

    # ---- internals ---------------------------------------------------------------------
    def _add(self, internal: str) -> list[ParseEvent]:
        if not internal:
            return []
        self._buf += internal
        events = self._run(final=False)
        self._trim()
        return events

    def _emit(self, events: list[ParseEvent], internal: str) -> None:
        if not internal:
            return
        text = self._g.markup.restore(internal)
        if self._phase in (_PRE_REASON, _REASON):
            self._reasoning.append(text)
            events.append(ReasoningDelta(text))
        else:
            self._content.append(text)
            events.append(ContentDelta(text))

    def _complete_call(self, events: list[ParseEvent], end: int) -> None:
        header, start = self._call
        self._call = None
        call = self._g.make_call(header, self._buf[start:end], self._new_id)
        if call is not None:
            i = len(self._calls)
            self._calls.append(call)
            events += [ToolCallStart(i, call.id, call.name), ToolCallArgsDelta(i, call.arguments),
                       ToolCallEnd(i)]

    def _run(self, final: bool) -> list[ParseEvent]:
        g, ev = self._g, []
        while self._phase != _DONE:
            buf, ph = self._buf, self._phase
            if ph in (_PRE_REASON, _PRE_CONTENT):
                rx = g.start_think if ph == _PRE_REASON else g.start_response
                m = rx.match(buf, self._pos, partial=True) if rx else None  # anchored
                if m is not None and m.partial and not final:
                    break  # could still become the opening marker
                if m is not None:  # at the end of a truncated stream a cut-off header is markup too
                    self._pos = len(buf) if m.partial else m.end()
                if ph == _PRE_CONTENT:
                    self._content = []
                self._phase = _REASON if ph == _PRE_REASON else _CONTENT
                self._emitted = self._scan = self._pos
            elif ph in (_REASON, _CONTENT):
                rx = g.reasoning if ph == _REASON else g.content
                m = leftmost_marker(rx, buf, self._scan, final)
                if m is None or m.partial:
                    if final:
                        self._emit(ev, strip_partial_tail(rx, buf[self._emitted :]))
                        self._phase = _DONE
                        break
                    hold = m.start() if m is not None else len(buf)
                    self._emit(ev, buf[self._emitted : hold])
                    self._emitted = self._scan = hold
                    break
                kind = g.kind(m)
                self._emit(ev, buf[self._emitted : m.start()])
                if kind == "end":
                    self._phase = _DONE
                elif ph == _REASON:
                    self._pos = m.end() if kind == "close_think" else m.start()
                    self._phase = _PRE_CONTENT
                else:
                    self._phase = _TOOLS if kind == "open_tools" else _AFTER_CONTENT
                    self._scan = m.end()
            else:  # _AFTER_CONTENT or _TOOLS: only markers matter
                rx = g.after_content if ph == _AFTER_CONTENT else g.tools
                m = leftmost_marker(rx, buf, self._scan, final)
                if m is None or m.partial:
                    if final:
                        self._phase = _DONE  # a call without an end is dropped
                        break
                    self._scan = m.start() if m is not None else len(buf)
                    break
                kind = g.kind(m)
                self._scan = m.end()
                if ph == _AFTER_CONTENT:
                    self._phase = _TOOLS if kind == "open_tools" else _DONE
                    continue
                if self._call is not None:
                    self._complete_call(ev, m.start())
                if kind == "open_call":
                    self._call = (m.group(), m.end())
                elif kind == "close_tools" and self._g.repeat_sections:
                    self._phase = _CONTENT  # content resumes after the section
                    self._emitted = self._scan
                elif kind in ("close_tools", "close_message", "end"):
                    self._phase = _DONE
        return ev

    def _trim(self) -> None:
        """Forget the consumed prefix of the buffer (keeps long streams linear-ish)."""
        ph = self._phase
        if ph == _DONE:
            self._buf = ""
            return
        if ph in (_PRE_REASON, _PRE_CONTENT):
            keep = self._pos
        elif ph in (_REASON, _CONTENT):
            keep = self._emitted
        elif ph == _TOOLS and self._call is not None:
            keep = self._call[1]
        else:
            keep = self._scan
        if keep <= 0:
            return
        self._buf = self._buf[keep:]
        self._pos = max(self._pos - keep, 0)
        self._emitted = max(self._emitted - keep, 0)
        self._scan -= keep
        if self._call is not None:
            self._call = (self._call[0], self._call[1] - keep)


def collect_events(events: Iterable[ParseEvent]) -> ParsedMessage:
    """Fold events into a message (reasoning/content are ``""`` when nothing was emitted)."""
    reasoning, content, calls = [], [], {}
    for e in events:
        if isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls[e.index] = [e.id, e.name, ""]
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index][2] += e.arguments
    return ParsedMessage("".join(reasoning), "".join(content),
                         [ToolCall(*calls[i]) for i in sorted(calls)])
