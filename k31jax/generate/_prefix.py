"""Session prefix reuse: an LRU of cache snapshots keyed by the token sequence they hold.

K3.1 is hybrid, so a prefix cannot be cut out of a longer cached sequence: the KDA recurrent
and convolution states exist only at the points where a snapshot was taken. The scheduler
stores one at each prompt end (the whole history of a turn) and one at each turn end (history
plus the generated reply). The next turn of a conversation extends one of them, and resumes
from the **longest** stored sequence that is a proper prefix of its prompt. Memory is bounded
in bytes; the least recently used snapshots go first.

Lookup hashes the prompt's prefixes of each stored length only (few distinct lengths), then
confirms the match token by token, so a hash collision can never resume the wrong state.

Branch points: ``shared_length(prompt)`` is the longest prefix a prompt shares with any stored
sequence. Where a new prompt leaves a stored one (many clients with one system prompt and tool
list, different questions), the scheduler stores the state there too, while it prefills: the
next prompt that shares that prefix resumes from it. A recurrent state cannot be cut out of a
longer sequence afterwards, so the branch point is stored by the second prompt that reaches it,
or by the first when the scheduler sees the others waiting behind it.

Image prompts: the same token ids hold different states for different images, so a sequence
is stored under `image_prefix_key` (each `<|media_pad|>` id replaced by its image's content
hash and row); prompts without images are keyed by their ids as they are.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import numpy as np

from ._slots import Snapshot


def image_prefix_key(prompt: Sequence[int], pad_id: int | None, images: Sequence[tuple[str, int]]) -> tuple:
    """The sequence a prompt's snapshots are stored under: its ids, with the k-th pad id of an
    image prompt replaced by `(content hash, row)` of the image row it holds. `images`: each
    image's (content hash, token count), in prompt order; empty: the ids as they are."""
    if not images:
        return tuple(prompt)
    rows = iter([(digest, j) for digest, count in images for j in range(count)])
    return tuple(next(rows, t) if t == pad_id else t for t in prompt)


class PrefixCache:
    """``put(snapshot)`` / ``longest_prefix(prompt)``; ``max_bytes=0`` disables it."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} (must be >= 0)")
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[tuple[int, int], Snapshot] = collections.OrderedDict()
        self._lengths: collections.Counter[int] = collections.Counter()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(tokens: Sequence[int]) -> tuple[int, int]:
        return len(tokens), hash(tuple(tokens))

    def put(self, snap: Snapshot) -> bool:
        """Store ``snap`` (replacing one of the same tokens); False if it alone exceeds the bound."""
        size = snap.nbytes
        if size > self.max_bytes or not snap.tokens:
            return False
        key = self._key(snap.tokens)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._drop(key, old)
            self._entries[key] = snap
            self._lengths[len(snap.tokens)] += 1
            self.bytes += size
            while self.bytes > self.max_bytes:
                k, s = self._entries.popitem(last=False)
                self._drop(k, s)
        return True

    def _drop(self, key, snap: Snapshot) -> None:
        self.bytes -= snap.nbytes
        self._lengths[key[0]] -= 1
        if not self._lengths[key[0]]:
            del self._lengths[key[0]]

    def longest_prefix(self, prompt: Sequence[int]) -> Snapshot | None:
        """The stored snapshot of the longest proper prefix of ``prompt`` (at least one prompt
        token must remain to be prefilled), marked most recently used; counts a hit or miss."""
        prompt = tuple(prompt)
        with self._lock:
            for n in sorted((n for n in self._lengths if n < len(prompt)), reverse=True):
                snap = self._entries.get(self._key(prompt[:n]))
                if snap is not None and snap.tokens == prompt[:n]:
                    self._entries.move_to_end(self._key(prompt[:n]))
                    self.hits += 1
                    self.hit_tokens += n
                    return snap
            self.misses += 1
            return None

    def clear(self) -> None:
        """Drop every snapshot (the counters stay)."""
        with self._lock:
            self._entries.clear()
            self._lengths.clear()
            self.bytes = 0

    def shared_length(self, prompt: Sequence) -> int:
        """The longest prefix `prompt` shares with a stored sequence (0 when none)."""
        with self._lock:
            stored = [s.tokens for s in self._entries.values()]
        return max((common_prefix_length(tokens, prompt) for tokens in stored), default=0)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """How many leading entries two token sequences (or prefix-cache keys) share."""
    n = min(len(a), len(b))
    x, y = _as_array(a[:n]), _as_array(b[:n])
    if x is not None and y is not None:
        differ = np.flatnonzero(x != y)
        return int(differ[0]) if differ.size else n
    return next((i for i, (p, q) in enumerate(zip(a[:n], b[:n])) if p != q), n)  # image keys: (digest, row)


def _as_array(tokens: Sequence) -> np.ndarray | None:
    """Token ids as an int64 array, or None for a key that holds image entries."""
    try:
        return np.asarray(tokens, np.int64)
    except (TypeError, ValueError):
        return None
