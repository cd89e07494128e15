"""Requests, outputs and the host-side per-row controller of a generation.

The jitted step only samples; everything that needs text or a state machine runs here, on the
host, once per generated token: stop ids, stop strings (with hold-back of a possible partial
match), the thinking budget (chat_format.md §4, ``k31jax.chat.ThinkingBudget``), incremental
UTF-8 decoding and the streaming K3 parser.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..chat import K3StreamParser, ParsedMessage, ParseEvent, ThinkingBudget, ThinkPhase
from ..chat._k2 import K2StreamParser
from ..chat._k3_output import k3_reasoning_ended
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
    """

    prompt: Sequence[int]
    params: SamplingParams = SamplingParams()
    max_new_tokens: int = 64
    stop_ids: frozenset[int] | None = None
    stop: tuple[str, ...] = ()
    thinking_budget: int | None = None
    parse: bool = False
    chat_format: str = "k3"

    def __post_init__(self):
        if len(self.prompt) == 0:
            raise ValueError("every prompt needs at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} (must be >= 1)")
        if self.chat_format not in ("k3", "k2"):
            raise ValueError(f"chat_format={self.chat_format!r} (must be 'k3' or 'k2')")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


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
        if (req.stop or req.parse or budget is not None) and tokenizer is None:
            raise ValueError("stop strings, parse and thinking_budget need an engine tokenizer")
        self._decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        self._text: list[str] = []
        self._pending = ""
        self._max_stop = max((len(s) for s in req.stop), default=0)
        self.parser = None
        if req.parse:
            thinking = _prompt_opens_thinking(tokenizer.decode(req.prompt), req.chat_format)
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

    # ---- one token --------------------------------------------------------------------
    def push(self, token: int) -> StreamDelta:
        self.tokens.append(token)
        if self.budget is not None:
            self.budget.step(token)
            if self.forced_at is None and self.budget.phase is ThinkPhase.FORCING:
                self.forced_at = len(self.tokens)
        events: list[ParseEvent] = []
        if token in self.stop_ids:
            text = self._flush_text()
            if self.parser is not None:
                events += self._parse(text) + self.parser.feed(self._decoder.step(token))
                events += self.parser.finish()
            elif self._decoder is not None:
                self._decoder.step(token)
            return self._finish(FINISH_STOP, token, text, events)
        text, hit = self._add_text(token)
        if hit is not None:
            events += self._parse(text)
            if self.parser is not None:
                events += self.parser.finish()
            return self._finish(FINISH_STOP, hit, text, events)
        if len(self.tokens) >= self.req.max_new_tokens:
            text += self._flush_text()
            events += self._parse(text)
            if self.parser is not None:
                events += self.parser.finish()
            return self._finish(FINISH_LENGTH, None, text, events)
        events += self._parse(text)
        return StreamDelta(self.index, (token,), text, tuple(events))

    def _parse(self, text: str) -> list[ParseEvent]:
        return self.parser.feed(text) if self.parser is not None and text else []

    def _finish(self, reason, match, text, events) -> StreamDelta:
        self.done, self.finish_reason, self.stop_match = True, reason, match
        return StreamDelta(self.index, (self.tokens[-1],), text, tuple(events), reason)

    def _add_text(self, token: int) -> tuple[str, str | None]:
        """Decode one token; returns (committed text, matched stop string or None)."""
        if self._decoder is None:
            return "", None
        buf = self._pending + self._decoder.step(token)
        if not self.req.stop:
            self._text.append(buf)
            self._pending = ""
            return buf, None
        hits = [(buf.find(s), s) for s in self.req.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i, s = min(hits)
            self._text.append(buf[:i])
            self._pending = ""
            return buf[:i], s
        hold = 0  # longest suffix of buf that is a proper prefix of a stop string
        for k in range(min(len(buf), self._max_stop - 1), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.req.stop):
                hold = k
                break
        commit = buf[: len(buf) - hold]
        self._pending = buf[len(buf) - hold :]
        self._text.append(commit)
        return commit, None

    def _flush_text(self) -> str:
        if self._decoder is None:
            return ""
        tail = self._pending + self._decoder.flush()
        self._pending = ""
        self._text.append(tail)
        return tail

    def completion(self, prompt_tokens: int) -> Completion:
        return Completion(
            index=self.index, prompt_tokens=prompt_tokens, tokens=list(self.tokens),
            text="".join(self._text), finish_reason=self.finish_reason or FINISH_LENGTH,
            stop=self.stop_match, parsed=self.parser.result() if self.parser is not None else None,
            thinking_tokens=self.budget.think_count if self.budget is not None else None,
            forced_at=self.forced_at,
        )


def _prompt_opens_thinking(prompt_text: str, chat_format: str) -> bool:
    """Whether generation starts inside the think channel (the prompt's last channel marker
    is an open-think)."""
    if chat_format == "k2":
        return prompt_text.rstrip().endswith("<think>")
    return "<|open|>think<|sep|>" in prompt_text and not k3_reasoning_ended(prompt_text)


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


def prompt_lengths(requests: Sequence[Request]) -> list[int]:
    return [len(r.prompt) for r in requests]
