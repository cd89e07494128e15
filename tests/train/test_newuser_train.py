"""What a new user meets training and evaluating on their own text (issue 32):

- one file (or four) is too few for a held-out split by document: the split is made inside
  the text, deterministically, recorded in run.json and said in one line; a text too short to
  split trains without evaluation and says so;
- `eval` evaluates text the model never trained on whole, and only the held-out part of its
  own training data (a run's recorded data, the embedded model's corpus.json);
- `--init embedded` fine-tunes the shipped model; the run records it as its base, and
  `generate --ckpt RUN` loads the run (its final export, else its newest checkpoint, saying
  which) with the embedded model's defaults (raw completion);
- a release's `preprocessor_config.json` sets (and is checked for) the image processor;
- "compiling ..." with the elapsed seconds while the first step compiles; eval progress.
"""

import dataclasses
import hashlib
import io
import json
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from tqdm import tqdm

from helpers.paths import REPO_ROOT
from helpers.processes import cli_env
from helpers.vision import TINY, release_weights
from k31jax.config import ConfigError
from k31jax.generate import embedded_model_dir, load_model
from k31jax.train import DataConfig, OptimConfig, TrainConfig, Trainer, eval_split, holdout_split, load_generation_model
from k31jax.train._data import TextDocument, load_documents, resolved_holdout, split_documents
from k31jax.train._metrics import compiling_note
from k31jax.vision import read_processor_config

K31JAX = Path(sys.executable).parent / "k31jax"
STDLIB_TEXT = (REPO_ROOT / "k31jax" / "train" / "_data.py").read_text()


def _run(*args, cwd=None):
    return subprocess.run([str(K31JAX), *map(str, args)], capture_output=True, text=True, timeout=600,
                          env=cli_env(), cwd=cwd)


def _lines(text: str, needle: str) -> list[str]:
    return [line for line in text.replace("\r", "\n").splitlines() if needle in line]


# ---------------------------------------------------------------------------- the split
def test_one_file_is_split_inside_its_text(tmp_path):
    """One file at 0.05: by document one side would be empty, so chunks of the text are held
    out: max(1, round(0.05 * chunks)) of them, the same ones every time, and the two sides
    together are the file again (only the piece that ends the file is followed by [EOS])."""
    path = tmp_path / "one_file.txt"
    path.write_text(STDLIB_TEXT)
    cfg = DataConfig(paths=(str(path),), seq_len=64, batch_size=2, chunk_chars=1000)
    split = holdout_split(cfg)
    assert split.unit == "chunk" and split.units >= 10
    assert split.held_out_units == max(1, round(0.05 * split.units))
    assert split.train and split.heldout
    pieces = sorted(split.train + split.heldout, key=lambda d: int(d.source.split("[")[1].split(":")[0]))
    assert "".join(d.text for d in pieces) == STDLIB_TEXT
    assert [d.ends for d in pieces] == [False] * (len(pieces) - 1) + [True]
    assert all(len(d.text) >= 1000 or d is pieces[-1] for d in split.heldout)  # chunks end at line ends
    assert all(d.text.endswith("\n") for d in pieces[:-1])
    again = holdout_split(cfg)
    assert [d.text for d in again.heldout] == [d.text for d in split.heldout]
    assert split_documents(cfg, "heldout") == split.heldout and split_documents(cfg, "train") == split.train
    assert "inside the text" in split.line(cfg.holdout_fraction)
    assert resolved_holdout(cfg).holdout_by == "chunk"
    # another seed holds out other chunks
    other = holdout_split(dataclasses.replace(cfg, holdout_seed=3))
    assert [d.text for d in other.heldout] != [d.text for d in split.heldout]


def test_enough_documents_keep_the_document_split(tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(80):
        (folder / f"{i:02d}.txt").write_text(f"document {i}\n" * (i + 1))
    few = tmp_path / "few"
    few.mkdir()
    for i in range(4):
        (few / f"{i}.txt").write_text(f"document {i}\n" * 300)
    many = DataConfig(paths=(str(folder),), seq_len=32, batch_size=1)
    split = holdout_split(many)
    assert split.unit == "document" and 0 < len(split.heldout) < 80
    assert all(isinstance(d, TextDocument) and d.ends for d in split.heldout)
    assert {d.doc_id for d in split.heldout + split.train} == {d.doc_id for d in load_documents(folder)}
    assert resolved_holdout(many).holdout_by == "document"
    assert holdout_split(DataConfig(paths=(str(few),), seq_len=32, batch_size=1)).unit == "chunk"


def test_too_short_text_trains_without_evaluation(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("print('hello')\n")
    split = holdout_split(DataConfig(paths=(str(path),), seq_len=32, batch_size=1))
    assert split.unit == "none" and not split.heldout and len(split.train) == 1
    assert "training without evaluation" in split.line(0.05)
    with pytest.raises(ValueError, match="holdout_by 'bogus' is not one of"):
        DataConfig(paths=(str(path),), seq_len=32, batch_size=1, holdout_by="bogus")
    with pytest.raises(ValueError, match="the heldout split .* is empty"):
        split_documents(DataConfig(paths=(str(path),), seq_len=32, batch_size=1), "heldout")


TWO_LAYERS = {"num_hidden_layers": 2, "linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1]}}


@pytest.fixture(scope="module")
def small_config(tmp_path_factory):
    """The tiny preset cut to two layers (one KDA, one MLA): its training step compiles fast."""
    raw = json.loads((REPO_ROOT / "configs" / "tiny.json").read_text())
    raw["text_config"].update(json.loads(json.dumps(TWO_LAYERS)), attn_res_block_size=1)
    raw["text_config"]["linear_attn_config"].update(num_heads=4, head_dim=16, short_conv_kernel_size=4,
                                                    gate_lower_bound=-5.0, use_full_rank_gate=True)
    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(json.dumps(raw))
    return path


def test_cli_trains_on_one_file(tmp_path, small_config):
    """The issue's command (a relative --out, one file): it trains, says which split, records
    it, and shows "compiling ..." while the first step compiles."""
    (tmp_path / "one_file.txt").write_text(STDLIB_TEXT)
    train = _run("train", "--config", small_config, "--data", "one_file.txt", "--out", "runs/t1", "--steps", 2,
                 "--seq-len", 32, "--batch-size", 2, "--eval-batches", 2, "--no-export", cwd=tmp_path)
    assert train.returncode == 0, train.stderr
    assert len(_lines(train.stderr, "held-out split: inside the text")) == 1
    assert _lines(train.stderr, "compiling ...")
    assert "held-out loss" in train.stdout
    run = json.loads((tmp_path / "runs/t1/run.json").read_text())
    assert run["data"]["holdout_by"] == "chunk" and run["model"] == str(small_config)


# ---------------------------------------------------------------------------- eval's split
def test_eval_of_new_text_on_the_embedded_model_takes_it_whole(tmp_path):
    new = tmp_path / "new_file.py"
    new.write_text("def add(a, b):\n    return a + b\n" * 8)
    ev = _run("eval", "--data", new, "--seq-len", 32, "--batch-size", 1, "--max-batches", 3)
    assert ev.returncode == 0, ev.stderr
    assert _lines(ev.stderr, "eval split: all (1 file, none of them training data of the embedded model)")
    assert "all split of" in ev.stdout and "3 batches" in ev.stdout
    assert _lines(ev.stderr, "compiling ...") and _lines(ev.stderr, "tok/s=")
    missing = _run("eval", "--data", tmp_path / "missing.txt")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        f"k31jax eval: error: --data {tmp_path / 'missing.txt'}: no such eval data file or folder")


def test_eval_split_of_the_embedded_models_own_corpus(tmp_path):
    """A file corpus.json lists as training data: only the held-out split, at the fraction
    its training used (0.02, from the recorded commands)."""
    corpus = json.loads((embedded_model_dir() / "corpus.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    own = [stdlib / r["path"] for r in corpus["train"][:3]]
    if not all(p.exists() and hashlib.sha256(p.read_bytes()).hexdigest() == r["sha256"]
               for p, r in zip(own, corpus["train"])):
        pytest.skip("this Python's standard library is not the embedded model's corpus")
    data = DataConfig(paths=tuple(map(str, own)), seq_len=32, batch_size=1)
    with pytest.raises(ValueError, match="its training held none of them out"):
        eval_split(data, None, split=None, holdout_fraction=None)
    (tmp_path / "new.txt").write_text("x = 1\n")
    resolved, split, why = eval_split(data, None, split="heldout", holdout_fraction=None)
    assert (split, resolved.holdout_fraction, resolved.holdout_by, why) == ("heldout", 0.02, "document", None)
    mixed = DataConfig(paths=(*map(str, own), str(tmp_path / "new.txt")), seq_len=32, batch_size=1)
    _, split, why = eval_split(mixed, None, split=None, holdout_fraction=0.9)
    assert split == "heldout" and "3 of the 4 files are training data of the embedded model" in why


def test_eval_split_of_a_runs_own_data(tmp_path):
    (tmp_path / "a.txt").write_text(STDLIB_TEXT)
    (tmp_path / "b.txt").write_text("something else entirely\n" * 50)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    data = DataConfig(paths=(str(tmp_path / "a.txt"),), seq_len=32, batch_size=1, holdout_fraction=0.2,
                      holdout_by="chunk")
    cfg = TrainConfig(out=str(run), data=data, optim=OptimConfig(warmup_steps=0, total_steps=1), steps=1)
    cfg.save(run / "run.json")
    copy = tmp_path / "copy.txt"  # the same bytes under another name are the same training data
    copy.write_text(STDLIB_TEXT)
    base = DataConfig(paths=(str(copy),), seq_len=32, batch_size=1)
    resolved, split, why = eval_split(base, run, split=None, holdout_fraction=None)
    assert split == "heldout" and (resolved.holdout_fraction, resolved.holdout_by) == (0.2, "chunk")
    assert f"training data of {run}" in why
    other = dataclasses.replace(base, paths=(str(tmp_path / "b.txt"),))
    assert eval_split(other, run, split=None, holdout_fraction=None)[1] == "all"
    # a checkpoint folder records no training data: everything is evaluated
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _, split, why = eval_split(other, folder, split=None, holdout_fraction=None)
    assert split == "all" and "records no training data" in why


# ---------------------------------------------------------------------------- fine-tune, then use
def test_init_embedded_records_its_base_and_generate_takes_the_run(tmp_path):
    """`--init embedded` (the preset name) starts from the shipped model; the run records
    "embedded" as its model; the run folder loads for generation from its newest checkpoint
    (no export yet) and then from final/orbax, with raw completion as the embedded model."""
    (tmp_path / "one_file.txt").write_text(STDLIB_TEXT)
    out = tmp_path / "ft1"
    data = DataConfig(paths=(str(tmp_path / "one_file.txt"),), seq_len=32, batch_size=1)
    cfg = TrainConfig(out=str(out), data=data, optim=OptimConfig(warmup_steps=0, total_steps=1), steps=1, init="embedded")
    with Trainer(cfg) as trainer:
        trainer.save()  # a step-0 checkpoint: what an interrupted run leaves
        run = json.loads((out / "run.json").read_text())
        assert (run["model"], run["init"]) == ("embedded", "embedded")
        assert Path(run["tokenizer"]) == embedded_model_dir()
    with pytest.raises(ValueError, match="is a training run's folder: k31jax.train.load_generation_model loads it"):
        load_model(out)
    loaded = load_generation_model(out)
    assert loaded.raw_completion and "newest checkpoint, step 0" in loaded.banner
    assert "fine-tuned from embedded" in loaded.banner and loaded.model.config.dtype == "float32"
    embedded = load_model()
    assert loaded.model.config.replace(expert_weights="bf16", dtype="float32") == \
        embedded.model.config.replace(expert_weights="bf16")
    with Trainer(dataclasses.replace(cfg, out=str(out)), resume=True) as trainer:
        trainer.export(out / "final")
    loaded = load_generation_model(out)
    assert loaded.raw_completion and f"loading {out / 'final' / 'orbax'}" in loaded.banner
    direct = load_generation_model(out / "final" / "release")
    assert direct.raw_completion and "this export" in direct.banner
    gen = _run("generate", "--ckpt", out, "--prompt", "def f(", "--max-new-tokens", 2)
    assert gen.returncode == 0, gen.stderr
    assert _lines(gen.stderr, f"{out}: a training run (fine-tuned from embedded); loading {out / 'final' / 'orbax'}")
    assert _lines(gen.stderr, "raw completion")


# ---------------------------------------------------------------------------- image processor
def _processor_file(folder: Path, **media) -> Path:
    cfg = {"patch_size": 4, "merge_kernel_size": 2, "in_patch_limit": 300, "patch_limit_on_one_side": 40,
           "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.3, 0.25], "in_patch_limit_each_frame": 4096,
           "fixed_output_tokens": None, "sample_fps": 2.0, **media}
    path = folder / "preprocessor_config.json"
    path.write_text(json.dumps({"media_proc_cfg": {k: v for k, v in cfg.items() if v != "absent"}}))
    return path


@pytest.mark.parametrize("media, message", [
    ({"in_patch_limit": "big"}, r"media_proc_cfg\.in_patch_limit: expected an integer >= 1, got 'big'"),
    ({"patch_limit_on_one_side": 0}, r"media_proc_cfg\.patch_limit_on_one_side: expected an integer >= 1"),
    ({"image_std": [0.5, 0.0, 0.5]}, r"media_proc_cfg\.image_std: expected a list of 3 positive numbers"),
    ({"image_mean": [0.5, 0.5]}, r"media_proc_cfg\.image_mean: expected a list of 3 finite numbers"),
    ({"patch_size": 14}, r"media_proc_cfg\.patch_size: 14 disagrees with the checkpoint's vision_config\.patch_size 4"),
    ({"merge_kernel_size": [2, 3]}, r"media_proc_cfg\.merge_kernel_size: expected one size"),
    ({"fixed_output_tokens": 64}, r"media_proc_cfg\.fixed_output_tokens: 64, expected null"),
])
def test_processor_config_errors_name_the_field(tmp_path, media, message):
    path = _processor_file(tmp_path, **media)
    with pytest.raises(ConfigError, match=f"{path}: {message}"):
        read_processor_config(path, TINY)
    (tmp_path / "preprocessor_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="expected an object with a 'media_proc_cfg' object"):
        read_processor_config(tmp_path / "preprocessor_config.json", TINY)


def test_a_release_preprocessor_config_sets_the_image_processor(tmp_path):
    from helpers.release import release_ready_model
    from k31jax.ckpt._synthetic import write_synthetic_release
    from k31jax.generate import Engine

    model, params = release_ready_model(seed=5, num_hidden_layers=2, layer_types=("kda", "mla"))
    vcfg = dataclasses.replace(TINY, text_hidden_size=model.config.hidden_size)
    weights = {n: v.astype(ml_dtypes.bfloat16).astype(np.float32) for n, v in release_weights(vcfg, seed=9).items()}
    src = write_synthetic_release(tmp_path / "release", model.config.replace(vision=vcfg), params=params,
                                  vision_config=vcfg.to_hf(), vision_params=weights, num_shards=1)
    assert load_model(src, vision=True).vision.processor.in_patch_limit == 65536  # no file: the K3 values
    _processor_file(src, merge_kernel_size="absent")
    loaded = load_model(src, vision=True)
    processor = Engine(loaded.model, loaded.tokenizer, max_len=64, vision=loaded.vision).image_prompts().processor
    assert (processor.patch_size, processor.merge_kernel_size, processor.in_patch_limit,
            processor.patch_limit_on_one_side) == (4, 2, 300, 40)
    assert processor.image_mean == (0.4, 0.5, 0.6) and processor.image_std == (0.2, 0.3, 0.25)
    _processor_file(src, in_patch_limit=-3)
    with pytest.raises(ConfigError, match=r"media_proc_cfg\.in_patch_limit: expected an integer >= 1, got -3"):
        load_model(src, vision=True)


# ---------------------------------------------------------------------------- progress
def test_compiling_note_counts_seconds_then_restores_the_bar():
    out = io.StringIO()
    bar = tqdm(total=3, desc="eval", file=out, mininterval=0)
    with compiling_note(bar):
        time.sleep(2.3)
    bar.update(1)
    bar.close()
    text = out.getvalue().replace("\r", "\n")
    assert "compiling ...:" in text and "compiling ... 1 s" in text and "compiling ... 2 s" in text
    assert text.strip().splitlines()[-1].startswith("eval:")
    silent = tqdm(total=1, file=io.StringIO(), disable=True)
    with compiling_note(silent):  # a disabled bar starts no thread
        pass
