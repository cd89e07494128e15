"""Session prefix reuse: an LRU of cache snapshots keyed by the token sequence they hold.

K3.1 is hybrid, so a prefix cannot be cut out of a longer cached sequence: the KDA recurrent
and convolution states exist only at the points where a snapshot was taken. The scheduler
stores one at each prompt end (the whole history of a turn) and one at each turn end (history
plus the generated reply). The next turn of a conversation extends one of them, and resumes
from the **longest** stored sequence that is a proper prefix of its prompt. Memory is bounded
in bytes; the least recently used snapshots go first.

The stored sequences form a radix tree (a trie whose edges hold runs of tokens): a lookup
walks the prompt down it once, O(prompt length) whatever is stored, and compares tokens, never
hashes, so it can never resume the wrong state. A node where a snapshot was taken holds that
sequence's KDA state; the MLA latent, rope-key and indexer-key rows live on the edges, so
sequences that share a prefix (one system prompt and tool list, the turns of one conversation)
store its rows once and count them once against the byte bound. Evicting a snapshot prunes the
rows that no other snapshot needs. (A prefix prefilled twice, in different chunks, may differ
in rounding: the tree keeps the rows stored first, as a resumed prompt does.)

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

from ._slots import MLA_FIELDS, Snapshot


def image_prefix_key(prompt: Sequence[int], pad_id: int | None, images: Sequence[tuple[str, int]]) -> tuple:
    """The sequence a prompt's snapshots are stored under: its ids, with the k-th pad id of an
    image prompt replaced by `(content hash, row)` of the image row it holds. `images`: each
    image's (content hash, token count), in prompt order; empty: the ids as they are."""
    if not images:
        return tuple(prompt)
    rows = iter([(digest, j) for digest, count in images for j in range(count)])
    return tuple(next(rows, t) if t == pad_id else t for t in prompt)


class _Node:
    """A radix-tree node: the sequence up to here is its parent's plus ``edge``. ``rows`` holds the
    MLA rows (latent, rope key, indexer key) of the edge's tokens, shared by every snapshot below;
    ``state`` is the KDA recurrent / conv state after the whole sequence, where one was stored."""

    __slots__ = ("parent", "edge", "rows", "children", "state", "depth")

    def __init__(self, parent: "_Node | None", edge: tuple, rows: dict[str, np.ndarray], depth: int):
        self.parent, self.edge, self.rows, self.depth = parent, edge, rows, depth
        self.children: dict = {}
        self.state: dict[str, np.ndarray] | None = None


def _nbytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


class PrefixCache:
    """``put(snapshot)`` / ``longest_prefix(prompt)`` / ``shared_length(prompt)`` over a radix tree
    of the stored sequences; ``max_bytes=0`` disables it."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} (must be >= 0)")
        self.max_bytes = max_bytes
        self._root = _Node(None, (), {}, 0)
        self._stored: collections.OrderedDict[int, _Node] = collections.OrderedDict()  # LRU, oldest first
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._stored)

    @property
    def held_tokens(self) -> int:
        """Tokens whose MLA rows the tree holds: each shared prefix counted once (the stored
        sequences' lengths summed would count it once per sequence)."""
        with self._lock:
            held, todo = 0, [self._root]
            while todo:
                node = todo.pop()
                held += len(node.edge)
                todo.extend(node.children.values())
            return held

    def sequences(self) -> list[tuple]:
        """The stored sequences, least recently used first."""
        with self._lock:
            return [self._sequence(node) for node in self._stored.values()]

    # ---- the tree -----------------------------------------------------------------------
    def _walk(self, key: tuple) -> tuple[list[_Node], int]:
        """(the nodes whose whole sequence `key` starts with, root first; how many entries of
        `key` the tree holds, the last node's edge possibly matched only in part)."""
        path, node, depth = [self._root], self._root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                break
            k = common_prefix_length(child.edge, key[depth:depth + len(child.edge)])
            if k < len(child.edge):
                return path, depth + k
            node, depth = child, depth + k
            path.append(node)
        return path, depth

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut `child`'s edge after `k` entries: the new node in between, holding the first part."""
        parent = child.parent
        mid = _Node(parent, child.edge[:k], {n: np.ascontiguousarray(a[:, :k]) for n, a in child.rows.items()},
                    parent.depth + k)
        parent.children[child.edge[0]] = mid
        child.parent, child.edge = mid, child.edge[k:]
        child.rows = {n: np.ascontiguousarray(a[:, k:]) for n, a in child.rows.items()}
        mid.children[child.edge[0]] = child
        return mid

    def _insert(self, key: tuple, mla: dict[str, np.ndarray]) -> _Node:
        """The node of sequence `key`, made (splitting an edge, adding a leaf) if missing; a new
        leaf takes its edge's rows from `mla` (the whole sequence's MLA rows)."""
        path, depth = self._walk(key)
        node = path[-1]
        if depth > node.depth:  # the key leaves (or ends) inside the next edge
            node = self._split(node.children[key[node.depth]], depth - node.depth)
        if depth < len(key):
            leaf = _Node(node, key[depth:], {n: np.ascontiguousarray(a[:, depth:]) for n, a in mla.items()},
                         len(key))
            node.children[key[depth]] = leaf
            self.bytes += _nbytes(leaf.rows) + 8 * len(leaf.edge)
            node = leaf
        return node

    def _remove(self, node: _Node) -> None:
        """Drop `node`'s state; prune the branch it leaves without a state below it, and merge a
        stateless node with a single child into that child."""
        self.bytes -= _nbytes(node.state)
        node.state = None
        while node is not self._root and node.state is None and len(node.children) <= 1:
            parent = node.parent
            if not node.children:
                del parent.children[node.edge[0]]
                self.bytes -= _nbytes(node.rows) + 8 * len(node.edge)
            else:
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.rows = {n: np.concatenate([a, child.rows[n]], axis=1) for n, a in node.rows.items()}
                child.parent = parent
                parent.children[child.edge[0]] = child
            node = parent

    def _path(self, node: _Node) -> list[_Node]:
        """The nodes from below the root down to `node`."""
        path = []
        while node is not self._root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _sequence(self, node: _Node) -> tuple:
        return tuple(t for e in self._path(node) for t in e.edge)

    def _snapshot(self, node: _Node) -> Snapshot:
        """`node`'s sequence as a `Snapshot`: its state and the rows of every edge above it."""
        edges = self._path(node)
        arrays = dict(node.state)
        for name in node.rows:
            arrays[name] = np.concatenate([e.rows[name] for e in edges], axis=1)
        return Snapshot(tuple(t for e in edges for t in e.edge), arrays)

    # ---- the cache ----------------------------------------------------------------------
    def put(self, snap: Snapshot) -> bool:
        """Store ``snap`` (replacing the state of one of the same tokens, whose rows it shares);
        False if it alone exceeds the bound."""
        if snap.nbytes > self.max_bytes or not snap.tokens:
            return False
        key = tuple(snap.tokens)
        mla = {n: a for n, a in snap.arrays.items() if n in MLA_FIELDS}
        state = {n: a for n, a in snap.arrays.items() if n not in MLA_FIELDS}
        with self._lock:
            node = self._insert(key, mla)
            if node.state is not None:
                self.bytes -= _nbytes(node.state)
            node.state = state
            self.bytes += _nbytes(state)
            self._stored[id(node)] = node
            self._stored.move_to_end(id(node))
            while self.bytes > self.max_bytes:
                _, oldest = self._stored.popitem(last=False)
                self._remove(oldest)
        return True

    def longest_prefix(self, prompt: Sequence) -> Snapshot | None:
        """The stored snapshot of the longest proper prefix of ``prompt`` (at least one prompt
        token must remain to be prefilled), marked most recently used; counts a hit or miss."""
        key = tuple(prompt)
        with self._lock:
            path, _ = self._walk(key[:-1])
            node = next((n for n in reversed(path) if n.state is not None), None)
            if node is None:
                self.misses += 1
                return None
            self._stored.move_to_end(id(node))
            self.hits += 1
            self.hit_tokens += node.depth
            return self._snapshot(node)

    def shared_length(self, prompt: Sequence) -> int:
        """The longest prefix `prompt` shares with a stored sequence (0 when none)."""
        with self._lock:
            return self._walk(tuple(prompt))[1]

    def clear(self) -> None:
        """Drop every snapshot (the counters stay)."""
        with self._lock:
            self._root = _Node(None, (), {}, 0)
            self._stored.clear()
            self.bytes = 0

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
