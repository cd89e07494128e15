"""`k31jax train` on two processes (loopback, CPU devices, gloo collectives) on a
`fsdp=2,expert=2,tensor=2` mesh, the documents in two data shards (each process reads its own):
the losses and parameters of one process with all 8 devices reading both shards,
checkpoints that resume on the other topology, SIGTERM to one process stopping both, and a
killed process ending the other with one line."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import k31jax
import numpy as np
import pytest
from flax import nnx

from helpers.paths import stdlib_corpus
from helpers.processes import cli_env, free_port
from k31jax.train import load_run

K31JAX = Path(sys.executable).parent / "k31jax"
MESH = "fsdp=2,expert=2,tensor=2"
STEPS = 8
# Two processes sum their partial results through gloo, one process inside XLA: the same
# numbers up to the order of float32 additions. Losses agree to RTOL. A weight agrees to RTOL
# or to ATOL, a thousandth of one Adam step (LR): Adam divides each gradient by its own running
# RMS, so where a gradient is near zero an addition-order difference is magnified up to the
# step size. Measured: 2.4e-7 at most over all weights after 8 steps.
RTOL = 2e-5
LR = 3e-3
ATOL = 1e-3 * LR


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return stdlib_corpus(tmp_path_factory.mktemp("corpus"),
                         ("bisect.py", "heapq.py", "textwrap.py", "colorsys.py", "shlex.py", "fnmatch.py"))


@pytest.fixture(scope="module")
def small_config(tmp_path_factory):
    """`tiny` cut to 4 layers (dense + KDA, then MoE + MLA with the indexer, twice): every kind
    of layer and state the trainer shards, at a third of the compile time."""
    raw = json.loads((Path(k31jax.__file__).parent / "configs" / "tiny.json").read_text())
    text = raw["text_config"]
    text["num_hidden_layers"] = 4
    text["linear_attn_config"].update(full_attn_layers=[2, 4], kda_layers=[1, 3])
    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(json.dumps(raw))
    return path


def _train_args(out, corpus, config, *extra):
    return ["train", "--out", out, "--data", corpus, "--config", config, "--seq-len", 48, "--batch-size", 4, "--steps", STEPS,
            "--save-every", 4, "--keep", 4, "--lr", LR, "--warmup", 1, "--holdout-fraction", 0.2,
            "--eval-batches", 1, "--mesh", MESH, "--data-shards", 2, "--no-progress", *extra]


def _one_process(*args):
    done = subprocess.run([str(K31JAX), *map(str, args), "--num-cpu-devices", "8"], capture_output=True, text=True,
                          timeout=600, env=cli_env())
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _two_processes(*args) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen([str(K31JAX), *map(str, args), "--coordinator", f"127.0.0.1:{port}",
                              "--num-processes", "2", "--process-id", str(i), "--num-cpu-devices", "4",
                              "--cpu-collectives", "gloo"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
            for i in range(2)]


def _finish(procs, timeout=600) -> list[tuple[int, str]]:
    results = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            results.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def _logged_steps(out: Path, key: str = "loss") -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r[key] for r in rows if key in r}


def _wait_for_step(out: Path, step: int, procs, limit=300) -> None:
    deadline = time.time() + limit
    while time.time() < deadline:
        try:
            if (out / "metrics.jsonl").exists() and step in _logged_steps(out):
                return
        except json.JSONDecodeError:  # a line being written
            pass
        assert all(p.poll() is None for p in procs), "a training process ended early"
        time.sleep(0.1)
    raise AssertionError(f"no step {step} logged within {limit} s")


def _params(out: Path, step: int) -> dict:
    model, _, _ = load_run(out, step)
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def _assert_same_params(got, want, what):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"{what}: {jax.tree_util.keystr(path)}")


def test_two_processes_train_as_one_and_checkpoints_move_between_topologies(tmp_path, corpus, small_config):
    # the reference: one process, 8 devices, uninterrupted
    whole = tmp_path / "one"
    _one_process(*_train_args(whole, corpus, small_config, "--no-export"))
    want = _logged_steps(whole)
    assert sorted(want) == list(range(1, STEPS + 1))

    # two processes x 4 devices; SIGTERM to process 1 stops both, each saves its shards
    split = tmp_path / "two"
    procs = _two_processes(*_train_args(split, corpus, small_config, "--no-export"))
    _wait_for_step(split, 1, procs)
    procs[1].send_signal(signal.SIGTERM)
    (code0, err0), (code1, err1) = _finish(procs)
    assert code0 == code1 == 143, (err0[-3000:], err1[-3000:])
    saved = sorted(int(p.name) for p in (split / "checkpoints").iterdir() if p.name.isdigit())
    stopped = saved[-1]
    assert 1 <= stopped < STEPS and f"stopped by a signal at step {stopped}" in err0
    assert "stopped by a signal" not in err1  # process 0 alone reports the run

    # ... resumed on one process: the loss sequence continues as in the uninterrupted run
    _one_process("train", "--out", split, "--resume", "--no-progress", "--no-export", "--mesh", MESH)
    got = _logged_steps(split)
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=RTOL)
    final = _params(whole, STEPS)
    _assert_same_params(_params(split, STEPS), final, "2 processes, then 1")

    # and back: one process's checkpoint at step 4 resumed on two processes, which export
    back = tmp_path / "back"
    shutil.copytree(whole, back)
    shutil.rmtree(back / "checkpoints" / str(STEPS))
    results = _finish(_two_processes("train", "--out", back, "--resume", "--no-progress", "--mesh", MESH))
    assert [code for code, _ in results] == [0, 0], [err[-3000:] for _, err in results]
    got = _logged_steps(back)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=RTOL)
    _assert_same_params(_params(back, STEPS), final, "1 process, then 2")
    # the held-out evaluation at the end, sharded over both processes' rows
    np.testing.assert_allclose(_logged_steps(back, "eval_loss")[STEPS], _logged_steps(whole, "eval_loss")[STEPS],
                               rtol=RTOL)
    release = back / "final" / "release"
    assert (release / "config.json").exists() and list(release.glob("*.safetensors"))
    assert (back / "final" / "orbax" / "_CHECKPOINT_METADATA").exists()


def test_a_killed_process_ends_the_other_with_one_line(tmp_path, corpus, small_config):
    out = tmp_path / "run"
    procs = _two_processes(*_train_args(out, corpus, small_config, "--no-export", "--steps", 500))
    _wait_for_step(out, 1, procs)
    procs[1].kill()
    killed_at = time.time()
    (code, err), _ = _finish(procs, timeout=120)
    took = time.time() - killed_at
    assert code == 1 and took < 60, (code, took, err[-3000:])
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("k31jax train: error: process 1 of 2 stopped answering"), \
        err[-3000:]
