"""Signals mid-run, in real subprocesses on a release big enough to take a few seconds:
SIGINT / SIGTERM stop at the next safe point with exit 130 / 143, one `error:` line and no
temporary folder; after SIGKILL the next run into the same parent removes the killed run's
temporary folder (one line) and produces a checkpoint that `k31jax verify --source` accepts."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.faults import TEMP_RE, assert_clean, run, tree_digest
from k31jax.ckpt import checkpoint_info
from k31jax.ckpt import convert, synthetic_config, write_synthetic_release


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 4-layer, 16-expert K3-shaped release (~150 MB) and its conversion."""
    root = tmp_path_factory.mktemp("big")
    src = write_synthetic_release(root / "release", synthetic_config(layers=4, experts=16), num_shards=3)
    ckpt = convert(src, root / "ckpt", progress=False).dst
    return src, ckpt, tree_digest(src), tree_digest(ckpt)


def start(*argv) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", "k31jax.cli", *map(str, argv), "--no-progress"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_writing(proc: subprocess.Popen, parent: Path, inside: str, timeout: float = 90) -> Path:
    """The temporary folder of the run once `inside` exists in it (the run is writing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in os.listdir(parent):
            if TEMP_RE.match(name) and (parent / name / inside).exists():
                return parent / name
        assert proc.poll() is None, f"the run ended before writing: {proc.stderr.read()}"
        time.sleep(0.01)
    raise AssertionError("the run never started writing")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_mid_conversion(big, tmp_path, sig, code):
    src, _, src_digest, _ = big
    dst = tmp_path / "ck"
    proc = start("convert", src, dst, "--max-call-gb", "0.005")
    wait_for_writing(proc, tmp_path, "checkpoint.partial_save")
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == code, err
    assert err.splitlines() == [f"k31jax convert: error: interrupted by {sig.name}: stopped before {dst} was "
                                "published; its temporary folder was removed"]
    time.sleep(0.2)  # nothing may recreate the temporary folder after the process is gone either
    assert_clean(tmp_path, set())
    assert tree_digest(src) == src_digest


def test_sigkill_mid_conversion_then_rerun(big, tmp_path, capsys):
    src, _, src_digest, _ = big
    dst = tmp_path / "ck"
    proc = start("convert", src, dst, "--max-call-gb", "0.005")
    box = wait_for_writing(proc, tmp_path, "checkpoint.partial_save")
    proc.kill()
    proc.communicate(timeout=60)
    assert box.is_dir() and not dst.exists()  # what a killed run leaves
    code, err = run(capsys, "convert", src, dst, "--verify")
    assert code == 0
    assert err == [f"k31jax convert: removed 1 stale temporary folder left by a killed run: {box} (pid {proc.pid})"]
    info = checkpoint_info(dst)
    assert info["source"]["root"] == str(src) and len(info["stored"]["layers"]) == 4
    assert run(capsys, "verify", dst, "--source", src) == (0, [])  # every byte, and the round trip
    assert_clean(tmp_path, {"ck"})
    assert tree_digest(src) == src_digest


def test_sigint_mid_export(big, tmp_path):
    _, ckpt, _, ckpt_digest = big
    out = tmp_path / "out"
    proc = start("export", ckpt, out)
    wait_for_writing(proc, tmp_path, "release")
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    assert err.splitlines() == [f"k31jax export: error: interrupted by SIGINT: stopped before {out} was "
                                "published; its temporary folder was removed"]
    assert_clean(tmp_path, set())
    assert tree_digest(ckpt) == ckpt_digest


def test_sigkill_mid_export_then_rerun(big, tmp_path, capsys):
    src, ckpt, _, ckpt_digest = big
    out = tmp_path / "out"
    proc = start("export", ckpt, out)
    box = wait_for_writing(proc, tmp_path, "release")
    proc.kill()
    proc.communicate(timeout=60)
    code, err = run(capsys, "export", ckpt, out)
    assert code == 0
    assert err == [f"k31jax export: removed 1 stale temporary folder left by a killed run: {box} (pid {proc.pid})"]
    for f in src.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert_clean(tmp_path, {"out"})
    assert tree_digest(ckpt) == ckpt_digest
