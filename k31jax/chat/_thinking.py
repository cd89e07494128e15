"""Hard thinking budget as a pure-Python state machine (chat_format.md §4).

A generation engine creates one ``ThinkingBudgetState`` per sequence with
``ThinkingBudget.start(prompt_ids)`` and reports **every** token appended to the sequence
(sampled or forced) with ``state.step(token_id)``. ``step`` returns ``None`` while sampling is
free, or the list of token ids that must come next, in order (the rest of the forced
sequence). ``forced_token()`` gives just the next forced id, for engines that force one token
per step (one-hot logits, ``where(mask, 0, -inf)``).

Phases: ``THINK`` counts generated tokens of the current turn; at the budget it waits until
the pending bytes form complete UTF-8 and no marker is half-emitted (``<|open|>`` /
``<|close|>`` + name still waiting for ``<|sep|>``), then goes to ``FORCING``: optional wrap-up
text, ``<|close|>think<|sep|>``, ``<|open|>response<|sep|>``. The model closing the think
channel itself (or opening response/tools) ends ``THINK`` without forcing. Earlier turns'
thinking in the prompt never counts.
"""

from __future__ import annotations

import codecs
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from k31jax.chat._render import close_tag, open_tag
from k31jax.chat._tokenizer import Segment, TokenizerBase


class ThinkPhase(enum.Enum):
    WAIT_OPEN = "wait_open"  # K2-Thinking: the model opens <think> itself
    THINK = "think"
    FORCING = "forcing"
    DONE = "done"


def _ends_with(ids: Sequence[int], seq: Sequence[int]) -> bool:
    return len(ids) >= len(seq) and list(ids[len(ids) - len(seq) :]) == list(seq)


def _last_marker(ids: Sequence[int], markers: Sequence[Sequence[int]]) -> int | None:
    """Index (into ``markers``) of the marker occurring last in ``ids``; scans backwards."""
    for i in range(len(ids) - 1, -1, -1):
        for k, seq in enumerate(markers):
            if ids[i] == seq[0] and list(ids[i : i + len(seq)]) == list(seq):
                return k
    return None


@dataclass(frozen=True)
class ThinkingBudget:
    """Static description of a budget for one tokenizer/format. Build with ``k3`` or ``k2``."""

    budget: int
    forced: tuple[int, ...]
    open_think: tuple[int, ...]
    end_sequences: tuple[tuple[int, ...], ...]  # generated suffixes that end THINK
    channel_markers: tuple[tuple[int, ...], ...]  # prompt markers that close/leave thinking
    marker_start_ids: frozenset[int]
    marker_end_id: int | None
    token_bytes: Callable[[int], bytes]
    wait_for_open: bool = False
    max_defer: int = 64  # force anyway after this many tokens past the budget

    @classmethod
    def k3(cls, tokenizer: TokenizerBase, budget: int, *, wrap_up: str = "",
           max_defer: int = 64) -> "ThinkingBudget":
        enc = lambda segs: tuple(tokenizer.encode_segments(segs))  # noqa: E731
        close_think, open_resp = enc(close_tag("think")), enc(open_tag("response"))
        open_tools = enc(open_tag("tools"))
        return cls(
            budget=budget,
            forced=enc([Segment(wrap_up, False)]) + close_think + open_resp,
            open_think=enc(open_tag("think")),
            end_sequences=(close_think, open_resp, open_tools),
            channel_markers=(close_think, open_resp, open_tools),
            marker_start_ids=frozenset({tokenizer.special_id("<|open|>"),
                                        tokenizer.special_id("<|close|>")}),
            marker_end_id=tokenizer.special_id("<|sep|>"),
            token_bytes=tokenizer.token_bytes,
            max_defer=max_defer,
        )

    @classmethod
    def k2(cls, tokenizer: TokenizerBase, budget: int, *, wrap_up: str = "",
           wait_for_open: bool = True, max_defer: int = 64) -> "ThinkingBudget":
        close_think = (tokenizer.special_id("</think>"),)
        return cls(
            budget=budget,
            forced=tuple(tokenizer.encode(wrap_up)) + close_think,
            open_think=(tokenizer.special_id("<think>"),),
            end_sequences=(close_think, (tokenizer.special_id("<|tool_calls_section_begin|>"),)),
            channel_markers=(close_think,),
            marker_start_ids=frozenset(),
            marker_end_id=None,
            token_bytes=tokenizer.token_bytes,
            wait_for_open=wait_for_open,
            max_defer=max_defer,
        )

    def start(self, prompt_ids: Sequence[int] | None = None, *,
              thinking: bool = True) -> "ThinkingBudgetState":
        """Initial state: ``THINK`` iff the prompt's last channel marker opens the think channel
        (``prompt_ids=None`` assumes it does); ``DONE`` when thinking is off."""
        if not thinking:
            return ThinkingBudgetState(self, ThinkPhase.DONE)
        if prompt_ids is None:
            return ThinkingBudgetState(self, ThinkPhase.THINK)
        last = _last_marker(list(prompt_ids), (self.open_think, *self.channel_markers))
        if last == 0:
            phase = ThinkPhase.THINK
        elif last is None and self.wait_for_open:
            phase = ThinkPhase.WAIT_OPEN
        else:
            phase = ThinkPhase.DONE
        return ThinkingBudgetState(self, phase)


class ThinkingBudgetState:
    """Per-sequence state: ``phase``, ``think_count``, ``force_pos``."""

    def __init__(self, cfg: ThinkingBudget, phase: ThinkPhase):
        self.cfg = cfg
        self.phase = phase
        self.think_count = 0
        self.force_pos = 0
        self._tail: list[int] = []
        self._tail_len = max([len(s) for s in cfg.end_sequences] + [len(cfg.open_think)])
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._in_marker = False
        if phase is ThinkPhase.THINK and cfg.budget <= 0:
            self.phase = ThinkPhase.FORCING

    def forced_token(self) -> int | None:
        """The id the next step must produce, or ``None`` when sampling is free."""
        return self.cfg.forced[self.force_pos] if self.phase is ThinkPhase.FORCING else None

    def remaining_forced(self) -> list[int]:
        return list(self.cfg.forced[self.force_pos :]) if self.phase is ThinkPhase.FORCING else []

    def step(self, token_id: int) -> list[int] | None:
        """Report one appended token; returns the ids that must follow, or ``None``."""
        cfg, phase = self.cfg, self.phase
        if phase is ThinkPhase.DONE:
            return None
        if phase is ThinkPhase.FORCING:
            expected = cfg.forced[self.force_pos]
            if token_id != expected:
                raise ValueError(f"forced position {self.force_pos} must be token {expected}, "
                                 f"got {token_id}")
            self.force_pos += 1
            if self.force_pos == len(cfg.forced):
                self.phase = ThinkPhase.DONE
                return None
            return self.remaining_forced()
        self._tail = (self._tail + [token_id])[-self._tail_len :]
        if phase is ThinkPhase.WAIT_OPEN:
            if _ends_with(self._tail, cfg.open_think):
                self.phase, self._tail = ThinkPhase.THINK, []
                if cfg.budget <= 0:
                    self.phase = ThinkPhase.FORCING
                    return self.remaining_forced()
            return None
        # THINK
        self.think_count += 1
        self._utf8.decode(cfg.token_bytes(token_id))
        if token_id in cfg.marker_start_ids:
            self._in_marker = True
        elif token_id == cfg.marker_end_id:
            self._in_marker = False
        if any(_ends_with(self._tail, s) for s in cfg.end_sequences):
            self.phase = ThinkPhase.DONE
            return None
        if self.think_count >= cfg.budget:
            clean = not self._utf8.getstate()[0] and not self._in_marker
            if clean or self.think_count >= cfg.budget + cfg.max_defer:
                self.phase = ThinkPhase.FORCING
                return self.remaining_forced()
        return None
