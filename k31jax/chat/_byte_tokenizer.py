"""Byte-level tokenizer for the tiny test models (vocab 384 = 256 bytes + 128 specials)."""

from __future__ import annotations

from collections.abc import Mapping

from k31jax.chat import _specials as sp
from k31jax.chat._tokenizer import TokenizerBase


def _utf8(text: str) -> bytes:
    """UTF-8 of `text`; lone surrogates (legal in JSON strings, not encodable) become U+FFFD
    exactly as tiktoken's `encode_ordinary` does for `KimiTokenizer`: a round trip through
    UTF-16 with surrogatepass / replace, which also joins a split surrogate pair into its
    character."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")


class ByteTokenizer(TokenizerBase):
    """Ids 0..255 are the bytes; ids 256.. are special tokens with the real Kimi names.

    The named specials of ``special_tokens`` (offset → name, default ``K3_SPECIAL_TOKENS``)
    are packed densely from id 256 **in the order of their real ids** (K3: ``[BOS]`` 256,
    ``[EOS]`` 257, ``<|end_of_msg|>`` 258, ``<|open|>`` 259, ``<|close|>`` 260, ``<|sep|>``
    261, …, ``[UNK]`` 270, ``[PAD]`` 271). Remaining slots up to ``vocab_size`` are
    ``<|reserved_token_{id}|>``. Same interface as ``KimiTokenizer``.
    """

    num_base_tokens = 256

    def __init__(self, vocab_size: int = 384, special_tokens: Mapping[int, str] | None = None):
        names = sp.K3_SPECIAL_TOKENS if special_tokens is None else special_tokens
        ordered = [names[o] for o in sorted(names)]
        num_slots = vocab_size - 256
        if num_slots < len(ordered):
            raise ValueError(
                f"vocab_size {vocab_size} leaves {max(num_slots, 0)} special slots; "
                f"{len(ordered)} named specials need vocab_size >= {256 + len(ordered)}"
            )
        table = sp.build_special_table(256, num_slots, dict(enumerate(ordered)))
        super().__init__(table, vocab_size)
        self._bytes = [bytes([i]) for i in range(256)]

    def _encode_ordinary(self, text: str) -> list[int]:
        return list(_utf8(text))

    def encode_ordinary(self, text: str) -> list[int]:
        return list(_utf8(text))  # cuts cannot change a byte-level encoding

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < 256:
            return self._bytes[token_id]
        name = self._id_to_special.get(token_id)
        if name is None:
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")
        return name.encode("utf-8")
