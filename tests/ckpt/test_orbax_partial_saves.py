"""The converter's Orbax partial-save helpers: `drop_interior_keys` (the stand-in for Orbax's
quadratic finalize key filter) against Orbax's own `_filter_conflicting_keys` on random key
sets (tuple keys as Orbax writes them, plain '.'/'/' paths, mixtures); `fast_partial_saves`
(patched only inside, replacements still refused); `flush_new_files` (each save folder
synced and dropped from the page cache once)."""

import random

import pytest

from k31jax.ckpt._orbax_save import drop_interior_keys, fast_partial_saves

# A plain import, not importorskip: if Orbax moves these private functions, the converter's
# patches stop applying (conversions turn quadratic again) and this file must fail loudly.
from orbax.checkpoint.experimental.v1._src.partial import saving  # noqa: E402


def random_keys(rng: random.Random, n: int) -> list[str]:
    parts = ["a", "b", "layers", "kda", "w", "0", "1"]
    keys = set()
    for _ in range(n):
        path = tuple(rng.choice(parts) for _ in range(rng.randint(0, 4)))
        style = rng.random()
        if style < 0.6:
            keys.add(repr(path))
        else:
            keys.add(rng.choice("./").join(path))
    return sorted(keys)


@pytest.mark.parametrize("seed", range(40))
def test_same_result_as_orbax(seed):
    rng = random.Random(seed)
    keys = random_keys(rng, rng.randint(1, 60))
    want = saving._filter_conflicting_keys({k: i for i, k in enumerate(keys)})
    got = drop_interior_keys({k: i for i, k in enumerate(keys)})
    assert got == want


def test_swapped_in_only_inside_the_context():
    from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as handler

    originals = saving._filter_conflicting_keys, handler._get_partial_save_additions
    with fast_partial_saves():
        assert saving._filter_conflicting_keys is drop_interior_keys
        assert handler._get_partial_save_additions is not originals[1]
    assert (saving._filter_conflicting_keys, handler._get_partial_save_additions) == originals


@pytest.mark.parametrize("second", [{"a": {"b": 2}}, {"a": {"b": {"c": 3}}}, {"a": 4}],
                         ids=["same key", "key below a leaf", "key above a leaf"])
def test_partial_save_refuses_replacements(tmp_path, second):
    """Inside `fast_partial_saves` a replacement is refused like Orbax refuses it."""
    import numpy as np
    import orbax.checkpoint.experimental.v1 as ocp1
    from orbax.checkpoint._src.handlers.base_pytree_checkpoint_handler import PartialSaveReplacementError

    second = {k: (np.full(2, v, np.float32) if not isinstance(v, dict) else
                  {kk: (np.full(2, vv, np.float32) if not isinstance(vv, dict) else
                        {kkk: np.full(2, vvv, np.float32) for kkk, vvv in vv.items()}) for kk, vv in v.items()})
              for k, v in second.items()}
    with fast_partial_saves():
        ocp1.partial.save(str(tmp_path / "ck"), {"a": {"b": np.ones(2, np.float32)}})
        with pytest.raises(PartialSaveReplacementError):
            ocp1.partial.save(str(tmp_path / "ck"), second)


def test_linear_at_release_scale():
    """~3,000 leaf keys of a 93-layer tree: well under a second (the pairwise filter takes
    seconds per call here, and finalize calls it once per partial save)."""
    import time

    keys = {repr(("layers", f"layer_{i:03d}", kind, f"w{j}")): 0
            for i in range(93) for kind in ("kda", "moe") for j in range(16)}
    keys[repr(("layers", "layer_000", "kda"))] = 0  # an interior node: dropped
    t = time.perf_counter()
    out = drop_interior_keys(dict(keys))
    assert time.perf_counter() - t < 1.0
    assert len(out) == len(keys) - 1


def test_flush_new_files_walks_each_save_folder_once(tmp_path, monkeypatch):
    """Each call syncs and drops what appeared since the last one: new files near the top,
    and the whole of each new partial-save folder (two levels down) exactly once."""
    import os

    from k31jax.ckpt._orbax_save import flush_new_files

    flushed = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, a, b, advice: (
        flushed.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd, a, b, advice)))

    def write(rel):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 10)

    seen: set[str] = set()
    write("ck.partial_save/_META")
    write("ck.partial_save/pending_1/state/d/a")
    write("ck.partial_save/pending_1/state/b")
    flush_new_files(tmp_path, seen)
    assert sorted(os.path.relpath(f, tmp_path) for f in flushed) == [
        "ck.partial_save/_META", "ck.partial_save/pending_1/state/b", "ck.partial_save/pending_1/state/d/a"]
    flushed.clear()
    write("ck.partial_save/pending_2/state/c")
    write("ck.partial_save/pending_1/state/late")  # an old save folder is not walked again
    flush_new_files(tmp_path, seen)
    assert [os.path.relpath(f, tmp_path) for f in flushed] == ["ck.partial_save/pending_2/state/c"]
