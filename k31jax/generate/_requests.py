"""Requests, outputs and the host-side per-row controller of a generation.

The jitted step only samples; everything that needs text or a state machine runs here, on the
host, once per generated token: stop ids, stop strings (with hold-back of a possible partial
match), the thinking budget (chat_format.md §4, ``k31jax.chat.ThinkingBudget``), incremental
UTF-8 decoding and the streaming K3 parser. ``Request.markup`` says where output structure
comes from: "text" (the spec, chat_format.md §3: markers are parsed from the decoded text,
since the model sometimes spells them with ordinary BPE tokens) or "ids" (only sampled special
ids are markup, from ``StreamDecoder.step_pieces``: a model steered to write ``<|open|>`` with
ordinary tokens has written text, so it cannot forge a tool call).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from ..chat import (K2StreamParser, K3StreamParser, ParsedMessage, ParseEvent, Segment, ThinkingBudget, ThinkPhase,
                   k3_last_channel)
from ._grammar import OutputGrammar
from ._sampling import SamplingParams

FINISH_STOP = "stop"  # a stop id or stop string ended the row
FINISH_LENGTH = "length"  # max_new_tokens


@dataclasses.dataclass(frozen=True)
class Request:
    """One sequence to continue.

    prompt           token ids (at least one).
    params           sampling (temperature, top-k/p, min-p, repetition penalty, seed).
    max_new_tokens   generated tokens at most (forced tokens count).
    stop_ids         ids that end the row (kept as its last token, not in its text);
                     ``None`` = the engine default (the tokenizer's {[EOS], <|end_of_msg|>}).
    stop             strings that end the row; the text is cut before the match.
    thinking_budget  hard cap on this turn's thinking tokens (None = off); needs a tokenizer.
    parse            also stream structured events (reasoning / content / tool calls).
    chat_format      "k3" or "k2": grammar of the parser and the budget's markers.
    markup           "text" (default, the spec's rule) or "ids": see the module docstring.
    images           `k31jax.vision.ProcessedImage`s in prompt order, one per media block of
                     the prompt (`ImagePrompts.images`); their rows replace its
                     `<|media_pad|>` embeddings in prefill. Needs an engine with a vision model.
    healed_prefix    token healing (`heal_prompt`): the bytes of the token backed off the end of
                     `prompt`. The first generated token must start with them, and the text
                     leaves them out (the reader has them); needs a tokenizer.
    snapshot_at      ``Scheduler`` only: also store the state after these numbers of prompt
                     tokens in its prefix cache (an int or several). A server passes the end of
                     the conversation when notes follow it (the tool-choice message), which the
                     next turn does not repeat: that turn then still resumes the whole history;
                     and the start of each new tool result, where a compacted history
                     (``k31jax.chat.compact_history``) first differs.
    grammar          ``Scheduler`` only: an ``OutputGrammar`` the reply must follow (the K3
                     output structure, tool-call arguments valid against their schemas, JSON
                     content); the prompt must end in a K3 generation prompt. None: free.
    """

    prompt: Sequence[int]
    params: SamplingParams = SamplingParams()
    max_new_tokens: int = 64
    stop_ids: frozenset[int] | None = None
    stop: tuple[str, ...] = ()
    thinking_budget: int | None = None
    parse: bool = False
    chat_format: str = "k3"
    markup: str = "text"
    images: tuple = ()
    healed_prefix: bytes = b""
    snapshot_at: int | Sequence[int] = ()
    grammar: OutputGrammar | None = None

    def __post_init__(self):
        if len(self.prompt) == 0:
            raise ValueError("every prompt needs at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} (must be >= 1)")
        if self.chat_format not in ("k3", "k2"):
            raise ValueError(f"chat_format={self.chat_format!r} (must be 'k3' or 'k2')")
        if self.markup not in ("text", "ids"):
            raise ValueError(f"markup={self.markup!r} (must be 'text' or 'ids')")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "images", tuple(self.images))
        marks = (self.snapshot_at,) if isinstance(self.snapshot_at, int) else tuple(self.snapshot_at or ())
        object.__setattr__(self, "snapshot_at", marks)
        if any(not (hasattr(im, "patches") and hasattr(im, "grid")) for im in self.images):
            raise ValueError("images must be processed images (k31jax.vision.preprocess_image / ImagePrompts)")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.grammar is not None and self.chat_format != "k3":
            raise ValueError("a grammar constrains K3 replies only (chat_format='k3')")


@dataclasses.dataclass(frozen=True)
class StreamDelta:
    """What one row produced in one step.

    token_ids  ids appended this step (one, or none for a row that already finished).
    text       visible text completed by this step (held back while it could be the start of
               a stop string or an unfinished UTF-8 character; stop-id text is never shown).
    events     parser events (``ReasoningDelta``, ``ContentDelta``, ``ToolCall*``) when the
               request asked for ``parse``.
    finish_reason  ``"stop"`` / ``"length"`` on the row's last delta, else None.
    """

    index: int
    token_ids: tuple[int, ...]
    text: str
    events: tuple[ParseEvent, ...] = ()
    finish_reason: str | None = None


@dataclasses.dataclass
class Completion:
    """The finished output of one request."""

    index: int
    prompt_tokens: int
    tokens: list[int]
    text: str
    finish_reason: str
    stop: int | str | None = None  # the stop id or string that ended the row
    parsed: ParsedMessage | None = None
    thinking_tokens: int | None = None  # counted by the budget (None without one)
    forced_at: int | None = None  # generated index where the budget began forcing


class RowController:
    """Host state of one row: consumes each generated id, says what to force next."""

    def __init__(self, index: int, req: Request, tokenizer, default_stop_ids: frozenset[int],
                 budget: ThinkingBudget | None):
        self.index, self.req = index, req
        self.stop_ids = default_stop_ids if req.stop_ids is None else frozenset(req.stop_ids)
        self.tokens: list[int] = []
        self.done = False
        self.finish_reason: str | None = None
        self.stop_match: int | str | None = None
        self.forced_at: int | None = None
        if (req.stop or req.parse or budget is not None or req.healed_prefix) and tokenizer is None:
            raise ValueError("stop strings, parse, thinking_budget and healed_prefix need an engine tokenizer")
        self._decoder = tokenizer.stream_decoder(skip=req.healed_prefix) if tokenizer is not None else None
        self._text: list[str] = []
        # Decoded pieces not yet given to the parser (held for a possible stop string), and how
        # many of their characters were already shown: a stop string may cut the visible text
        # inside a special token's name, but the parser only ever gets whole special pieces.
        self._pending: list[Segment] = []
        self._pending_shown = 0
        self._max_stop = max((len(s) for s in req.stop), default=0)
        self.parser = None
        if req.parse:
            prompt_ids = req.prompt
            if req.markup == "text":  # markers spelled with ordinary tokens count too
                prompt_ids = tokenizer.encode(tokenizer.decode(req.prompt), allow_special=True)
            thinking = _prompt_opens_thinking(tokenizer.decode_segments(prompt_ids), req.chat_format)
            cls = K3StreamParser if req.chat_format == "k3" else K2StreamParser
            self.parser = cls(thinking=thinking)
        self.budget = budget.start(req.prompt) if budget is not None else None
        if self.budget is not None and self.budget.phase is ThinkPhase.FORCING:
            self.forced_at = 0

    # ---- forcing ----------------------------------------------------------------------
    def force(self) -> int:
        """The id the next step must produce, or -1."""
        if self.done or self.budget is None:
            return -1
        f = self.budget.forced_token()
        return -1 if f is None else f

    def predict_force_after_next(self) -> int | None:
        """The force value of the step after the next one when it is already determined
        without seeing the next token, else None (lets the engine dispatch ahead)."""
        b = self.budget
        if self.done or b is None or b.phase is ThinkPhase.DONE:
            return -1
        if b.phase is ThinkPhase.WAIT_OPEN:
            return -1 if b.cfg.budget > 0 else None
        if b.phase is ThinkPhase.FORCING:
            nxt = b.force_pos + 1
            return b.cfg.forced[nxt] if nxt < len(b.cfg.forced) else -1
        return -1 if b.think_count + 1 < b.cfg.budget else None  # THINK

    def unforced_run(self) -> int:
        """How many of the next tokens are certainly sampled freely, whatever they are (the
        thinking budget forces its closing markup only once the count of thinking tokens
        reaches it); `sys.maxsize` when nothing can force one. A speculative step drafts at
        most one fewer, so every token it keeps is one no rule would have forced."""
        b = self.budget
        if self.done or b is None or b.phase is ThinkPhase.DONE:
            return sys.maxsize
        if self.force() >= 0:
            return 0
        if b.phase is ThinkPhase.WAIT_OPEN:
            return b.cfg.budget
        return b.cfg.budget - b.think_count  # THINK: token j is forced once think_count + j reaches it

    # ---- one token --------------------------------------------------------------------
    def push(self, token: int) -> StreamDelta:
        self.tokens.append(token)
        if self.budget is not None:
            self.budget.step(token)
            if self.forced_at is None and self.budget.phase is ThinkPhase.FORCING:
                self.forced_at = len(self.tokens)
        events: list[ParseEvent] = []
        if token in self.stop_ids:
            text, pieces = self._flush_text()
            if self.parser is not None:  # the stop id's text is not shown, but it ends the parse
                events += self._parse(pieces + self._decoder.step_pieces(token))
                events += self.parser.finish()
            elif self._decoder is not None:
                self._decoder.step(token)
            return self._finish(FINISH_STOP, token, text, events)
        text, pieces, hit = self._add_text(token)
        if hit is not None:
            events += self._parse(pieces)
            if self.parser is not None:
                events += self.parser.finish()
            return self._finish(FINISH_STOP, hit, text, events)
        if len(self.tokens) >= self.req.max_new_tokens:
            tail_text, tail = self._flush_text()
            text, pieces = text + tail_text, pieces + tail
            events += self._parse(pieces)
            if self.parser is not None:
                events += self.parser.finish()
            return self._finish(FINISH_LENGTH, None, text, events)
        events += self._parse(pieces)
        return StreamDelta(self.index, (token,), text, tuple(events))

    def _parse(self, pieces: list[Segment]) -> list[ParseEvent]:
        if self.parser is None or not pieces:
            return []
        if self.req.markup == "text":
            return self.parser.feed(_text_of(pieces))
        return self.parser.feed_segments(pieces)

    def _finish(self, reason, match, text, events) -> StreamDelta:
        self.done, self.finish_reason, self.stop_match = True, reason, match
        return StreamDelta(self.index, (self.tokens[-1],), text, tuple(events), reason)

    def _add_text(self, token: int) -> tuple[str, list[Segment], str | None]:
        """Decode one token; returns (text to show, pieces for the parser, matched stop string
        or None). The text is cut exactly before a stop string; the parser gets the pieces
        before the cut, less a special token's name that the cut falls inside."""
        if self._decoder is None:
            return "", [], None
        pieces = self._pending + self._decoder.step_pieces(token)
        buf, shown = _text_of(pieces), self._pending_shown
        if not self.req.stop:
            self._pending, self._pending_shown = [], 0
            return self._show(buf[shown:]), pieces, None
        hits = [(buf.find(s, shown), s) for s in self.req.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i, s = min(hits)
            self._pending, self._pending_shown = [], 0
            return self._show(buf[shown:i]), _split_pieces(pieces, i)[0], s
        hold = 0  # longest unshown suffix of buf that is a proper prefix of a stop string
        for k in range(min(len(buf) - shown, self._max_stop - 1), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.req.stop):
                hold = k
                break
        cut = len(buf) - hold
        commit, self._pending = _split_pieces(pieces, cut)
        self._pending_shown = cut - len(_text_of(commit))
        return self._show(buf[shown:cut]), commit, None

    def _flush_text(self) -> tuple[str, list[Segment]]:
        """Release everything held back: (text to show, pieces for the parser)."""
        if self._decoder is None:
            return "", []
        pieces = self._pending + [Segment(self._decoder.flush(), False)]
        text = _text_of(pieces)[self._pending_shown :]
        self._pending, self._pending_shown = [], 0
        return self._show(text), pieces

    def _show(self, text: str) -> str:
        self._text.append(text)
        return text

    def completion(self, prompt_tokens: int) -> Completion:
        return Completion(
            index=self.index, prompt_tokens=prompt_tokens, tokens=list(self.tokens),
            text="".join(self._text), finish_reason=self.finish_reason or FINISH_LENGTH,
            stop=self.stop_match, parsed=self.parser.result() if self.parser is not None else None,
            thinking_tokens=self.budget.think_count if self.budget is not None else None,
            forced_at=self.forced_at,
        )


def _text_of(pieces: Sequence[Segment]) -> str:
    return "".join(p.text for p in pieces)


def _split_pieces(pieces: Sequence[Segment], at: int) -> tuple[list[Segment], list[Segment]]:
    """Split decoded pieces at character ``at``. A special token's name is never split: one
    that ``at`` falls inside goes wholly to the second part."""
    head: list[Segment] = []
    for k, p in enumerate(pieces):
        if at >= len(p.text):
            head.append(p)
            at -= len(p.text)
            continue
        if at == 0 or p.special:
            return head, list(pieces[k:])
        return head + [Segment(p.text[:at], False)], [Segment(p.text[at:], False), *pieces[k + 1 :]]
    return head, []


def _prompt_opens_thinking(prompt: Sequence[Segment], chat_format: str) -> bool:
    """Whether generation starts inside the think channel: the prompt's last channel marker
    (from special ids only) is an open-think."""
    if chat_format == "k2":
        marks = [s for s in prompt if s.special or s.text.strip()]
        return bool(marks) and marks[-1] == Segment("<think>", True)
    return k3_last_channel(prompt) == "open_think"


def normalize_requests(prompts, max_new_tokens, params, stop_ids, stop, thinking_budget,
                       parse, chat_format) -> list[Request]:
    """Requests from the engine's keyword API (a prompt may already be a ``Request``)."""
    n = len(prompts)
    if isinstance(params, SamplingParams) or params is None:
        params = [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
    out = []
    for p, sp in zip(prompts, params):
        if isinstance(p, Request):
            out.append(p)
        else:
            out.append(Request(list(p), sp, max_new_tokens,
                               None if stop_ids is None else frozenset(stop_ids),
                               tuple([stop] if isinstance(stop, str) else stop),
                               thinking_budget, parse, chat_format))
    return out

