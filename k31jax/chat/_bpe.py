"""Train a small byte-level BPE in the release tokenizer's format (``tiktoken.model``).

The result loads with ``KimiTokenizer.from_dir``: the K3 pre-tokenizer regex, the 256 special
slots after the ranks. Written here rather than taken from HF ``tokenizers`` (not a
dependency) because tiktoken merges by the rank of the *concatenated* bytes, and this trainer
splits text with tiktoken's own pattern (``_specials.pretokenize``) and keeps one rank per
byte string, so the ranks it writes are exactly the vocabulary tiktoken will apply.
"""

from __future__ import annotations

import base64
import heapq
import os
from collections import Counter
from collections.abc import Iterable, Mapping

from k31jax.chat._byte_tokenizer import _utf8
from k31jax.chat._specials import pretokenize


def train_bpe(texts: Iterable[str], num_ranks: int) -> dict[bytes, int]:
    """Ranks ``0..num_ranks-1``: the 256 bytes (rank = byte value), then merges in order.

    Each step merges the most frequent adjacent pair of tokens inside the pre-tokens of
    ``texts`` (ties: the pair of lowest ranks), counted with each pre-token's frequency.
    Stops early when no pair occurs twice. Deterministic for the same texts.
    """
    if num_ranks < 256:
        raise ValueError(f"num_ranks {num_ranks} < 256: a byte-level BPE needs every byte as a rank")
    freq: Counter[bytes] = Counter()
    for text in texts:
        freq.update(_utf8(p) for p in pretokenize(text))  # lone surrogates as tiktoken encodes them
    words = [list(w) for w in freq]
    counts = list(freq.values())
    vocab = [bytes([b]) for b in range(256)]
    rank_of = {t: i for i, t in enumerate(vocab)}

    pair_count: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for i, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pair_count[pair] += counts[i]
            where.setdefault(pair, set()).add(i)
    heap = [(-c, pair) for pair, c in pair_count.items()]
    heapq.heapify(heap)

    while len(vocab) < num_ranks and heap:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg:
            continue  # stale entry: the count changed after it was pushed
        if -neg < 2:
            break
        merged = vocab[pair[0]] + vocab[pair[1]]
        new = rank_of.get(merged)
        if new is None:  # another pair may already spell these bytes: one rank per byte string
            new = rank_of[merged] = len(vocab)
            vocab.append(merged)
        changed: Counter[tuple[int, int]] = Counter()
        for i in where.pop(pair):
            old = words[i]
            out, j = [], 0
            while j < len(old):
                if j + 1 < len(old) and (old[j], old[j + 1]) == pair:
                    out.append(new)
                    j += 2
                else:
                    out.append(old[j])
                    j += 1
            for p in zip(old, old[1:]):
                changed[p] -= counts[i]
            for p in zip(out, out[1:]):
                changed[p] += counts[i]
                where.setdefault(p, set()).add(i)
            words[i] = out
        del pair_count[pair]
        changed.pop(pair, None)
        for p, delta in changed.items():
            if delta:
                c = pair_count[p] = pair_count[p] + delta
                if c > 0:
                    heapq.heappush(heap, (-c, p))
                else:
                    del pair_count[p]
    return rank_of


def write_tiktoken_model(ranks: Mapping[bytes, int], path: str | os.PathLike) -> None:
    """``base64(token) rank`` lines in rank order, written to a temporary name then renamed."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")
    os.replace(tmp, path)
