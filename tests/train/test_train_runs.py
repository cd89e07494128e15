"""Training runs end to end on the tiny config: bit-exact resume, refused resumes, SIGTERM,
the `train` / `eval` / `plot` command line, and trainable subsets (experts, LoRA)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from helpers.paths import stdlib_corpus
from helpers.processes import cli_env
from k31jax.nn import abstract_model
from k31jax.train import DataConfig, OptimConfig, TrainConfig, Trainer
from k31jax.train._lora import lora_shardings
from k31jax.train._steps import overlay

K31JAX = Path(sys.executable).parent / "k31jax"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real text: a few of the Python standard library's own sources."""
    return stdlib_corpus(tmp_path_factory.mktemp("corpus"),
                         ("bisect.py", "heapq.py", "textwrap.py", "colorsys.py", "keyword.py", "shlex.py", "fnmatch.py",
                          "glob.py", "copy.py"))


def _train_cfg(out, corpus, **kw):
    data = DataConfig(paths=(str(corpus),), seq_len=kw.pop("seq_len", 48), batch_size=kw.pop("batch_size", 2),
                      holdout_fraction=0.2, seed=1)
    optim = OptimConfig(learning_rate=2e-3, warmup_steps=2, total_steps=20, **kw.pop("optim", {}))
    return TrainConfig(out=str(out), data=data, optim=optim, steps=kw.pop("steps", 6), save_every=kw.pop("save_every", 3),
                       eval_batches=1, **kw)


# ---------------------------------------------------------------------------- runs
def _params_of(trainer):
    """The whole model's parameters (the frozen rest with the trained leaves overlaid)."""
    return jax.tree.map(np.asarray, overlay(trainer.params, trainer.trainable))


def test_resume_is_bit_exact(tmp_path, corpus):
    """10 steps straight == 5 steps, stop, resume, 5 steps: parameters, optimizer state and
    every step's loss, bit for bit."""
    with Trainer(_train_cfg(tmp_path / "a", corpus, steps=10, save_every=5, qat=True)) as straight:
        losses_a = [float(m["loss"]) for m in straight.train_steps(10)]
        params_a, opt_a = _params_of(straight), jax.tree.map(np.asarray, straight.opt_state)

    with Trainer(_train_cfg(tmp_path / "b", corpus, steps=10, save_every=5, qat=True)) as first:
        losses_b = [float(m["loss"]) for m in first.train_steps(5)]
        first.save()
    with Trainer(_train_cfg(tmp_path / "b", corpus, steps=10, save_every=5, qat=True), resume=True) as resumed:
        assert resumed.step == 5
        losses_b += [float(m["loss"]) for m in resumed.train_steps(5)]
        params_b, opt_b = _params_of(resumed), jax.tree.map(np.asarray, resumed.opt_state)
    assert losses_a == losses_b
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(opt_a), jax.tree.leaves(opt_b)):
        np.testing.assert_array_equal(a, b)
    assert losses_a[-1] < losses_a[0]


def test_resume_refuses_changed_settings_and_a_used_folder(tmp_path, corpus):
    cfg = _train_cfg(tmp_path / "r", corpus, steps=2)
    with Trainer(cfg) as t:
        t.train_steps(1)
        t.save()
    with pytest.raises(FileExistsError, match="already holds a training run"):
        Trainer(cfg)
    with pytest.raises(ValueError, match=r"other settings for \['qat'\]"):
        Trainer(_train_cfg(tmp_path / "r", corpus, steps=2, qat=True), resume=True)
    with pytest.raises(FileNotFoundError, match="holds no training run"):
        Trainer(_train_cfg(tmp_path / "nothing", corpus), resume=True)


def _run(*args, **kw):
    return subprocess.run([str(K31JAX), *map(str, args)], capture_output=True, text=True, timeout=600,
                          env=cli_env(), **kw)


def test_cli_trains_writes_checkpoints_metrics_and_resumes(tmp_path, corpus):
    out = tmp_path / "run"
    common = ["--data", corpus, "--out", out, "--seq-len", 48, "--batch-size", 2, "--save-every", 2,
              "--eval-batches", 1, "--qat", "--no-progress", "--holdout-fraction", 0.3]
    first = _run("train", *common, "--steps", 3)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "3"]
    assert (out / "tb").is_dir() and any((out / "tb").iterdir())
    release = out / "final" / "release"
    assert (release / "config.json").exists() and list(release.glob("*.safetensors"))
    assert (out / "final" / "orbax" / "_CHECKPOINT_METADATA").exists()
    second = _run("train", "--out", out, "--resume", "--steps", 5, "--no-progress", "--no-export")
    assert second.returncode == 0, second.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    assert all("router_max_over_mean" in r for r in rows if "loss" in r)
    ev = _run("eval", "--ckpt", out, "--data", corpus, "--seq-len", 48, "--batch-size", 2, "--max-batches", 2,
              "--holdout-fraction", 0.3, "--json")
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["bits_per_byte"] > 0 and result["tokens"] > 0 and "step 5" in ev.stdout
    plot = _run("plot", out, "-o", tmp_path / "loss.png")
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "loss.png").stat().st_size > 1000
    bad = _run("train", "--data", corpus, "--out", out, "--steps", 3)
    assert bad.returncode == 1 and bad.stderr.startswith("k31jax train: error:") and "--resume" in bad.stderr


def test_sigterm_saves_before_exit(tmp_path, corpus):
    out = tmp_path / "run"
    proc = subprocess.Popen([str(K31JAX), "train", "--data", str(corpus), "--out", str(out), "--seq-len", "48",
                             "--batch-size", "2", "--steps", "500", "--save-every", "1000", "--no-progress",
                             "--holdout-fraction", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert len(steps) == 1 and 2 <= steps[0] < 500
    assert f"stopped by a signal at step {steps[0]}" in err


_ISOLATED = "K31JAX_TEST_ISOLATED"


@pytest.mark.parametrize("kind", ["experts", "lora"])
def test_only_the_selected_weights_train(tmp_path, corpus, kind):
    """trainable="experts" changes the routed experts (and the router bias, by its rule) only;
    LoRA changes only its adapters, and the merged model differs from the base.

    Runs in a fresh process: compiling these steps late in the full suite's process crashed
    XLA:CPU (a segfault inside backend compile, not reproduced in a fresh process)."""
    if os.environ.get(_ISOLATED) != kind:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              f"{__file__}::test_only_the_selected_weights_train[{kind}]"],
                             env={**os.environ, _ISOLATED: kind}, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
        return
    # LoRA on a mesh: its adapters are made where the step takes them (`lora_shardings`)
    extra = dict(optim={"trainable": "experts"}) if kind == "experts" else dict(lora_rank=2, mesh="expert=2,tensor=2")
    with Trainer(_train_cfg(tmp_path / kind, corpus, steps=2, **extra)) as trainer:
        if kind == "lora":
            want = lora_shardings(trainer.trainable, nnx.state(abstract_model(trainer.model_config)), trainer.mesh)
            assert all(a.sharding == s for a, s in zip(jax.tree.leaves(trainer.trainable), jax.tree.leaves(want)))
            assert any(a.sharding.spec != jax.P() for a in jax.tree.leaves(trainer.trainable))
        _check_only_selected_weights_train(trainer, kind)


def _check_only_selected_weights_train(trainer, kind):
    before = jax.tree.map(np.asarray, overlay(trainer.params, trainer.trainable) if kind == "experts"
                          else trainer.params)
    lora_before = jax.tree.map(np.asarray, trainer.trainable) if kind == "lora" else None
    trainer.train_steps(2)
    after = jax.tree.map(np.asarray, overlay(trainer.params, trainer.trainable) if kind == "experts"
                         else trainer.params)
    changed = {jax.tree_util.keystr(p, simple=True, separator="/")
               for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after))
               if not np.array_equal(a, b)}
    if kind == "experts":
        assert changed == {"moe/w_gate", "moe/w_up", "moe/w_down", "moe/gate_bias"}
    else:  # the base is frozen whole, the router's selection bias too
        assert changed == set()
        moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(lora_before),
                                                          jax.tree.leaves(trainer.trainable))]
        assert any(moved)
        merged = nnx.to_pure_dict(nnx.state(trainer.model()))
        assert not np.array_equal(np.asarray(merged["kda"]["q_proj"]), after["kda"]["q_proj"])
