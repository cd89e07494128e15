"""Drafts for speculative decoding, on the host: what each row proposes for a verify step to
check (``_verify``), and how long its drafts are.

- ``Drafter`` / ``DraftRow``: the interface. A drafter opens a ``DraftRow`` per request (on
  its prompt), is told each token the row emits, and proposes up to a limit of next tokens
  per row; ``Drafter.propose`` takes the whole batch, so a small draft model can run one
  batched forward pass there (the embedded model can draft for any model that shares its
  tokenizer).
- ``NgramDrafter`` (prompt lookup): the continuation after the most recent earlier occurrence
  of the row's last n tokens (prompt and output), longest n first, repeated with its period
  where the occurrence is nearer than the draft is long (a loop). Agent and coding output
  repeats its input (an edited file, a quoted tool result); free text rarely matches, and a
  row without a match drafts nothing, so its step is a plain decode step.
- ``Speculator``: the loop's side. Per row, the draft length adapts: it doubles after a step
  that kept every draft, and falls to one more than the drafts kept after a rejection (a row
  that is far from its source drafts one token at a time until it matches again). It picks
  the verify width for a batch: one more than the longest draft, rounded up to a power of
  two, so a loop compiles at most ``log2(max_draft) + 1`` verify programs per batch size.
  It also times every step the loop reports (``timed``) and keeps the share of drafts kept:
  a verify step runs only where its measured cost, against the tokens its drafts are expected
  to emit, beats plain steps (a refused width is re-timed ever more rarely). Where a verify
  step costs more than its kept drafts save (a wide batch on CPU, where the step is not bound
  by bytes, or few rows drafting), speculation then turns itself off.
- ``Speculation``: the settings (``k31jax generate --speculate ngram``, ``serve --speculate``).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Hashable, Sequence


class DraftRow(abc.ABC):
    """One request's drafting state."""

    @abc.abstractmethod
    def extend(self, tokens: Sequence[int]) -> None:
        """The tokens the row emitted since the last call (in order)."""

    @abc.abstractmethod
    def propose(self, limit: int) -> list[int]:
        """At most `limit` next tokens (none when the drafter has nothing to propose)."""


class Drafter(abc.ABC):
    """Proposes draft tokens; the target model verifies them, so a drafter can only cost speed,
    never change the output."""

    @abc.abstractmethod
    def row(self, prompt: Sequence[int]) -> DraftRow:
        """A row for a request with this prompt."""

    def propose(self, rows: Sequence[DraftRow], limits: Sequence[int]) -> list[list[int]]:
        """Each row's draft (at most its limit). One call per verify step: a model drafter
        overrides this to draft the whole batch in one forward pass."""
        return [row.propose(limit) if limit > 0 else [] for row, limit in zip(rows, limits)]


class NgramRow(DraftRow):
    """A row's tokens and the most recent end of every n-gram in them (n in
    [min_ngram, max_ngram]), indexed up to the token before the last: the prompt's at once (a
    loop opens its rows while the prefill runs on the device), the output's as it proposes."""

    def __init__(self, prompt: Sequence[int], min_ngram: int, max_ngram: int):
        self.tokens = list(prompt)
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in `_ends`
        self._index()

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def _index(self) -> None:
        seq, last = self.tokens, len(self.tokens) - 1
        for end in range(self._indexed, last):  # never the suffix itself
            for n in self.sizes:
                if end - n + 1 >= 0:
                    self._ends[tuple(seq[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, last)

    def propose(self, limit: int) -> list[int]:
        seq = self.tokens
        self._index()
        for n in self.sizes:
            if n > len(seq):
                continue
            end = self._ends.get(tuple(seq[-n:]))
            if end is not None:
                # The match recurs `period` tokens later; past the row's end its continuation
                # repeats with that period, as proposing again after each taken draft would.
                period = len(seq) - 1 - end
                return [seq[end + 1 + i % period] for i in range(limit)]
        return []


class NgramDrafter(Drafter):
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the row's
    last n tokens, for the longest n in [min_ngram, max_ngram] that occurred."""

    def __init__(self, min_ngram: int = 3, max_ngram: int = 6):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes min_ngram={min_ngram}, max_ngram={max_ngram}: expected "
                             f"1 <= min_ngram <= max_ngram")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def row(self, prompt: Sequence[int]) -> NgramRow:
        return NgramRow(prompt, self.min_ngram, self.max_ngram)


DRAFTERS = ("ngram",)
# A refused width is stepped again after this many refusals, then twice as many each time it is
# still refused: its step's cost drifts little, so a re-measure is needed ever more rarely.
PROBE_AFTER = 16
EMA = 0.3  # weight of the newest figure in the moving averages (step seconds, acceptance)


@dataclasses.dataclass(frozen=True)
class Speculation:
    """Speculative decoding settings.

    drafter    "ngram" (`NgramDrafter`) or a `Drafter`.
    max_draft  the most tokens a row drafts for one step (the widest verify program feeds
               max_draft + 1 tokens per row).
    min_ngram, max_ngram  the n-gram sizes of "ngram".
    timed      use a verify width only where its step, at its measured cost and the tokens the
               drafts are expected to keep, emits tokens faster than plain steps do at that
               batch size (`Speculator.width`); False verifies every draft.
    """

    drafter: str | Drafter = "ngram"
    max_draft: int = 8
    min_ngram: int = 3
    max_ngram: int = 6
    timed: bool = True

    def __post_init__(self):
        if isinstance(self.drafter, str) and self.drafter not in DRAFTERS:
            raise ValueError(f"speculative drafter {self.drafter!r}: expected one of {DRAFTERS} or a Drafter")
        if self.max_draft < 1:
            raise ValueError(f"Speculation(max_draft={self.max_draft}): expected >= 1")

    def make_drafter(self) -> Drafter:
        if isinstance(self.drafter, Drafter):
            return self.drafter
        return NgramDrafter(self.min_ngram, self.max_ngram)


@dataclasses.dataclass
class SpeculationStats:
    """Counts over a loop's verify steps: drafted and kept draft tokens, per-row verifications
    (a row with a draft in a verify step)."""

    drafted: int = 0
    accepted: int = 0
    verified_rows: int = 0
    verify_steps: int = 0

    @property
    def acceptance(self) -> float:
        """Kept drafts / drafted tokens."""
        return self.accepted / max(self.drafted, 1)

    @property
    def mean_accepted(self) -> float:
        """Kept drafts per row verification."""
        return self.accepted / max(self.verified_rows, 1)

    def summary(self) -> str:
        return (f"{self.accepted} of {self.drafted} drafted tokens kept ({self.acceptance:.0%}), "
                f"{self.mean_accepted:.1f} per verified draft, {self.verify_steps} verify steps")


class StepTimings:
    """Seconds per step of plain and verify steps, by (live rows, width; 0 = plain), as moving
    averages, and which verify steps are worth running. A step's cost depends on its shape, not
    on its drafts, so it is measured apart from what the drafts keep (`Speculator` predicts that).
    An `Engine` keeps one across its `generate` calls, so a call starts knowing what steps cost."""

    def __init__(self):
        self._seconds: dict[tuple[int, int], float] = {}
        self._refused: dict[tuple[int, int], int] = {}  # refusals since the width last ran
        self._next_probe: dict[tuple[int, int], int] = {}

    def record(self, batch: int, width: int, seconds: float) -> None:
        key = (batch, width)
        old = self._seconds.get(key)
        self._seconds[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def seconds(self, batch: int, width: int) -> float | None:
        """The moving average of a step's seconds (None: not timed)."""
        return self._seconds.get((batch, width))

    def allows(self, batch: int, width: int, gain: float) -> bool:
        """Whether a verify step of `width` over `batch` live rows, expected to advance decoding
        `gain` times as far as a plain step, should run now: not before a plain step at that
        batch size has been timed; then once to time it; then where it costs at most `gain`
        plain steps, and otherwise only as a probe that keeps its cost current, after
        `PROBE_AFTER` refusals, then twice as many each time."""
        key = (batch, width)
        plain, mine = self.seconds(batch, 0), self.seconds(batch, width)
        if plain is None:
            return False
        if mine is None or mine <= gain * plain:
            self._refused[key] = 0
            self._next_probe.pop(key, None)  # worth it again: its cost is measured as it runs
            return True
        refused = self._refused.get(key, 0) + 1
        due = self._next_probe.get(key, PROBE_AFTER)
        if refused < due:
            self._refused[key] = refused
            return False
        self._refused[key], self._next_probe[key] = 0, 2 * due
        return True


class Speculator:
    """A loop's drafting: each row's `DraftRow` and draft length, the batch's drafts and verify
    width, and the counts (`stats`). Rows are keyed by the loop (an index or a slot).
    `timings`: the step timings to use and add to (default: new ones)."""

    def __init__(self, spec: Speculation, timings: StepTimings | None = None):
        self.spec = spec
        self.drafter = spec.make_drafter()
        self._rows: dict[Hashable, DraftRow] = {}
        self._length: dict[Hashable, int] = {}
        self.timings = StepTimings() if timings is None else timings
        self.stats = SpeculationStats()
        self.acceptance = 1.0  # moving average of the share of drafted tokens kept (optimistic at first)

    def add(self, key: Hashable, prompt: Sequence[int]) -> None:
        self._rows[key] = self.drafter.row(prompt)
        self._length[key] = max(1, self.spec.max_draft // 2)

    def drop(self, key: Hashable) -> None:
        self._rows.pop(key, None)
        self._length.pop(key, None)

    def emitted(self, key: Hashable, tokens: Sequence[int]) -> None:
        self._rows[key].extend(tokens)

    def drafts(self, limits: dict[Hashable, int]) -> dict[Hashable, list[int]]:
        """Each keyed row's draft: at most its limit (what the loop allows: tokens it may still
        emit without a forced or constrained one, minus one) and its adaptive length."""
        return self.trim(self.proposals([k for k, limit in limits.items() if limit > 0]), limits)

    def proposals(self, keys: Sequence[Hashable]) -> dict[Hashable, list[int]]:
        """Each keyed row's draft at its adaptive length, before the loop's limits (`trim`): a
        loop that proposes before it knows the limits (to learn whether any row drafts at all)
        trims these afterwards instead of asking the drafter twice."""
        keys = [k for k in keys if k in self._rows]
        wanted = [self._length[k] for k in keys]
        proposed = self.drafter.propose([self._rows[k] for k in keys], wanted)
        return {k: list(d[:w]) for k, d, w in zip(keys, proposed, wanted) if d}

    @staticmethod
    def trim(proposals: dict[Hashable, list[int]], limits: dict[Hashable, int]) -> dict[Hashable, list[int]]:
        """The proposals cut to each row's limit (rows without a positive limit draft nothing)."""
        return {k: d[:limits[k]] for k, d in proposals.items() if limits.get(k, 0) > 0}

    def widths(self) -> list[int]:
        """Every width `width` picks (the verify programs a loop may compile)."""
        out, n = [], 1
        while True:
            out.append(1 + min(n, self.spec.max_draft))
            if n >= self.spec.max_draft:
                return out
            n *= 2

    def width(self, drafts: dict[Hashable, list[int]], batch: int = 0,
              left: dict[Hashable, int] | None = None) -> int:
        """Tokens a verify step feeds per row for these drafts (0: a plain step): none without
        a draft, nor (`timed`) where plain steps over `batch` live rows would do better, by
        the verify step's measured cost against how far it is expected to advance decoding (a
        row emits one token plus its draft's length times the recent share of drafts kept):
        the batch's tokens (a loop whose finished rows make room for others), or, given the
        tokens each live row has `left` (a static batch, done when its slowest row is), the
        least any row within one draft of the most tokens left advances (`StepTimings.allows`)."""
        width = self.verify_width(drafts)
        if not width or not self.spec.timed:
            return width
        if left:
            most = max(left.values())
            gain = min(1 + self.acceptance * len(drafts.get(k, ()))
                       for k, n in left.items() if n >= most - self.spec.max_draft)
        else:
            gain = (batch + self.acceptance * sum(len(d) for d in drafts.values())) / max(batch, 1)
        return width if self.timings.allows(batch, width, gain) else 0

    def verify_width(self, drafts: dict[Hashable, list[int]]) -> int:
        """The smallest width that holds these drafts, whatever the timings say (0: none)."""
        longest = max((len(d) for d in drafts.values()), default=0)
        if longest == 0:
            return 0
        return 1 + min(1 << (longest - 1).bit_length(), self.spec.max_draft)

    def timed(self, batch: int, width: int, seconds: float) -> None:
        """A step of `width` (0: plain) over `batch` live rows took `seconds` (compiling
        nothing), the host work on its tokens included where nothing hid it."""
        self.timings.record(batch, width, seconds)

    def verified(self, drafts: dict[Hashable, list[int]], kept: dict[Hashable, int]) -> None:
        """Adapt each drafting row's length to the drafts it kept of a verify step."""
        self.stats.verify_steps += 1
        drafted = sum(len(d) for d in drafts.values())
        if drafted:
            share = sum(kept[k] for k in drafts) / drafted
            self.acceptance = (1 - EMA) * self.acceptance + EMA * share
        for key, draft in drafts.items():
            n = kept[key]
            self.stats.drafted += len(draft)
            self.stats.accepted += n
            self.stats.verified_rows += 1
            length = self._length.get(key)
            if length is None:
                continue
            if n < len(draft):
                self._length[key] = max(1, n + 1)
            elif n == length:  # every draft kept at full length (a shorter one leaves it)
                self._length[key] = min(2 * length, self.spec.max_draft)
