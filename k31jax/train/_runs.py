"""A trained model's lineage, for the commands that use it: `load_generation_model` (what
`generate`, `chat` and `serve` load for `--ckpt`: any checkpoint, or a training run's folder
with its base model's defaults) and `eval_split` (`eval` evaluates text the model never trained
on whole, and only the held-out part of its own training data).

A run's `run.json` records its `model`: the preset (or config.json) it was built from, or with
`init` the base model's identity (`"embedded"` for the shipped model, `base_model`). Runs of
the embedded model take its defaults: float32 weights, and raw completion instead of the chat
format (it has seen no chat data).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
from pathlib import Path

from flax import nnx

from ..generate import DEFAULT_MODEL, LoadedModel, embedded_model_dir, load_model
from ..nn import reconfigure
from ._data import DataConfig, data_files, holdout_split
from ._lora import load_adapter, routed_expert_digest, with_adapter
from ._trainer import FINAL, is_embedded, is_run, load_run, read_run, with_config

_EMBEDDED_DEFAULT_DTYPE = "float32"


def run_of(path: str | os.PathLike) -> Path | None:
    """The training run `path` belongs to: the run folder itself, or the run whose export
    (`final/orbax`, `final/release`) it is; None if neither."""
    p = Path(path)
    if is_run(p):
        return p
    run = p.parent.parent
    return run if p.parent.name == FINAL and is_run(run) else None


def _final_export(run: Path) -> Path | None:
    """The run's finished export, the Orbax copy first (faster to load); None if it has none
    (trained with --no-export, or interrupted)."""
    orbax, release = run / FINAL / "orbax", run / FINAL / "release"
    if (orbax / "_CHECKPOINT_METADATA").exists():
        return orbax
    return release if (release / "config.json").exists() else None


def load_generation_model(ckpt: str | os.PathLike | None = None, *, config: str | None = None, seed: int = 0,
                          dtype: str | None = None, tokenizer: str | os.PathLike | None = None,
                          vision: bool | None = None, expert_activations: str | None = None,
                          lora: str | os.PathLike | None = None) -> LoadedModel:
    """`k31jax.generate.load_model`, and also a training run: its folder (the final export, or
    without one the newest checkpoint) or its export's folder. The run's base model sets the
    defaults (the embedded model's: float32, raw completion), and `banner` says what was
    loaded.

    lora: a LoRA adapter folder (a LoRA run's `final/adapter`, `save_adapter`) applied to the
    model: merged into its float weights and run beside its packed routed experts (their bytes
    untouched). Without `ckpt` the adapter's own base is loaded; a base whose packed experts
    differ from the ones the adapter was trained on is refused."""
    if lora is None:
        return _load_generation_model(ckpt, config=config, seed=seed, dtype=dtype, tokenizer=tokenizer,
                                      vision=vision, expert_activations=expert_activations)
    adapter, meta = load_adapter(lora)
    if ckpt is None and not is_embedded(meta["base"]):
        ckpt = meta["base"]
    loaded = _load_generation_model(ckpt, config=config, seed=seed, dtype=dtype, tokenizer=tokenizer, vision=vision,
                                    expert_activations=expert_activations)
    expected, found = meta.get("base_routed_experts_sha256"), routed_expert_digest(nnx.state(loaded.model))
    if expected is not None and found != expected:
        raise ValueError(f"{lora}: the adapter was trained on {meta['base']} (packed experts sha256 "
                         f"{expected[:16]}), but this model's packed experts are {'absent' if found is None else found[:16]}")
    loaded.model = with_adapter(loaded.model, adapter)
    beside = " (beside the packed routed experts)" if loaded.model.config.expert_adapter_rank else ""
    loaded.banner = (f"{loaded.banner}; " if loaded.banner else "") + (
        f"LoRA adapter {lora}: rank {adapter.rank} on {len(adapter.a)} weights{beside}")
    return loaded


def _load_generation_model(ckpt, *, config, seed, dtype, tokenizer, vision, expert_activations) -> LoadedModel:
    run_dir = None if ckpt is None else run_of(ckpt)
    if run_dir is None:
        return load_model(ckpt, config=config, seed=seed, dtype=dtype, tokenizer=tokenizer, vision=vision,
                          expert_activations=expert_activations)
    run = read_run(run_dir)
    embedded_family = run.model == DEFAULT_MODEL
    dtype = dtype or (_EMBEDDED_DEFAULT_DTYPE if embedded_family else None)
    tokenizer = tokenizer or run.tokenizer
    export = _final_export(run_dir) if Path(ckpt) == run_dir else Path(ckpt)
    if export is not None:
        loaded = load_model(export, dtype=dtype, tokenizer=tokenizer, vision=vision,
                            expert_activations=expert_activations)
        what = str(export) if export != Path(ckpt) else "this export"
    else:
        if vision:
            raise ValueError(f"{run_dir}: a training checkpoint has no vision tower; image inputs need a "
                             "checkpoint with one")
        model, tok, step = load_run(run_dir)
        if dtype is not None and dtype != model.config.dtype:
            model = with_config(model, model.config.replace(dtype=dtype))
        if expert_activations is not None:
            model = reconfigure(model, expert_activations=expert_activations)
        loaded = LoadedModel(model, tok, f"{run_dir} (step {step})")
        what = f"its newest checkpoint, step {step} (the run has no {FINAL}/ export)"
    base = f"fine-tuned from {run.model}" if run.init is not None else f"trained from --config {run.model}"
    loaded.banner = f"{ckpt}: a training run ({base}); loading {what}"
    loaded.raw_completion = embedded_family
    return loaded


# ---------------------------------------------------------------------------- evaluation data
@dataclasses.dataclass(frozen=True)
class TrainingFiles:
    """The files a model was trained on, as its checkpoint records them, and how its training
    made the held-out split. `by_size`: file size -> SHA-256 digests (recorded) or paths
    (hashed when an evaluated file has their size)."""

    owner: str
    by_size: dict[int, list[str | Path]]
    holdout: dict[str, object]  # DataConfig's holdout_fraction, holdout_seed, holdout_by, chunk_chars

    def contains(self, path: Path) -> bool:
        candidates = self.by_size.get(path.stat().st_size, [])
        if not candidates:
            return False
        digest = _sha256(path)
        return any(digest == (_sha256(c) if isinstance(c, Path) else c) for c in candidates)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _embedded_training_files() -> TrainingFiles:
    """From the embedded model's `corpus.json`: its training files and the holdout fraction
    its training commands used (recorded there)."""
    corpus = json.loads((embedded_model_dir() / "corpus.json").read_text())
    by_size: dict[int, list[str | Path]] = {}
    for row in corpus["train"]:
        by_size.setdefault(row["bytes"], []).append(row["sha256"])
    fractions = {words[words.index("--holdout-fraction") + 1] for words in map(shlex.split, corpus["command"])
                 if "--holdout-fraction" in words}
    if len(fractions) != 1:
        raise ValueError(f"{embedded_model_dir() / 'corpus.json'}: expected one --holdout-fraction in its "
                         f"training commands, found {sorted(fractions)}")
    holdout = dict(holdout_fraction=float(fractions.pop()), holdout_seed=0, holdout_by="document",
                   chunk_chars=DataConfig.chunk_chars)
    return TrainingFiles("the embedded model", by_size, holdout)


def training_files(ckpt: str | os.PathLike | None) -> TrainingFiles | str:
    """What `ckpt` (None: the embedded model) was trained on; a string says why that is not
    known (a checkpoint records no training data; a run's data has moved)."""
    if ckpt is None or is_embedded(ckpt):
        return _embedded_training_files()
    run_dir = run_of(ckpt)
    if run_dir is None:
        return f"{ckpt} records no training data"
    data = read_run(run_dir).data
    try:
        files = data_files(data.paths)
    except (FileNotFoundError, ValueError):
        return f"the training data of {run_dir} ({', '.join(data.paths)}) is no longer all there"
    by_size: dict[int, list[str | Path]] = {}
    for f in files:
        by_size.setdefault(f.stat().st_size, []).append(f)
    holdout = {k: getattr(data, k) for k in ("holdout_fraction", "holdout_seed", "holdout_by", "chunk_chars")}
    return TrainingFiles(str(run_dir), by_size, holdout)


def eval_split(data: DataConfig, ckpt: str | os.PathLike | None, *, split: str | None,
               holdout_fraction: float | None) -> tuple[DataConfig, str, str | None]:
    """(data with the holdout settings to use, the split, a line saying why it was chosen or
    None when `split` was given). Without `split`: "heldout" when some evaluated file is the
    model's own training data, with the model's training holdout settings (its held-out part is
    what it never trained on), else "all". `holdout_fraction` (given) wins over the model's."""
    known = training_files(ckpt)
    if isinstance(known, TrainingFiles):
        data = dataclasses.replace(data, **known.holdout)
    if holdout_fraction is not None:
        data = dataclasses.replace(data, holdout_fraction=holdout_fraction)
    if split is not None:
        return data, split, None
    if isinstance(known, str):
        return data, "all", f"eval split: all ({known}; --split heldout evaluates the hash-held-out documents only)"
    files = data_files(data.paths)
    own = sum(known.contains(f) for f in files)
    counted = f"{len(files)} file{'s' if len(files) != 1 else ''}"
    if not own:
        return data, "all", f"eval split: all ({counted}, none of them training data of {known.owner})"
    if not holdout_split(data).heldout:
        raise ValueError(f"{own} of the {counted} are training data of {known.owner}, and its training held none "
                         f"of them out ({data.holdout_by} split at holdout_fraction {data.holdout_fraction}); "
                         "--split all evaluates them anyway (text it trained on)")
    return data, "heldout", (
        f"eval split: heldout ({own} of the {counted} are training data of {known.owner}: only what its training "
        f"held out is evaluated, {data.holdout_by} split at holdout_fraction {data.holdout_fraction}; "
        "--split all evaluates everything)")
