"""Special-token tables and the pre-tokenizer pattern (chat_format.md §1).

Special ids live in a window of ``NUM_RESERVED_SPECIAL_TOKENS`` slots right after the BPE
ranks (163584..163839 for the real 163,584-rank vocabulary). The tables below are keyed by
the **offset** inside that window, so the same table serves the real tokenizer (offset 0 =
id 163584) and small test vocabularies. Slots without a name are called
``<|reserved_token_{id}|>`` with the absolute id, as in the release ``tokenization_kimi.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import regex

NUM_RESERVED_SPECIAL_TOKENS = 256
K3_NUM_BASE_TOKENS = 163_584
K3_VOCAB_SIZE = K3_NUM_BASE_TOKENS + NUM_RESERVED_SPECIAL_TOKENS  # 163,840

# K3 names by offset from the first special id (chat_format.md §1.2).
K3_SPECIAL_TOKENS: Mapping[int, str] = MappingProxyType({
    0: "[BOS]",  # 163584
    1: "[EOS]",  # 163585
    2: "<|end_of_msg|>",  # 163586
    3: "<|open|>",  # 163587
    4: "<|close|>",  # 163588
    5: "<|sep|>",  # 163589
    6: "[start_header_id]",  # 163590
    7: "[end_header_id]",  # 163591
    9: "[EOT]",  # 163593
    18: "<|media_begin|>",  # 163602
    19: "<|media_content|>",  # 163603
    20: "<|media_end|>",  # 163604
    21: "<|media_pad|>",  # 163605
    65: "<osagent_mode>",  # 163649
    254: "[UNK]",  # 163838
    255: "[PAD]",  # 163839
})

# K2 / K2.5 / Kimi Linear names (chat_format.md §5). [BOS]/[EOS], the media block and
# [UNK]/[PAD] are assumed to sit where K3 has them; a checkpoint's tokenizer_config.json
# overrides this table when present.
K2_SPECIAL_TOKENS: Mapping[int, str] = MappingProxyType({
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",  # 163586
    3: "<|im_user|>",  # 163587
    4: "<|im_assistant|>",  # 163588
    10: "<|im_system|>",  # 163594
    11: "<|tool_calls_section_begin|>",  # 163595
    12: "<|tool_calls_section_end|>",  # 163596
    13: "<|tool_call_begin|>",  # 163597
    14: "<|tool_call_argument_begin|>",  # 163598
    15: "<|tool_call_end|>",  # 163599
    17: "<|im_middle|>",  # 163601
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<think>",  # 163606
    23: "</think>",  # 163607
    254: "[UNK]",
    255: "[PAD]",
})

# Names the engine stops on (chat_format.md §1.2: stop on both [EOS] and the end-of-message).
EOS_NAME = "[EOS]"
END_OF_MESSAGE_NAMES = ("<|end_of_msg|>", "<|im_end|>")
BOS_NAME = "[BOS]"
PAD_NAME = "[PAD]"

# Pre-tokenizer regex (chat_format.md §1.1). Needs class intersection (`&&`): tiktoken's
# Rust regex supports it, and so does the `regex` module with the V1 flag.
PRETOKENIZE_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def reserved_name(token_id: int) -> str:
    """Name of an unnamed special slot (absolute id, as in ``tokenization_kimi.py``)."""
    return f"<|reserved_token_{token_id}|>"


def build_special_table(
    first_id: int, num_slots: int, names_by_offset: Mapping[int, str]
) -> dict[str, int]:
    """``name -> id`` for the window ``first_id .. first_id + num_slots - 1``.

    Raises ``ValueError`` naming the offending entries if an offset is outside the window or
    a name repeats.
    """
    bad = sorted(o for o in names_by_offset if not 0 <= o < num_slots)
    if bad:
        raise ValueError(
            f"special-token offsets {bad} fall outside the {num_slots}-slot window "
            f"starting at id {first_id}"
        )
    table: dict[str, int] = {}
    for offset in range(num_slots):
        token_id = first_id + offset
        name = names_by_offset.get(offset, reserved_name(token_id))
        if name in table:
            raise ValueError(f"special-token name {name!r} used for ids {table[name]} and {token_id}")
        table[name] = token_id
    return table


_PRETOKENIZER = regex.compile(PRETOKENIZE_PATTERN, regex.V1)


def pretokenize(text: str) -> list[str]:
    """Split ``text`` into pre-tokens with the Kimi regex (the ``regex`` module, V1 flag)."""
    return _PRETOKENIZER.findall(text)
