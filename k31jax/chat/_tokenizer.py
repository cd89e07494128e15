"""Segment-wise tokenizers: the shared base, the tiktoken ``KimiTokenizer`` and ``StreamDecoder``.

Anti-injection (chat_format.md §1.3): only **control** segments may produce special ids.
``encode(text)`` treats ``<|open|>`` and friends as ordinary text unless the caller asks
otherwise with ``allow_special=True``; the renderer's output goes through
``encode_segments``, which BPEs every segment on its own.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

from k31jax.chat import _specials as sp

# Robustness cuts of the release tokenizer (chat_format.md §1.1).
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

_RUNS = re.compile(r"\s+|\S+")


class Segment(NamedTuple):
    """One rendered piece of a prompt.

    ``special=True`` marks a control segment (``<|open|>``, ``<|sep|>``, a media block …),
    encoded with every special name allowed. Text segments never produce special ids.
    """

    text: str
    special: bool = False


def segments_to_text(segments: Iterable[Segment | tuple[str, bool]]) -> str:
    """The prompt string of a segment list (segment boundaries are lost)."""
    return "".join(s[0] for s in segments)


def split_for_encoding(
    text: str, max_chars: int = MAX_ENCODE_CHARS, max_run: int = MAX_RUN_CHARS
) -> Iterator[str]:
    """Yield the pieces the release tokenizer BPEs separately.

    Windows of ``max_chars`` characters; inside each, a cut wherever a run of consecutive
    whitespace (``str.isspace``) or non-whitespace would exceed ``max_run`` characters (the
    cut falls after each ``max_run`` characters of the run). Pre-tokens never span a cut.
    """
    for w in range(0, len(text), max_chars):
        window = text[w : w + max_chars]
        if len(window) <= max_run:
            yield window
            continue
        start = 0
        for run in _RUNS.finditer(window):
            a, b = run.span()
            for cut in range(a + max_run, b, max_run):
                yield window[start:cut]
                start = cut
        yield window[start:]


class StreamDecoder:
    """Incremental detokenizer that only ever emits complete UTF-8 characters.

    Bytes of a character split across tokens are held until the character is complete.
    Invalid bytes become U+FFFD; ``flush`` ends the stream (an unfinished tail becomes
    U+FFFD). Special tokens decode to their names.

    ``skip``: bytes the reader already has, dropped from the first token when it starts with
    them (token healing: the prompt's backed-off tail, which the first generated token repeats).
    """

    def __init__(self, tokenizer: "TokenizerBase", *, skip: bytes = b""):
        self._token_bytes = tokenizer.token_bytes
        self._special_name = tokenizer.special_name
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip = skip

    def step(self, token_id: int) -> str:
        """Text completed by one more token (possibly empty)."""
        data = self._token_bytes(token_id)
        if self._skip:
            data = data.removeprefix(self._skip)
            self._skip = b""
        return self._decoder.decode(data)

    def step_pieces(self, token_id: int) -> list[Segment]:
        """``step`` that keeps apart what came from a special token: an ordinary token gives
        ``[Segment(text, False)]``; a special one gives ``[Segment(name, True)]``, after the
        U+FFFD of any unfinished character it cut off. Empty text gives no segment. Output
        parsers take markup only from the special segments (chat_format.md §1.3)."""
        name = self._special_name(token_id)
        if name is None:
            text = self.step(token_id)
            return [Segment(text, False)] if text else []
        self._skip = b""
        cut = self.flush()  # a special id never completes a character
        return ([Segment(cut, False)] if cut else []) + [Segment(name, True)]

    def feed(self, token_ids: Iterable[int]) -> str:
        return "".join(self.step(t) for t in token_ids)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)

    @property
    def pending_bytes(self) -> bytes:
        """Bytes of an unfinished character (empty when the text so far is complete)."""
        return self._decoder.getstate()[0]


class TokenizerBase:
    """Shared interface of ``KimiTokenizer`` and ``ByteTokenizer``.

    Subclasses provide ``_encode_ordinary(text)`` (no specials, no cuts) and
    ``token_bytes(id)``.
    """

    def __init__(self, special_tokens: Mapping[str, int], vocab_size: int):
        self._special_to_id = dict(special_tokens)
        self._id_to_special = {i: n for n, i in self._special_to_id.items()}
        self.vocab_size = vocab_size
        names = sorted(self._special_to_id, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(n) for n in names))

    # ---- special tokens ---------------------------------------------------------------
    @property
    def special_tokens(self) -> dict[str, int]:
        """``name -> id`` for every special slot (named and reserved)."""
        return dict(self._special_to_id)

    def special_id(self, name: str) -> int:
        try:
            return self._special_to_id[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a special token of this tokenizer") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._id_to_special

    def special_name(self, token_id: int) -> str | None:
        """The name of a special id, ``None`` for an ordinary one."""
        return self._id_to_special.get(token_id)

    def _first_present(self, names: Sequence[str]) -> int | None:
        for n in names:
            if n in self._special_to_id:
                return self._special_to_id[n]
        return None

    @property
    def bos_id(self) -> int | None:
        return self._first_present([sp.BOS_NAME])

    @property
    def eos_id(self) -> int | None:
        """``[EOS]`` (163585 for K3): the tokenizer's eos."""
        return self._first_present([sp.EOS_NAME])

    @property
    def end_of_msg_id(self) -> int | None:
        """``<|end_of_msg|>`` (K3) or ``<|im_end|>`` (K2): the config ``eos_token_id``."""
        return self._first_present(sp.END_OF_MESSAGE_NAMES)

    @property
    def pad_id(self) -> int | None:
        return self._first_present([sp.PAD_NAME])

    @property
    def stop_ids(self) -> frozenset[int]:
        """Stop on both ``[EOS]`` and the end-of-message id (chat_format.md §1.2)."""
        return frozenset(i for i in (self.eos_id, self.end_of_msg_id) if i is not None)

    # ---- encoding -----------------------------------------------------------------------
    def _encode_ordinary(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_ordinary(self, text: str) -> list[int]:
        """BPE ``text`` with every special name treated as plain text (robustness cuts applied)."""
        out: list[int] = []
        for piece in split_for_encoding(text):
            out.extend(self._encode_ordinary(piece))
        return out

    def encode_control(self, text: str) -> list[int]:
        """Encode with every special name allowed: names become their ids, the rest is BPE."""
        out: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                out.extend(self.encode_ordinary(text[pos : m.start()]))
            out.append(self._special_to_id[m.group()])
            pos = m.end()
        if pos < len(text):
            out.extend(self.encode_ordinary(text[pos:]))
        return out

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Encode one string. Specials are **disallowed** (plain text) unless ``allow_special``.

        This differs from the HF wrapper's default on purpose: user text must never become
        control tokens. Prompts should be built with ``encode_segments``.
        """
        return self.encode_control(text) if allow_special else self.encode_ordinary(text)

    def encode_segments(self, segments: Iterable[Segment | tuple[str, bool]]) -> list[int]:
        """Encode a rendered prompt: each segment on its own, control segments with specials."""
        out: list[int] = []
        for text, special in segments:
            if text:
                out.extend(self.encode_control(text) if special else self.encode_ordinary(text))
        return out

    # ---- decoding -----------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        raise NotImplementedError

    def decode_bytes(self, token_ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes(int(t)) for t in token_ids)

    def decode(self, token_ids: Iterable[int]) -> str:
        """Decode with special names kept and no spaces between them; bad UTF-8 → U+FFFD."""
        return self.decode_bytes(token_ids).decode("utf-8", errors="replace")

    def decode_segments(self, token_ids: Iterable[int]) -> list[Segment]:
        """Decode into segments that say which text came from special ids: each special id is
        its own ``Segment(name, True)``, the ordinary text between them one ``Segment(text,
        False)``. Text that merely spells a special name stays ordinary. Feed the result to
        ``parse_k3_segments`` / ``parse_k2_segments``."""
        out: list[Segment] = []
        run: list[int] = []  # ordinary ids since the last special one, decoded in one go

        def end_run() -> None:
            if run:
                out.append(Segment(self.decode(run), False))  # a cut character becomes U+FFFD
                run.clear()

        for t in token_ids:
            name = self._id_to_special.get(int(t))
            if name is None:
                run.append(int(t))
            else:
                end_run()
                out.append(Segment(name, True))
        end_run()
        return [s for s in out if s.text]

    def stream_decoder(self, *, skip: bytes = b"") -> StreamDecoder:
        """An incremental decoder; `skip` as in `StreamDecoder`."""
        return StreamDecoder(self, skip=skip)


def load_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a ``tiktoken.model`` file: one ``base64(token) rank`` pair per line.

    Ranks must be exactly ``0 .. n-1``; errors name the offending line or rank.
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected 'base64 rank', got {line[:80]!r}")
            try:
                token = base64.b64decode(parts[0], validate=True)
                rank = int(parts[1])
            except (binascii.Error, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            if token in ranks:
                raise ValueError(f"{path}:{lineno}: token {token!r} repeated (ranks {ranks[token]}, {rank})")
            ranks[token] = rank
    seen = sorted(ranks.values())
    if seen != list(range(len(seen))):
        missing = sorted(set(range(len(seen))) - set(seen))[:10]
        raise ValueError(f"{path}: ranks are not 0..{len(seen) - 1}; first missing: {missing}")
    return ranks


class KimiTokenizer(TokenizerBase):
    """The Kimi tiktoken BPE (163,584 ranks + 256 special slots for K3)."""

    def __init__(
        self,
        mergeable_ranks: Mapping[bytes, int],
        special_tokens: Mapping[int, str] | None = None,
        *,
        num_reserved_special_tokens: int = sp.NUM_RESERVED_SPECIAL_TOKENS,
        name: str = "kimi",
    ):
        """``special_tokens`` maps the **offset** in the special window to a name
        (default ``K3_SPECIAL_TOKENS``); unnamed slots are ``<|reserved_token_{id}|>``."""
        import tiktoken  # imported lazily: the chat package must import without it

        num_base = len(mergeable_ranks)
        names = sp.K3_SPECIAL_TOKENS if special_tokens is None else special_tokens
        table = sp.build_special_table(num_base, num_reserved_special_tokens, names)
        super().__init__(table, num_base + num_reserved_special_tokens)
        self.num_base_tokens = num_base
        self._enc = tiktoken.Encoding(
            name=name,
            pat_str=sp.PRETOKENIZE_PATTERN,
            mergeable_ranks=dict(mergeable_ranks),
            special_tokens=table,
        )

    @classmethod
    def from_dir(
        cls, path: str | os.PathLike, *, special_tokens: Mapping[int, str] | None = None
    ) -> "KimiTokenizer":
        """Load ``tiktoken.model`` (+ names from ``tokenizer_config.json`` if present).

        Names come from an explicit ``special_tokens`` (offsets in the special window), else
        from the config's ``added_tokens_decoder`` (absolute ids), else the K3 table. Config
        ids outside the special window are an error.
        """
        ranks = load_tiktoken_ranks(os.path.join(path, "tiktoken.model"))
        num_base = len(ranks)
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path) and special_tokens is None:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            added = cfg.get("added_tokens_decoder") or {}
            if added:
                offsets = {int(k) - num_base: v["content"] for k, v in added.items()}
                bad = sorted(o + num_base for o in offsets if not 0 <= o < sp.NUM_RESERVED_SPECIAL_TOKENS)
                if bad:
                    raise ValueError(
                        f"{cfg_path}: added_tokens_decoder ids {bad} are outside the special "
                        f"window {num_base}..{num_base + sp.NUM_RESERVED_SPECIAL_TOKENS - 1}"
                    )
                special_tokens = offsets
        return cls(ranks, special_tokens)

    def _encode_ordinary(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")
        return self._enc.decode_single_token_bytes(token_id)

    def decode_bytes(self, token_ids: Iterable[int]) -> bytes:
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:10]} outside the vocabulary [0, {self.vocab_size})")
        return self._enc.decode_bytes(ids)
