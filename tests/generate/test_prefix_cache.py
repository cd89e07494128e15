"""The prefix cache's radix tree (`k31jax.generate.PrefixCache`) against a brute-force reference
that keeps every stored sequence whole: the same snapshot found for every prompt, the same
shared lengths, the same least-recently-used order under a byte bound, and each shared prefix's
rows stored and counted once."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from k31jax.generate import PrefixCache
from k31jax.generate._prefix import image_prefix_key
from k31jax.generate._slots import Snapshot

LAYERS, WIDTH = 2, 3
ROW_BYTES = LAYERS * WIDTH * 4  # one token's float32 MLA rows ("mla_ckv")
STATE_BYTES = LAYERS * 5 * 4


def rows_of(seq: tuple) -> np.ndarray:
    """MLA rows that depend only on each token's prefix, as a model's do: any copy of a prefix's
    rows holds the same values, so the tree may keep whichever it stored first."""
    out = np.zeros((LAYERS, len(seq), WIDTH), np.float32)
    h = 0
    for i, t in enumerate(seq):
        h = (h * 1_000_003 + hash(t) + 7) % 65_521
        out[:, i] = h + np.arange(LAYERS)[:, None] * 0.25 + np.arange(WIDTH)[None] * 0.5
    return out


def snapshot(seq: tuple, rng) -> Snapshot:
    return Snapshot(seq, {"kda_state": rng.standard_normal((LAYERS, 5)).astype(np.float32),
                          "mla_ckv": rows_of(seq)})


class Reference:
    """Every stored sequence whole, in an ordered dict (least recently used first); bytes count
    each distinct prefix of the stored sequences once."""

    def __init__(self, max_bytes):
        self.max_bytes, self.stored = max_bytes, collections.OrderedDict()

    @property
    def bytes(self):
        prefixes = {s[:i] for s in self.stored for i in range(1, len(s) + 1)}
        return len(prefixes) * (ROW_BYTES + 8) + STATE_BYTES * len(self.stored)

    def put(self, snap):
        if snap.nbytes > self.max_bytes:
            return False
        self.stored.pop(snap.tokens, None)
        self.stored[snap.tokens] = snap
        while self.bytes > self.max_bytes:
            self.stored.popitem(last=False)
        return True

    def longest_prefix(self, prompt):
        found = max((s for s in self.stored if len(s) < len(prompt) and prompt[:len(s)] == s), key=len, default=None)
        if found is not None:
            self.stored.move_to_end(found)
            return self.stored[found]
        return None

    def shared_length(self, prompt):
        def common(a, b):
            return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return max((common(s, prompt) for s in self.stored), default=0)


@pytest.mark.parametrize("seed,max_bytes", [(0, 1 << 20), (1, 5_000), (2, 12_000)])
def test_radix_tree_matches_the_whole_sequence_reference(seed, max_bytes):
    rng = np.random.default_rng(seed)
    cache, ref = PrefixCache(max_bytes), Reference(max_bytes)
    heads = [tuple(rng.integers(0, 4, rng.integers(1, 30)).tolist()) for _ in range(6)]

    def sequence():
        head = heads[rng.integers(len(heads))]
        cut = int(rng.integers(0, len(head) + 1))  # leave the head anywhere: edges split at every point
        return head[:cut] + tuple(rng.integers(0, 4, rng.integers(0, 25)).tolist())

    hits, recent = 0, [()]
    for _ in range(400):
        seq = sequence()
        op = rng.integers(3)
        if op and rng.random() < 0.5:  # a later turn of a recent conversation
            seq = recent[-int(rng.integers(1, len(recent) + 1))] + seq
        if op == 0 and seq:
            snap = snapshot(seq, rng)
            assert cache.put(snap) == ref.put(snap)
            recent = recent[-4:] + [seq]
        elif op == 1 and seq:
            got, want = cache.longest_prefix(seq), ref.longest_prefix(seq)
            assert (got is None) == (want is None), seq
            if want is not None:
                hits += 1
                assert got.tokens == want.tokens
                assert got.arrays.keys() == want.arrays.keys()
                for name in want.arrays:
                    np.testing.assert_array_equal(got.arrays[name], want.arrays[name])
        else:
            assert cache.shared_length(seq) == ref.shared_length(seq)
        assert cache.sequences() == list(ref.stored)
        assert cache.bytes == ref.bytes <= max_bytes
        assert len(cache) == len(ref.stored)
    assert cache.hits == hits > 20  # the walk found stored prefixes, not only misses
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0 and cache.longest_prefix(seq + (1,)) is None


def test_a_shared_prefix_is_stored_once():
    """32 clients' prompts behind one 1,000-token system prompt: the tree holds the prompt's rows
    once, where 32 whole snapshots would hold them 32 times; a lookup still returns every row."""
    rng = np.random.default_rng(3)
    system = tuple(rng.integers(0, 1000, 1000).tolist())
    cache = PrefixCache(1 << 30)
    prompts = [system + tuple(rng.integers(0, 1000, 50).tolist()) for _ in range(32)]
    for p in prompts:
        assert cache.put(snapshot(p, rng))
    whole = sum(snapshot(p, rng).nbytes for p in prompts)
    assert cache.held_tokens == 1000 + 32 * 50
    assert cache.bytes == cache.held_tokens * (ROW_BYTES + 8) + 32 * STATE_BYTES < whole / 10
    found = cache.longest_prefix(prompts[7] + (5,))
    assert found.tokens == prompts[7]
    np.testing.assert_array_equal(found.arrays["mla_ckv"], rows_of(prompts[7]))
    assert cache.shared_length(system + (1001,)) == 1000 and cache.longest_prefix(system + (1001,)) is None


def test_evicting_a_branch_keeps_its_siblings_rows():
    """A branch evicted from under a shared head takes only its own rows; the head's rows stay
    for the sibling, whose edge is merged back into one."""
    rng = np.random.default_rng(4)
    a, b = (1, 2, 3, 4, 5), (1, 2, 3, 9)
    one = snapshot(a, rng).nbytes
    cache = PrefixCache(one + 2 * (ROW_BYTES + 8) + STATE_BYTES)  # a and b fit together (3 shared)
    cache.put(snapshot(a, rng))
    cache.put(snapshot(b, rng))
    assert cache.sequences() == [a, b]
    cache.longest_prefix(a + (0,))  # a becomes the most recent
    cache.put(snapshot((7, 7), rng))  # over the bound: b goes
    assert cache.sequences() == [a, (7, 7)]
    np.testing.assert_array_equal(cache.longest_prefix(a + (0,)).arrays["mla_ckv"], rows_of(a))
    assert cache.shared_length((1, 2, 3, 9)) == 3


def test_bounds_and_empty():
    rng = np.random.default_rng(5)
    with pytest.raises(ValueError, match="max_bytes=-1"):
        PrefixCache(-1)
    small = PrefixCache(10)
    assert not small.put(snapshot((1, 2, 3), rng)) and len(small) == 0
    off = PrefixCache(0)
    assert not off.put(snapshot((1,), rng)) and off.longest_prefix((1, 2)) is None and off.shared_length((1,)) == 0


def test_image_keys_walk_the_tree_like_ids():
    """Image prompts' keys hold (content hash, row) entries among the ids: two images with the
    same ids branch where their hashes differ."""
    rng = np.random.default_rng(6)
    ids = [5, 9, 9, 9, 7]
    key_a = image_prefix_key(ids, 9, [("a", 1), ("b", 2)])
    key_c = image_prefix_key(ids, 9, [("a", 1), ("c", 2)])
    cache = PrefixCache(1 << 20)
    cache.put(snapshot(key_a, rng))
    assert cache.shared_length(key_c) == 2 and cache.longest_prefix(key_c + (1,)) is None
    assert cache.longest_prefix(key_a + (1,)).tokens == key_a
