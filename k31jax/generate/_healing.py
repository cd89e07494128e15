"""Token healing for raw completion.

A BPE model never saw a text boundary where a prompt happens to end: `def f(n):` ends with
the token `):`, but in training `):` followed by a newline was always the single token `):\n`,
so after `):` the model is off its data and may write anything but a newline. Healing backs
the prompt off by its last token and makes the first generated token start with that token's
bytes (`):` may then become `):\n`); the reader does not see those bytes twice
(`Request.healed_prefix`, `StreamDecoder(skip=...)`).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import numpy as np


def heal_prompt(tokenizer, prompt: Sequence[int]) -> tuple[list[int], bytes]:
    """(the prompt less its last token, that token's bytes) when the last token is ordinary
    text that is whole UTF-8 and something precedes it; else (the prompt, b"")."""
    prompt = list(prompt)
    if len(prompt) < 2 or tokenizer.is_special(prompt[-1]):
        return prompt, b""
    tail = tokenizer.token_bytes(prompt[-1])
    try:
        tail.decode("utf-8")
    except UnicodeDecodeError:  # part of a character: the reader could not see it as text
        return prompt, b""
    return prompt[:-1], tail


@functools.lru_cache(maxsize=4)
def _sorted_vocabulary(tokenizer) -> tuple[list[bytes], np.ndarray]:
    """Every ordinary token's bytes, sorted, with their ids (ids without bytes are skipped:
    reserved slots between the ranks and the specials)."""
    entries = []
    for i in range(tokenizer.vocab_size):
        if tokenizer.is_special(i):
            continue
        try:
            entries.append((tokenizer.token_bytes(i), i))
        except (ValueError, KeyError):
            continue
    entries.sort()
    return [b for b, _ in entries], np.asarray([i for _, i in entries], np.int64)


def tokens_starting_with(tokenizer, prefix: bytes) -> np.ndarray:
    """Ids of the ordinary tokens whose bytes start with `prefix`, ascending."""
    keys, ids = _sorted_vocabulary(tokenizer)
    lo = bisect.bisect_left(keys, prefix)
    hi = lo
    while hi < len(keys) and keys[hi].startswith(prefix):
        hi += 1
    return np.sort(ids[lo:hi])


def first_token_mask(tokenizer, prefixes: Sequence[bytes], vocab_size: int) -> np.ndarray:
    """`[B, V]` bool: which ids each row's first generated token may be (all of them for an
    empty prefix)."""
    mask = np.ones((len(prefixes), vocab_size), bool)
    for row, prefix in enumerate(prefixes):
        if prefix:
            mask[row] = False
            mask[row, tokens_starting_with(tokenizer, prefix)] = True
    return mask
