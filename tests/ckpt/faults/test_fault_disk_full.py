"""A real full disk: a small tmpfs as DST's parent (needs root to mount; skipped otherwise).
TensorStore's background writers hit ENOSPC inside Orbax: the run still ends with exit 1, one
`error:` line, and an empty file system (the writers settle before the temporary folder is
removed, so nothing recreates it)."""

import os
import shutil
import subprocess
import time

import pytest

from helpers.faults import one_error, run, tree_digest
from helpers.model import tiny_config
from k31jax.ckpt import convert, write_synthetic_release


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    cfg = tiny_config(expert_weights="mxfp4", dtype="bfloat16")
    src = write_synthetic_release(tmp_path_factory.mktemp("release") / "src", cfg, seed=1, num_shards=3)
    return src, convert(src, src.parent / "ckpt", progress=False).dst  # 1.5 MB stored


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of `request.param` bytes, unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# Where the space runs out: 1000k in TensorStore's array writes, 1600k in Orbax's own metadata
# files (the whole conversion needs about 2 MB).
@pytest.mark.parametrize("small_disk", ["1000k", "1600k"], indirect=True)
def test_convert_onto_a_full_disk(release, small_disk, capsys):
    src, _ = release
    before = tree_digest(src)
    code, err = run(capsys, "convert", src, small_disk / "ck", "--verify")
    assert code == 1
    one_error(err, "convert", f"no space left on device while writing into {small_disk}",
              f"{small_disk / 'ck'} was not touched")
    time.sleep(0.2)  # a late background write would show up here
    assert os.listdir(small_disk) == []
    assert tree_digest(src) == before


@pytest.mark.parametrize("small_disk", ["1000k"], indirect=True)
def test_export_onto_a_full_disk(release, small_disk, capsys):
    _, ckpt = release
    before = tree_digest(ckpt)
    code, err = run(capsys, "export", ckpt, small_disk / "out")
    assert code == 1
    one_error(err, "export", f"no space left on device while writing into {small_disk}")
    assert os.listdir(small_disk) == []
    assert tree_digest(ckpt) == before
