"""`TensorReader.read_many` (the converter's bulk reader: file-order windows, O_DIRECT where the
file system allows it) against plain per-tensor reads, on awkward layouts: tensors larger
than the window, tensors straddling window ends, gaps, several files, random request order,
a file that shrank after its header was read, and a file system that refuses O_DIRECT."""

import os
from pathlib import Path

import numpy as np
import pytest

from k31jax.ckpt._safetensors import SafetensorsError, ShardWriter, TensorReader, read_header

SIZES = [1, 7, 4096, 4097, 12_345, 70_000, 3, 8191, 200_001, 5]


def write_files(folder: Path, n_files: int = 2, seed: int = 0) -> dict:
    """Random uint8 tensors of awkward sizes in `n_files` safetensors files; {name: bytes}."""
    rng = np.random.default_rng(seed)
    want = {}
    for f in range(n_files):
        entries = [(f"f{f}.t{i}", "U8", (n,)) for i, n in enumerate(SIZES)]
        with ShardWriter(folder / f"part{f}.safetensors", entries) as w:
            for name, _, shape in entries:
                want[name] = rng.integers(0, 256, shape, dtype=np.uint8)
                w.write(name, want[name])
    return want


def infos_of(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(read_header(f)[0])
    return out


@pytest.mark.parametrize("drop_cache", [False, True])
@pytest.mark.parametrize("window", [4096, 3 * 4096, 1 << 20])
def test_read_many_matches_plain_reads(tmp_path, window, drop_cache):
    want = write_files(tmp_path)
    infos = infos_of(tmp_path)
    names = list(want)
    order = np.random.default_rng(1).permutation(len(names))
    picked = [names[i] for i in order[: len(names) - 3]]  # leave gaps: some tensors are not requested
    outs = {n: np.full(infos[n].nbytes, 0xA5, np.uint8) for n in picked}
    with TensorReader(drop_cache=drop_cache, window_bytes=window) as r:
        r.read_many([(infos[n], outs[n]) for n in picked], max_gap=5000)
        assert r.bytes_read == sum(infos[n].nbytes for n in picked)
    for n in picked:
        np.testing.assert_array_equal(outs[n], want[n], err_msg=n)


def test_read_many_into_typed_views(tmp_path):
    """Destinations are views into a larger stacked array (how the converter stacks experts)."""
    rng = np.random.default_rng(2)
    vals = [rng.integers(0, 256, (5, 6), dtype=np.uint8) for _ in range(4)]
    entries = [(f"e{i}", "U8", (5, 6)) for i in range(4)]
    with ShardWriter(tmp_path / "x.safetensors", entries) as w:
        for (name, _, _), v in zip(entries, vals):
            w.write(name, v)
    infos = read_header(tmp_path / "x.safetensors")[0]
    stacked = np.zeros((4, 5, 6), np.uint8)
    with TensorReader(drop_cache=True, window_bytes=4096) as r:
        r.read_many([(infos[f"e{i}"], stacked[i]) for i in (3, 1, 0, 2)])
    np.testing.assert_array_equal(stacked, np.stack(vals))


def test_read_many_reports_a_file_cut_short(tmp_path):
    write_files(tmp_path, n_files=1)
    infos = infos_of(tmp_path)
    last = max(infos.values(), key=lambda i: i.end)
    os.truncate(last.file, last.end - 3)  # shrinks after the header was read: cuts the last tensor (5 bytes)
    with TensorReader(drop_cache=True) as r, pytest.raises(SafetensorsError) as err:
        r.read_many([(i, np.empty(i.nbytes, np.uint8)) for i in infos.values()])
    assert str(last.file) in str(err.value) and repr(last.name) in str(err.value)
    assert "cut short" in str(err.value)


def test_read_many_checks_destinations(tmp_path):
    write_files(tmp_path, n_files=1)
    info = infos_of(tmp_path)["f0.t2"]
    with TensorReader() as r:
        with pytest.raises(SafetensorsError, match=r"'f0\.t2' holds 4096 bytes, but the destination has 4095"):
            r.read_many([(info, np.empty(4095, np.uint8))])
        with pytest.raises(SafetensorsError, match="not contiguous"):
            r.read_many([(info, np.empty((64, 128), np.uint8)[:, ::2])])


def test_read_many_without_o_direct(tmp_path, monkeypatch):
    """A file system that refuses O_DIRECT (EINVAL on open): buffered reads, same bytes."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    want = write_files(tmp_path)
    infos = infos_of(tmp_path)
    outs = {n: np.empty(infos[n].nbytes, np.uint8) for n in want}
    with TensorReader(drop_cache=True, window_bytes=8192) as r:
        r.read_many([(infos[n], outs[n]) for n in want])
        assert r._direct and all(fd is None for fd in r._direct.values())
    for n in want:
        np.testing.assert_array_equal(outs[n], want[n])


def test_read_many_reuses_its_window(tmp_path):
    """One aligned window buffer for the reader's life (a fresh one per run would fault in
    new pages on every read)."""
    want = write_files(tmp_path)
    infos = infos_of(tmp_path)
    with TensorReader(drop_cache=True, window_bytes=8192) as r:
        r.read_many([(infos["f0.t1"], np.empty(7, np.uint8))])
        window = r._window
        assert window.ctypes.data % 4096 == 0 and window.nbytes == 8192
        out = np.empty(infos["f1.t8"].nbytes, np.uint8)
        r.read_many([(infos["f1.t8"], out)])
        assert r._window is window
    np.testing.assert_array_equal(out, want["f1.t8"])
