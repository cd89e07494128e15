"""Safe destinations for `k31jax convert` / `k31jax export`, through the CLI in-process: each
case checks the exit code, the one `error:` line naming the path, that SRC is bytewise
untouched, that nothing half-written is published and that no temporary folder or lock is
left (see k31jax/ckpt/_destination.py)."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.faults import assert_clean, dead_pid, hold_lock, make_temp_tree, one_error, run, tree_digest
from helpers.model import tiny_config
from helpers.release import tensors_of
from k31jax.ckpt import checkpoint_info
from k31jax.ckpt._orbax import load_stored
from k31jax.ckpt import write_synthetic_release
from k31jax.ckpt import _convert as convert_module

EMBED = "language_model.model.embed_tokens.weight"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    cfg = tiny_config(expert_weights="mxfp4", dtype="bfloat16")
    return write_synthetic_release(tmp_path_factory.mktemp("release") / "release", cfg, seed=1, num_shards=3)


@pytest.fixture(scope="module")
def checkpoint(release, tmp_path_factory):
    dst = tmp_path_factory.mktemp("ckpt") / "ck"
    from k31jax.ckpt import convert

    convert(release, dst, progress=False)
    return dst


@pytest.fixture
def src(release, tmp_path):
    src = shutil.copytree(release, tmp_path / "src")
    before = tree_digest(src)
    yield src
    assert tree_digest(src) == before, "the source folder changed"


@pytest.fixture
def ckpt(checkpoint, tmp_path):
    ckpt = shutil.copytree(checkpoint, tmp_path / "ckpt")
    before = tree_digest(ckpt)
    yield ckpt
    assert tree_digest(ckpt) == before, "the source checkpoint changed"


def assert_converted(dst: Path, src: Path) -> None:
    """A complete k31jax checkpoint of `src` (every layer's arrays present, the embedding bytewise)."""
    info = checkpoint_info(dst)
    assert info["source"]["root"] == str(src.resolve())
    assert len(info["stored"]["layers"]) == 13
    embed = load_stored(dst, [("embed",)])[("embed",)]
    assert embed.tobytes() == tensors_of(src)[EMBED].tobytes()


# ---- DST overlapping SRC: usage errors (exit 2), before anything is written ----

@pytest.mark.parametrize("spelling", ["{src}", "{src}/", "{src}/../src", "{src}/./"])
def test_dst_is_src(src, spelling, capsys):
    code, err = run(capsys, "convert", src, spelling.format(src=src), "--overwrite")
    assert code == 2
    one_error(err, "convert", f"is the source folder {src}")
    assert_clean(src.parent, {"src"})


def test_dst_inside_src(src, capsys):
    code, err = run(capsys, "convert", src, src / "out", "--overwrite")
    assert code == 2
    one_error(err, "convert", f"destination {src / 'out'} lies inside the source folder {src}")
    assert_clean(src.parent, {"src"})


def test_src_inside_dst(src, capsys):
    code, err = run(capsys, "convert", src, src.parent, "--overwrite")
    assert code == 2
    one_error(err, "convert", f"destination {src.parent} contains the source folder {src}")
    assert_clean(src.parent, {"src"})


def test_dst_symlink_to_src(src, capsys):
    (src.parent / "link").symlink_to(src)
    code, err = run(capsys, "convert", src, src.parent / "link", "--overwrite")
    assert code == 2
    one_error(err, "convert", f"{src.parent / 'link'} (a link to {src}) is the source folder")
    assert_clean(src.parent, {"src", "link"})


def test_dst_inside_src_through_symlinked_parent(src, capsys):
    (src.parent / "alias").symlink_to(src)
    code, err = run(capsys, "convert", src, src.parent / "alias" / "out")
    assert code == 2
    one_error(err, "convert", "lies inside the source folder", str(src))
    assert_clean(src.parent, {"src", "alias"})


def test_export_out_is_ckpt(ckpt, capsys):
    code, err = run(capsys, "export", ckpt, ckpt, "--overwrite")
    assert code == 2
    one_error(err, "export", f"is the source folder {ckpt}")
    assert_clean(ckpt.parent, {"ckpt"})


def test_export_out_inside_ckpt(ckpt, capsys):
    code, err = run(capsys, "export", ckpt, ckpt / "state" / "out")
    assert code == 2
    one_error(err, "export", "lies inside the source folder", str(ckpt))
    assert_clean(ckpt.parent, {"ckpt"})


# ---- an existing DST ----

def test_dst_exists_without_overwrite(src, capsys):
    dst = src.parent / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    code, err = run(capsys, "convert", src, dst)
    assert code == 1
    one_error(err, "convert", f"{dst}: already exists; pass --overwrite")
    assert (dst / "notes.txt").read_text() == "mine" and os.listdir(dst) == ["notes.txt"]
    assert_clean(src.parent, {"src", "dst"})


def test_empty_dst_without_overwrite_is_refused(src, capsys):
    (src.parent / "dst").mkdir()
    code, err = run(capsys, "convert", src, src.parent / "dst")
    assert code == 1
    one_error(err, "convert", f"{src.parent / 'dst'}: already exists")
    assert os.listdir(src.parent / "dst") == []


def test_overwrite_refuses_a_folder_that_is_not_a_checkpoint(src, capsys):
    dst = src.parent / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    code, err = run(capsys, "convert", src, dst, "--overwrite")
    assert code == 1
    one_error(err, "convert", f"{dst}: is not a k31jax checkpoint (it holds notes.txt)")
    assert (dst / "notes.txt").read_text() == "mine" and os.listdir(dst) == ["notes.txt"]
    assert_clean(src.parent, {"src", "dst"})


def test_overwrite_refuses_a_file(src, capsys):
    (src.parent / "dst").write_text("a file")
    code, err = run(capsys, "convert", src, src.parent / "dst", "--overwrite")
    assert code == 1
    one_error(err, "convert", f"{src.parent / 'dst'}: is a file")
    assert (src.parent / "dst").read_text() == "a file"


def test_overwrite_refuses_a_symlink(src, checkpoint, capsys):
    (src.parent / "dst").symlink_to(checkpoint)
    code, err = run(capsys, "convert", src, src.parent / "dst", "--overwrite")
    assert code == 1
    one_error(err, "convert", f"{src.parent / 'dst'}: is a symbolic link")
    assert (src.parent / "dst").readlink() == checkpoint


def test_overwrite_replaces_a_real_checkpoint(src, capsys):
    dst = src.parent / "dst"
    assert run(capsys, "convert", src, dst, "--dtype", "float32") == (0, [])
    assert checkpoint_info(dst)["stored"]["embed"].dtype == np.float32
    src2 = shutil.copytree(src, src.parent / "src2")
    code, err = run(capsys, "convert", src2, dst, "--overwrite", "--verify")
    assert (code, err) == (0, [])
    assert_converted(dst, src2)
    assert checkpoint_info(dst)["stored"]["embed"].dtype != np.float32  # the new one, not the old
    assert_clean(src.parent, {"src", "src2", "dst"})


def test_overwrite_fills_an_empty_folder(src, capsys):
    (src.parent / "dst").mkdir()
    assert run(capsys, "convert", src, src.parent / "dst", "--overwrite") == (0, [])
    assert_converted(src.parent / "dst", src)
    assert_clean(src.parent, {"src", "dst"})


def test_export_overwrite_refuses_a_release_it_did_not_write(ckpt, release, capsys):
    out = shutil.copytree(release, ckpt.parent / "out")  # somebody's release folder
    before = tree_digest(out)
    code, err = run(capsys, "export", ckpt, out, "--overwrite")
    assert code == 1
    one_error(err, "export", f"{out}: is not a release folder written by k31jax export (it holds config.json")
    assert tree_digest(out) == before
    assert_clean(ckpt.parent, {"ckpt", "out"})


def test_export_overwrite_replaces_its_own_export(ckpt, release, capsys):
    out = ckpt.parent / "out"
    assert run(capsys, "export", ckpt, out) == (0, [])
    (out / "model-00001-of-000003.safetensors").write_bytes(b"damaged")
    assert run(capsys, "export", ckpt, out, "--overwrite") == (0, [])
    for f in release.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert_clean(ckpt.parent, {"ckpt", "out"})


def test_export_exists_without_overwrite(ckpt, capsys):
    (ckpt.parent / "out").mkdir()
    (ckpt.parent / "out" / "x").write_text("mine")
    code, err = run(capsys, "export", ckpt, ckpt.parent / "out")
    assert code == 1
    one_error(err, "export", f"{ckpt.parent / 'out'}: already exists; pass --overwrite")
    assert (ckpt.parent / "out" / "x").read_text() == "mine"


# ---- a DST that appears while the run writes ----

def _appear_before_publishing(monkeypatch, dst: Path, module=convert_module):
    real = module.fsync_tree

    def fsync_then_appear(root):
        real(root)
        dst.mkdir()
        (dst / "theirs.txt").write_text("written meanwhile")

    monkeypatch.setattr(module, "fsync_tree", fsync_then_appear)


def test_dst_appearing_during_the_run_is_never_replaced(src, monkeypatch, capsys):
    dst = src.parent / "dst"
    _appear_before_publishing(monkeypatch, dst)
    code, err = run(capsys, "convert", src, dst)
    assert code == 1
    one_error(err, "convert", f"{dst}: appeared while this run was writing and was left untouched")
    assert os.listdir(dst) == ["theirs.txt"] and (dst / "theirs.txt").read_text() == "written meanwhile"
    assert_clean(src.parent, {"src", "dst"})


def test_dst_appearing_during_the_run_with_overwrite_is_checked_again(src, monkeypatch, capsys):
    dst = src.parent / "dst"
    _appear_before_publishing(monkeypatch, dst)
    code, err = run(capsys, "convert", src, dst, "--overwrite")
    assert code == 1
    one_error(err, "convert", f"{dst}: is not a k31jax checkpoint (it holds theirs.txt)")
    assert os.listdir(dst) == ["theirs.txt"]
    assert_clean(src.parent, {"src", "dst"})


def test_export_out_appearing_during_the_run(ckpt, monkeypatch, capsys):
    from k31jax.ckpt import _export

    out = ckpt.parent / "out"
    _appear_before_publishing(monkeypatch, out, _export)
    code, err = run(capsys, "export", ckpt, out)
    assert code == 1
    one_error(err, "export", f"{out}: appeared while this run was writing")
    assert os.listdir(out) == ["theirs.txt"]
    assert_clean(ckpt.parent, {"ckpt", "out"})


# ---- the lock ----

def test_second_run_into_a_locked_dst_fails_at_once(src, capsys):
    dst = src.parent / "dst"
    with hold_lock(dst) as lock:
        code, err = run(capsys, "convert", src, dst)
        assert lock.exists() and lock.read_text() == f"{os.getpid()}\n"  # the holder's file is left alone
    assert code == 1
    one_error(err, "convert", f"{dst}: another k31jax run is writing it (pid {os.getpid()}, lock file {lock})")
    assert_clean(src.parent, {"src"})


def test_export_into_a_locked_out(ckpt, capsys):
    out = ckpt.parent / "out"
    with hold_lock(out):
        code, err = run(capsys, "export", ckpt, out)
    assert code == 1
    one_error(err, "export", f"{out}: another k31jax run is writing it (pid {os.getpid()}")
    assert_clean(ckpt.parent, {"ckpt"})


# ---- any legal folder name ----

NAMES = ["ck[1]", ".hidden", "with space", "ünï", "a*b?"]


@pytest.mark.parametrize("name", NAMES)
def test_any_folder_name_converts_and_verifies(src, name, capsys):
    dst = src.parent / name
    assert run(capsys, "convert", src, dst, "--verify") == (0, [])
    assert_converted(dst, src)
    assert_clean(src.parent, {"src", name})


def test_glob_characters_in_the_parent_folder(release, tmp_path, capsys):
    parent = tmp_path / "run[1] *?" / ".x"
    src = shutil.copytree(release, parent / "src")
    assert run(capsys, "convert", src, parent / "ck[2]", "--verify") == (0, [])
    assert_converted(parent / "ck[2]", src)
    assert run(capsys, "export", parent / "ck[2]", parent / "out[3]") == (0, [])
    for f in release.iterdir():
        assert (parent / "out[3]" / f.name).read_bytes() == f.read_bytes(), f.name
    assert_clean(parent, {"src", "ck[2]", "out[3]"})


@pytest.mark.parametrize("name", ["out[1]", ".hidden out"])
def test_export_any_folder_name(ckpt, release, name, capsys):
    assert run(capsys, "export", ckpt, ckpt.parent / name) == (0, [])
    for f in release.iterdir():
        assert (ckpt.parent / name / f.name).read_bytes() == f.read_bytes(), f.name
    assert_clean(ckpt.parent, {"ckpt", name})


# ---- stale temporary folders of killed runs ----

def test_stale_temp_tree_of_a_killed_run_is_removed_with_a_message(src, capsys):
    pid = dead_pid()
    stale = make_temp_tree(src.parent, "dst", pid)
    code, err = run(capsys, "convert", src, src.parent / "dst")
    assert code == 0
    assert err == [f"k31jax convert: removed 1 stale temporary folder left by a killed run: {stale} (pid {pid})"]
    assert_converted(src.parent / "dst", src)
    assert_clean(src.parent, {"src", "dst"})


def test_temp_trees_of_live_runs_are_kept(src, capsys):
    """Temporary folders of live runs stay while another DST in the same parent is converted:
    one whose pid is running, and one whose pid looks gone but whose pid file is locked (a
    run in another pid namespace)."""
    import fcntl

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = make_temp_tree(src.parent, "other", sleeper.pid)
    elsewhere = make_temp_tree(src.parent, "third", dead_pid())
    fd = os.open(elsewhere / "pid", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert run(capsys, "convert", src, src.parent / "dst") == (0, [])
    finally:
        os.close(fd)
        sleeper.kill()
        sleeper.wait()
    assert (live / "pid").read_text() == f"{sleeper.pid}\n" and (elsewhere / "pid").is_file()
    assert_clean(src.parent, {"src", "dst", live.name, elsewhere.name})


# ---- failures while writing: one line, exit 1, nothing left ----

def _fail_on_call(monkeypatch, n: int, exc: Exception):
    import orbax.checkpoint.experimental.v1 as ocp1

    real, calls = ocp1.partial.save, []

    def save(*args, **kwargs):
        calls.append(1)
        if len(calls) >= n:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(ocp1.partial, "save", save)
    return calls


@pytest.mark.parametrize("exc", [
    OSError(errno.ENOSPC, "No space left on device"),
    ValueError("RESOURCE_EXHAUSTED: Error writing \"x/c/0\": Failed to write 17 bytes to file 23: "
               "No space left on device [os_error_code='28']"),  # how TensorStore reports it
], ids=["oserror", "tensorstore"])
def test_disk_full_while_writing(src, monkeypatch, capsys, exc):
    calls = _fail_on_call(monkeypatch, 3, exc)
    code, err = run(capsys, "convert", src, src.parent / "dst", "--max-call-gb", "0.0001")
    assert code == 1 and len(calls) == 3
    one_error(err, "convert", f"no space left on device while writing into {src.parent}",
              f"{src.parent / 'dst'} was not touched")
    assert_clean(src.parent, {"src"})


def test_export_disk_full(ckpt, monkeypatch, capsys):
    from k31jax.ckpt import ShardWriter

    real, calls = ShardWriter.write, []

    def write(self, name, arr):
        calls.append(name)
        if len(calls) == 40:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real(self, name, arr)

    monkeypatch.setattr(ShardWriter, "write", write)
    code, err = run(capsys, "export", ckpt, ckpt.parent / "out")
    assert code == 1 and len(calls) == 40
    one_error(err, "export", f"no space left on device while writing into {ckpt.parent}")
    assert_clean(ckpt.parent, {"ckpt"})


def test_unexpected_error_is_one_line_and_debug_shows_the_traceback(src, monkeypatch, capsys):
    _fail_on_call(monkeypatch, 2, RuntimeError("boom\nsecond line"))
    code, err = run(capsys, "convert", src, src.parent / "dst", "--max-call-gb", "0.0001")
    assert code == 1
    one_error(err, "convert", "RuntimeError: boom second line (rerun with --debug for the traceback)")
    assert_clean(src.parent, {"src"})
    capsys.readouterr()
    from k31jax.cli import main

    assert main(["convert", str(src), str(src.parent / "dst"), "--no-progress", "--debug"]) == 1
    text = capsys.readouterr().err
    assert "Traceback (most recent call last)" in text and text.rstrip().splitlines()[-1].startswith(
        "k31jax convert: error: RuntimeError: boom")
    assert_clean(src.parent, {"src"})


def test_library_stop_event_stops_between_calls(src):
    """`convert(stop=...)`: the event set mid-run stops at the next call, removes the
    temporary folder and raises `Interrupted` naming DST."""
    import threading

    import orbax.checkpoint.experimental.v1 as ocp1

    from k31jax.ckpt import Interrupted, convert

    stop, real, calls = threading.Event(), ocp1.partial.save, []

    def save(*args, **kwargs):
        calls.append(1)
        stop.set()
        return real(*args, **kwargs)

    ocp1.partial.save = save
    try:
        with pytest.raises(Interrupted, match=rf"stopped before {src.parent / 'dst'} was published"):
            convert(src, src.parent / "dst", progress=False, stop=stop, max_call_bytes=1)
    finally:
        ocp1.partial.save = real
    assert len(calls) == 1
    assert_clean(src.parent, {"src"})


def test_export_marker_is_not_copied_into_a_conversion(ckpt, capsys):
    out = ckpt.parent / "out"
    assert run(capsys, "export", ckpt, out) == (0, [])
    marker = json.loads((out / ".k31jax_export.json").read_text())
    assert marker["format"] == "k31jax.export/1" and marker["checkpoint"] == str(ckpt)
    assert run(capsys, "convert", out, ckpt.parent / "again") == (0, [])
    assert sorted(os.listdir(ckpt.parent / "again" / "k31jax_assets")) == ["config.json"]
