"""Which characters of a model output are markup: the parsers' internal spelling of special ids.

The output grammars (``_k3_output``, ``_k2``) match markers on one string, but structure must
come only from **special token ids**: a model that writes ``<|open|>`` with ordinary BPE tokens
has written text, not markup (the same anti-injection rule as prompts, chat_format.md §1.3).
So the parsers work on an *internal form* in which each special name of the grammar is one
lone surrogate character (U+D800 + its index in ``names``). Text decoded from UTF-8 never
contains a lone surrogate, so ordinary text can never spell markup there. Special names the
grammar does not use (media, reserved slots) stay as their text: they are content.

Two ways in:
- ``from_segments``: decoded pieces that say which text came from special ids
  (``Segment(name, True)`` from ``StreamDecoder.step_pieces`` / ``decode_segments``). Only
  special pieces become markup. This is the engine's path.
- ``from_trusted`` / ``split_trusted``: a plain string whose special names are all taken as
  markup (a stored transcript, text decoded with specials kept). It trusts the text: ordinary
  tokens that spell a name are indistinguishable there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import regex

from k31jax.chat._tokenizer import Segment

FIRST_MARK = 0xD800
_SURROGATE = regex.compile("[\ud800-\udfff]")
# A regex class of every internal markup character (markers always start with one).
MARK_CLASS = "[\ud800-\udfff]"


class Markup:
    """The special names of one output grammar and their one-character internal spellings."""

    def __init__(self, names: Sequence[str]):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"markup names must be distinct and non-empty: {names!r}")
        self.names = tuple(names)
        self._mark = {n: chr(FIRST_MARK + i) for i, n in enumerate(self.names)}
        self._restore = {ord(c): n for n, c in self._mark.items()}
        self._name_rx = regex.compile("|".join(regex.escape(n) for n in self.names))
        self._prefixes = frozenset(n[:k] for n in self.names for k in range(1, len(n)))
        self._longest_prefix = max(len(n) for n in self.names) - 1

    def __call__(self, name: str) -> str:
        """The regex (one escaped character) of a special name in the internal form."""
        return regex.escape(self._mark[name])

    def restore(self, internal: str) -> str:
        """Back to text: every markup character becomes its special name."""
        return internal.translate(self._restore)

    @staticmethod
    def _check(text: str) -> str:
        m = _SURROGATE.search(text)
        if m is not None:
            raise ValueError(f"output text has a lone surrogate U+{ord(m.group()):04X} at {m.start()}; "
                             "decoded UTF-8 never does (decode with errors='replace')")
        return text

    def from_trusted(self, text: str) -> str:
        """Internal form of a string in which every special name is markup."""
        return self._name_rx.sub(lambda m: self._mark[m.group()], self._check(text))

    def from_segments(self, segments: Iterable[Segment | tuple[str, bool]]) -> str:
        """Internal form of decoded pieces: special pieces are markup (their names converted),
        ordinary text stays text even when it spells a special name."""
        return "".join(self.from_trusted(t) if special else self._check(t) for t, special in segments)

    def split_trusted(self, text: str) -> tuple[str, str]:
        """For streaming trusted text: ``(internal form, held tail)``. The tail is the longest
        suffix after the last complete name that could still grow into a name; it must wait
        for the next piece (or ``end_trusted``)."""
        last = 0
        for m in self._name_rx.finditer(text):
            last = m.end()
        for k in range(min(self._longest_prefix, len(text) - last), 0, -1):
            if text[-k:] in self._prefixes:
                return self.from_trusted(text[:-k]), text[-k:]
        return self.from_trusted(text), ""

    def end_trusted(self, tail: str) -> str:
        """Internal form of a held tail at the end of the text. A cut-off special name
        (``<…``, at least 2 characters: the output was truncated mid-name) is markup and is
        dropped; anything shorter (a lone ``<``) or not starting with ``<`` is text."""
        return "" if len(tail) >= 2 and tail[0] == "<" else self._check(tail)

    def whole_trusted(self, text: str) -> str:
        """Internal form of a complete trusted string (``split_trusted`` + ``end_trusted``)."""
        internal, tail = self.split_trusted(text)
        return internal + self.end_trusted(tail)
