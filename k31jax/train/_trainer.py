"""The training loop: model and data set-up, jitted steps, Orbax checkpoints with bit-exact
resume, metrics, SIGTERM handling, held-out evaluation and the final MXFP4 export.

A run's `out` folder holds `run.json` (the `TrainConfig`), `model_config.json`,
`checkpoints/<step>/` (Orbax `CheckpointManager`: parameters, optimizer state, the data
iterator's position), `metrics.jsonl`, `tb/` (TensorBoard) and, after the last step,
`final/release/` (release safetensors layout, MXFP4 experts when trained with QAT) and
`final/orbax/` (the same weights converted to a k31jax checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from ..chat import TokenizerBase
from ..config import ModelConfig
from ..ckpt import convert, write_synthetic_release
from ..distributed import any_process, barrier, gather_json, host_copy, is_primary, lora_targets, shard_model
from ..generate import DEFAULT_MODEL, embedded_model_dir, load_model
from ..generate import load_tokenizer, tokenizer_dir
from ..nn import (K31ForCausalLM, abstract_model, dequantize_experts, merge_expert_adapters, quantize_experts,
                  with_expert_adapters)
from ..ops import Backends
from ..sharding import activate, logical_to_spec, make_mesh, parse_mesh
from ._config import TrainConfig
from ._data import DataConfig, HoldoutSplit, ShardedIterator, holdout_split, make_dataset, resolved_holdout
from ._distill import distill_setup, distill_step, indexer_recall, with_index_topk
from ._lora import apply_lora, init_lora, lora_shardings, routed_expert_digest, save_adapter
from ._metrics import MetricsLog, compiling_note
from ._optim import (FROZEN, OptimConfig, learning_rate_schedule, make_lora_optimizer, make_optimizer, map_by_path,
                     param_labels)
from ._programs import StepProgram
from ._steps import StepSettings, eval_step, overlay, partition, train_step

RUN_FILE = "run.json"
MODEL_CONFIG_FILE = "model_config.json"
CHECKPOINTS = "checkpoints"
FINAL = "final"  # the finished run's export: final/release (safetensors), final/orbax (k31jax Orbax)
ADAPTER = "adapter"  # and for a LoRA run final/adapter, its adapters alone
SIGTERM_EXIT = 143  # 128 + SIGTERM, after the checkpoint is written

# One program per step for the process: every Trainer (and `evaluate` call) with the same
# static arguments (graphdef, optimizer, settings) and shapes reuses the compiled program.
_TRAIN_STEP = StepProgram(train_step)
_DISTILL_STEP = StepProgram(distill_step)
_EVAL_STEP = jax.jit(eval_step, static_argnums=(0, 1))


# ---------------------------------------------------------------------------- model configs
def config_to_json(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_json(raw: dict) -> ModelConfig:
    return ModelConfig(**{**raw, "layer_types": tuple(raw["layer_types"])})


def with_config(model: K31ForCausalLM, cfg: ModelConfig) -> K31ForCausalLM:
    """The model's parameters under another config of the same shapes (dtype, QAT switches),
    each cast to the dtype the new config gives it."""
    graphdef, target = nnx.split(abstract_model(cfg))
    values = nnx.to_pure_dict(nnx.state(model))
    cast = jax.tree.map(lambda v, t: jnp.asarray(v, t.dtype), values, nnx.to_pure_dict(target))
    nnx.replace_by_pure_dict(target, cast)
    return nnx.merge(graphdef, target)


def training_form(model: K31ForCausalLM, cfg: TrainConfig) -> K31ForCausalLM:
    """The master dtype and the QAT switches; routed experts as float masters (QAT trains
    those), except under LoRA: its base is frozen and its adapters leave the routed experts
    alone, so packed MXFP4 experts stay packed (a quarter of bf16's bytes; the forward pass
    decodes each layer's experts as it uses them, and the export keeps their bytes)."""
    packed = model.config.expert_weights == "mxfp4"
    if packed and not cfg.lora_rank:
        model = dequantize_experts(model)
        packed = False
    acts = "mxfp8" if cfg.mxfp8_activations else "bf16"
    model = with_config(model, model.config.replace(dtype=cfg.dtype, expert_qat=cfg.qat and not packed,
                                                    expert_activations=acts))
    return with_expert_adapters(model, cfg.lora_rank) if packed and cfg.lora_experts else model


def split_for_training(state: nnx.State, optim: OptimConfig):
    """(frozen rest, trained sub-dict, optimizer over the trained leaves only) of a model's
    state: `train_step` takes the first two, `overlay(rest, trained)` is the model."""
    labels = {}
    map_by_path(lambda path, label: labels.__setitem__(path, label),
                param_labels(state, optim.trainable, optim.optimizer))
    rest, trained = partition(nnx.to_pure_dict(state), lambda path: labels[path] != FROZEN)
    if not trained:
        raise ValueError(f"trainable={optim.trainable!r} selects no parameter of this model")
    variables = dict(nnx.to_flat_state(state))
    trained_state = nnx.from_flat_state({path: variables[path] for path in variables
                                        if labels["/".join(map(str, path))] != FROZEN})
    return rest, trained, make_optimizer(optim, trained_state)


# ---------------------------------------------------------------------------- runs on disk
def is_run(path: str | os.PathLike) -> bool:
    return (Path(path) / RUN_FILE).exists() and (Path(path) / CHECKPOINTS).is_dir()


def read_run(path: str | os.PathLike) -> TrainConfig:
    """The `TrainConfig` a run folder records."""
    return TrainConfig.from_json(json.loads((Path(path) / RUN_FILE).read_text()))


def _manager(out: Path, keep: int | None = None, *, read_only: bool = False) -> ocp.CheckpointManager:
    # read_only: restore only; Orbax's own read_only mode logs warnings on every use
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=not read_only,
                                           create=not read_only)
    return ocp.CheckpointManager(out.absolute() / CHECKPOINTS, options=options,  # Orbax takes absolute paths only
                                 item_names=("params", "opt_state", "trainable", "data"))


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def load_run(path: str | os.PathLike, step: int | None = None):
    """(model, tokenizer, step) from a training run's `out` folder (its newest checkpoint)."""
    out = Path(path)
    run = read_run(out)
    model_cfg = config_from_json(json.loads((out / MODEL_CONFIG_FILE).read_text()))
    mgr = _manager(out, read_only=True)
    step = mgr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{out / CHECKPOINTS}: the run has no checkpoint yet")
    graphdef, state = nnx.split(abstract_model(model_cfg))
    if run.lora_rank:  # the whole base model + the adapters, merged
        params = nnx.to_pure_dict(state)
        trained = jax.eval_shape(lambda: init_lora(state, lora_targets(run.lora_experts), run.lora_rank, run.lora_alpha,
                                                   jax.random.key(0)))
    else:  # the frozen rest + the trained leaves, overlaid
        params, trained, _ = split_for_training(state, run.optim)
    # onto this process's first device, whatever the topology that saved it (a run trained on
    # several processes or a mesh restores here whole)
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def target(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here), tree)

    restored = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target(params)),
                                                         trainable=ocp.args.StandardRestore(target(trained))))
    mgr.close()
    merge = apply_lora if run.lora_rank else overlay
    model = nnx.merge(graphdef, merge(restored["params"], restored["trainable"]))
    return model, load_tokenizer(run.tokenizer, model_cfg.vocab_size), step


def is_embedded(ckpt: str | os.PathLike | None) -> bool:
    """Whether `ckpt` names the shipped embedded model: its preset name (when no folder of
    that name is in the way) or its folder."""
    if ckpt is None:
        return False
    path = Path(ckpt)
    return (str(ckpt) == DEFAULT_MODEL and not path.exists()) or (
        path.is_dir() and path.resolve() == embedded_model_dir().resolve())


def base_model(init: str | os.PathLike) -> str:
    """The identity a run started from `init` records as its `model`: "embedded" for the
    shipped model, an earlier run's own `model`, else the checkpoint folder."""
    if is_embedded(init):
        return DEFAULT_MODEL
    return read_run(init).model if is_run(init) else str(init)


def load_any(ckpt: str | os.PathLike | None, *, tokenizer: str | None = None):
    """(model, tokenizer, description) from a training run, a converted Orbax checkpoint, a
    release safetensors folder, or (None or "embedded") the embedded default model."""
    if ckpt is not None and is_run(ckpt):
        model, tok, step = load_run(ckpt)
        return model, tok, f"{ckpt} (step {step})"
    loaded = load_model(None if is_embedded(ckpt) else ckpt, tokenizer=tokenizer)
    return loaded.model, loaded.tokenizer, loaded.source


def _tokenizer_dir(cfg: TrainConfig) -> str | None:
    """`cfg.tokenizer`, else the folder of the `init` checkpoint's own `tiktoken.model` (a
    run's recorded tokenizer, the folder itself, or a converted Orbax checkpoint's copy of the
    release's files); None: byte-level."""
    if cfg.tokenizer is not None or cfg.init is None:
        return cfg.tokenizer
    if is_embedded(cfg.init):
        return str(embedded_model_dir())
    init = Path(cfg.init)
    if is_run(init):
        return read_run(init).tokenizer
    folder = tokenizer_dir(init)
    return None if folder is None else str(folder)


def _initial_model(cfg: TrainConfig) -> tuple[K31ForCausalLM, TokenizerBase]:
    if cfg.init is not None:
        model, tok, _ = load_any(cfg.init, tokenizer=cfg.tokenizer)
        return model, tok
    path = Path(cfg.model)
    model_cfg = ModelConfig.from_hf(path) if path.exists() else ModelConfig.preset(cfg.model)
    model = K31ForCausalLM(model_cfg.replace(dtype=cfg.dtype), rngs=nnx.Rngs(cfg.seed))
    return model, load_tokenizer(cfg.tokenizer, model_cfg.vocab_size)


# ---------------------------------------------------------------------------- evaluation
@dataclasses.dataclass(frozen=True)
class EvalResult:
    loss: float            # nats per trained token
    bits_per_byte: float   # loss in bits summed over tokens / UTF-8 bytes of their text
    tokens: int
    bytes: int
    batches: int

    def line(self) -> str:
        return (f"loss {self.loss:.4f} nats/token, {self.bits_per_byte:.4f} bits/byte "
                f"({self.tokens:,} tokens, {self.bytes:,} bytes, {self.batches} batches)")


def evaluate(model: K31ForCausalLM, tokenizer: TokenizerBase, data: DataConfig, *, max_batches: int | None = None,
             backends: Backends | None = None, split: str = "heldout", progress: bool = False,
             mesh=None) -> EvalResult:
    """Held-out loss and bits per byte of `model` over `data`'s `split` (every batch, or the
    first `max_batches`). `progress`: a tqdm bar on stderr ("compiling ..." during the first
    batch, then batches and evaluated tokens per second; process 0's only).

    `mesh` (the one `model` is sharded on, under `sharding.activate`): each batch's rows are
    split over its batch axes; with several processes each keeps only its rows of every
    batch (`DataConfig.batch_size` counts all of them), and every process returns the same
    totals. Without a mesh the run must be one
    process."""
    if jax.process_count() > 1 and mesh is None:
        raise ValueError("evaluating on several processes needs a mesh spanning every process's devices (--mesh)")
    data = dataclasses.replace(data, num_processes=jax.process_count(), process_index=jax.process_index())
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    settings = StepSettings(backends=backends or Backends())
    step = _EVAL_STEP
    sums = dict(nll_sum=0.0, tokens=0.0, correct=0.0, bytes=0.0)
    batches = 0
    bar = tqdm(total=max_batches, desc=f"eval ({split})", unit="batch", dynamic_ncols=True,
               disable=not (progress and is_primary()))
    measured_tokens, measured_since = 0.0, 0.0  # tokens/s after the first (compiling) batch
    with bar:
        for batch in make_dataset(data, tokenizer, split):
            if max_batches is not None and batches >= max_batches:
                break
            arrays = _global_batch(mesh, batch)
            if batches == 0:
                with compiling_note(bar):
                    out = host_copy(step(graphdef, settings, params, arrays))
                measured_since = time.perf_counter()
            else:
                out = host_copy(step(graphdef, settings, params, arrays))
                measured_tokens += float(out["tokens"])
                bar.set_postfix({"tok/s": f"{measured_tokens / (time.perf_counter() - measured_since):.4g}"},
                                refresh=False)
            sums = {k: sums[k] + float(out[k]) for k in sums}
            batches += 1
            bar.update(1)
    if not sums["tokens"]:
        raise ValueError(f"the {split} split of {list(data.paths)} has no trained tokens")
    return EvalResult(loss=sums["nll_sum"] / sums["tokens"],
                      bits_per_byte=sums["nll_sum"] / (math.log(2) * sums["bytes"]),
                      tokens=int(sums["tokens"]), bytes=int(sums["bytes"]), batches=batches)


# ---------------------------------------------------------------------------- the trainer
@dataclasses.dataclass
class TrainResult:
    step: int
    interrupted: bool
    last_metrics: dict
    eval: EvalResult | None
    final_dir: Path | None


class Trainer:
    """Build everything for `cfg`; `run()` trains to `cfg.steps` (resuming when asked)."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, progress: bool = True):
        # the run records (and its export carries) the tokenizer it was trained with, the
        # base model it started from (its loaders take that model's defaults) and how its
        # held-out split was made
        cfg = dataclasses.replace(cfg, tokenizer=_tokenizer_dir(cfg), data=resolved_holdout(cfg.data))
        if cfg.init is not None:
            cfg = dataclasses.replace(cfg, model=base_model(cfg.init))
        self.cfg = cfg
        self.out = Path(cfg.out)
        if jax.process_count() > 1 and not cfg.mesh:
            raise ValueError("multi-process training needs a --mesh spanning every process's devices")
        self._check_out(resume)
        barrier("k31jax-train-checked")  # no process checks `out` after process 0 began writing it
        self.out.mkdir(parents=True, exist_ok=True)
        model, self.tokenizer = _initial_model(cfg)
        if cfg.index_topk is not None:
            model = with_index_topk(model, cfg.index_topk)
        model = training_form(model, cfg)
        self.model_config = model.config
        self.mesh = make_mesh(parse_mesh(cfg.mesh)) if cfg.mesh else None
        if self.mesh is not None:
            model = shard_model(model, self.mesh, cfg.rules)
        self.graphdef, state = nnx.split(model)
        self.params = nnx.to_pure_dict(state)
        if cfg.lora_rank:
            def fresh():
                return init_lora(state, lora_targets(cfg.lora_experts), cfg.lora_rank, cfg.lora_alpha,
                                 jax.random.key(cfg.seed))
            # made where the step takes them (split as their weights), never whole on one device
            where = None if self.mesh is None else lora_shardings(jax.eval_shape(fresh), state, self.mesh, cfg.rules)
            self.trainable = jax.jit(fresh, out_shardings=where)()
            self.tx = make_lora_optimizer(cfg.optim)
        else:
            self.params, self.trainable, self.tx = split_for_training(state, cfg.optim)
        self.opt_state = jax.jit(self.tx.init)(self.trainable)
        if self.mesh is not None:
            self.trainable, self.opt_state = _on_mesh(self.mesh, (self.trainable, self.opt_state))
        self.settings = StepSettings(
            backends=Backends(), remat=cfg.remat, vocab_chunk=cfg.vocab_chunk, z_loss=cfg.z_loss,
            balance_loss=cfg.balance_loss,
            # LoRA freezes the whole base, the router's selection bias too, so that the
            # adapters alone (the `adapter` export) reproduce the trained model
            bias_update_rate=0.0 if cfg.lora_rank else cfg.bias_update_rate,
            lora_scale=cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else None)
        self._step_fn = _TRAIN_STEP
        self._step_graphdef = self.graphdef
        if cfg.distill_indexer:  # the same contract as train_step; the dense warm-up runs selection off
            self._step_graphdef, self.settings = distill_setup(model, cfg)
            self._step_fn = _DISTILL_STEP
        # multi-host (after `k31jax.distributed.initialize`): each process keeps its slice of
        # every global batch (reading only its data shards' documents), assembled into one
        # global array on the mesh. The global batch does not depend on the process count,
        # and neither does the saved state (every shard's position), so a checkpoint resumes
        # on another number of processes.
        data = dataclasses.replace(cfg.data, num_processes=jax.process_count(), process_index=jax.process_index())
        self.data_iter = iter(make_dataset(data, self.tokenizer, "train"))
        self.holdout: HoldoutSplit = holdout_split(cfg.data)
        self.evaluates = bool(self.holdout.heldout)  # none: train without evaluation
        self.step = 0
        self.manager = _manager(self.out, cfg.keep)
        if resume:
            self._restore()
        elif is_primary():
            cfg.save(self.out / RUN_FILE)
            (self.out / MODEL_CONFIG_FILE).write_text(json.dumps(config_to_json(self.model_config), indent=2))
        self._stop_signal: int | None = None

    # ---- set-up helpers
    def _check_out(self, resume: bool) -> None:
        run_file = self.out / RUN_FILE
        if resume:
            if not run_file.exists():
                raise FileNotFoundError(f"--resume: {self.out} holds no training run ({RUN_FILE} missing)")
            saved = read_run(self.out)
            saved = dataclasses.replace(saved, data=resolved_holdout(saved.data))  # runs before it was recorded
            keep_same = ("data", "optim", "model", "init", "dtype", "qat", "mxfp8_activations", "grad_accum",
                         "lora_rank", "lora_alpha", "lora_experts", "seed", "vocab_chunk", "z_loss", "bias_update_rate",
                         "balance_loss", "distill_indexer")
            # with `init` the model is the init's (runs before the base was recorded say "tiny")
            changed = [f for f in keep_same if getattr(saved, f) != getattr(self.cfg, f)
                       and not (f == "model" and saved.init is not None)]
            if changed:
                raise ValueError(f"--resume: {self.out} was trained with other settings for {changed}; resume "
                                 "with the same ones (only --steps, saving, logging and eval may change)")
        elif run_file.exists() or (self.out / CHECKPOINTS).exists():
            raise FileExistsError(f"{self.out} already holds a training run: pass --resume to continue it, "
                                  "or choose another --out")

    def _restore(self) -> None:
        step = self.manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"--resume: {self.out / CHECKPOINTS} has no checkpoint")
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(self.params)),
            opt_state=ocp.args.StandardRestore(_abstract(self.opt_state)),
            trainable=ocp.args.StandardRestore(_abstract(self.trainable)),
            data=ocp.args.JsonRestore()))
        self.params, self.opt_state, self.trainable = restored["params"], restored["opt_state"], restored["trainable"]
        self.data_iter.set_state(restored["data"])
        self.step = step

    def save(self) -> None:
        data = self.data_iter.get_state()
        if isinstance(self.data_iter, ShardedIterator):  # each process holds its shards' positions
            data = ShardedIterator.merge_states(gather_json(data))
        self.manager.save(self.step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(self.params), opt_state=ocp.args.StandardSave(self.opt_state),
            trainable=ocp.args.StandardSave(self.trainable),
            data=ocp.args.JsonSave(data)), force=True)

    def _next_batch(self) -> dict[str, jax.Array]:
        micro = [next(self.data_iter) for _ in range(self.cfg.grad_accum)]
        return _global_batch(self.mesh, {k: np.stack([m[k] for m in micro]) for k in micro[0]}, micro_batches=True)

    def model(self) -> K31ForCausalLM:
        """The current model (LoRA adapters merged)."""
        params = (apply_lora(self.params, self.trainable) if self.cfg.lora_rank
                  else overlay(self.params, self.trainable))
        return nnx.merge(self.graphdef, params)

    def train_steps(self, n: int) -> list[dict]:
        """`n` optimizer steps; the metrics of each (host values)."""
        out = []
        for _ in range(n):
            batch = self._next_batch()
            self.params, self.opt_state, self.trainable, metrics = self._step_fn(
                self._step_graphdef, self.tx, self.settings, self.params, self.opt_state, self.trainable, batch)
            self.step += 1
            out.append(host_copy(metrics))
        return out

    # ---- the loop
    def close(self) -> None:
        """Finish pending checkpoint writes and release the manager and the data readers."""
        self.manager.wait_until_finished()
        self.manager.close()
        self.data_iter = None

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, *, progress: bool = True, export: bool = True) -> TrainResult:
        cfg = self.cfg
        log = MetricsLog(self.out, resume_step=self.step, progress_total=cfg.steps, progress=progress,
                         writes=is_primary())
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM,)}
        schedule = learning_rate_schedule(cfg.optim)
        tokens_per_step = cfg.grad_accum * cfg.data.batch_size * cfg.data.seq_len
        last: dict = {}
        evaluation = None
        try:
            with activate(self.mesh, cfg.rules) if self.mesh is not None else contextlib.nullcontext():
                t0, since = time.perf_counter(), 0
                first, interrupted = self.step, False
                while self.step < cfg.steps:
                    # a signal reaches one process; every process stops at the same step
                    interrupted = any_process(self._stop_signal is not None)
                    if interrupted:
                        break
                    with log.compiling() if self.step == first else contextlib.nullcontext():
                        (metrics,) = self.train_steps(1)
                    since += 1
                    last = dict(metrics, learning_rate=float(schedule(self.step - 1)))
                    if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                        dt = time.perf_counter() - t0
                        last["tokens_per_s"] = since * tokens_per_step / dt
                        log.write(self.step, last)
                        shown = {"loss": float(last["loss"]), "tok/s": last["tokens_per_s"]}
                        if "indexer_kl" in last:
                            shown["kl"] = float(last["indexer_kl"])
                        log.progress(since, shown)
                        t0, since = time.perf_counter(), 0
                    if (self.evaluates and cfg.eval_every and self.step % cfg.eval_every == 0
                            and self.step < cfg.steps):
                        self._held_out(log, progress)
                    if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                        self.save()
                if not interrupted:  # a signal during the last step stops before evaluation and export
                    interrupted = any_process(self._stop_signal is not None)
                if interrupted and self.manager.latest_step() != self.step:
                    self.save()
                self.manager.wait_until_finished()
                final = None
                if not interrupted:
                    if self.evaluates:
                        evaluation = self._held_out(log, progress)
                    if export:
                        final = self.export(self.out / FINAL)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            log.close()
        return TrainResult(self.step, interrupted, last, evaluation, final)

    def _held_out(self, log: MetricsLog, progress: bool) -> EvalResult:
        """Held-out loss (and, distilling, the indexers' recall at `index_topk`), logged."""
        cfg, model = self.cfg, self.model()
        ev = evaluate(model, self.tokenizer, cfg.data, max_batches=cfg.eval_batches, progress=progress,
                      mesh=self.mesh)
        row = {"eval_loss": ev.loss, "eval_bits_per_byte": ev.bits_per_byte}
        if cfg.distill_indexer and self.model_config.index_topk < cfg.data.seq_len:
            rec = indexer_recall(model, self.tokenizer, cfg.data, top_k=self.model_config.index_topk,
                                 max_batches=cfg.eval_batches)
            row.update(eval_indexer_recall=rec.recall, eval_indexer_kl=rec.kl)
        log.write(self.step, row)
        return ev

    def _on_signal(self, signum, frame) -> None:
        self._stop_signal = signum

    def export(self, where: Path) -> Path:
        """The trained weights twice: the release safetensors layout (routed experts packed to
        MXFP4 with the floor rule QAT trained against, when `qat`), and that release converted
        to a k31jax Orbax checkpoint. Non-expert weights are stored in bf16, as the release.
        With several processes, each gathers the weights and process 0 writes them.

        A LoRA run's release is its adapters merged (adapters on packed experts merged and
        re-rounded to MXFP4: `merge_expert_adapters`), and `where/adapter` holds the adapters
        alone (`save_adapter`; `k31jax generate --lora`), for the base's bytes as they are."""
        model = self.model()
        if model.config.expert_adapter_rank:
            model = merge_expert_adapters(model)
        if self.cfg.qat and model.config.moe_layers and model.config.expert_weights != "mxfp4":
            model = quantize_experts(model)
        release_cfg = model.config.replace(dtype="bfloat16", expert_qat=False, expert_activations="bf16")
        params = host_copy(nnx.to_pure_dict(nnx.state(with_config(model, release_cfg))))
        adapter = host_copy(self.trainable) if self.cfg.lora_rank else None
        if is_primary():
            self._write_export(where, release_cfg, params)
            if adapter is not None:
                save_adapter(adapter, where / ADAPTER, targets=lora_targets(self.cfg.lora_experts),
                             base=self.cfg.init or self.cfg.model, base_experts=routed_expert_digest(self.params))
        barrier("k31jax-train-exported")
        return where

    def _write_export(self, where: Path, release_cfg: ModelConfig, params) -> None:
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f".release.tmp-{os.getpid()}"  # written whole, then renamed into place
        shutil.rmtree(tmp, ignore_errors=True)
        write_synthetic_release(tmp, release_cfg, params=params)
        for name in ("tiktoken.model", "tokenizer_config.json"):
            src = Path(self.cfg.tokenizer or "") / name
            if self.cfg.tokenizer and src.exists():
                shutil.copyfile(src, tmp / name)
        release = where / "release"
        shutil.rmtree(release, ignore_errors=True)
        os.replace(tmp, release)
        if jax.process_count() == 1:
            convert(release, where / "orbax", progress=False, overwrite=True)
            return
        # Orbax makes every process of a `jax.distributed` job take part in a save (it
        # broadcasts from process 0 whatever the save's own process set), and the others are
        # not converting: process 0 converts in a process of its own.
        done = subprocess.run(
            [sys.executable, "-c", "import sys; from k31jax.ckpt import convert; "
             "convert(sys.argv[1], sys.argv[2], progress=False, overwrite=True)", str(release), str(where / "orbax")],
            env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise OSError(f"converting the export {release} to {where / 'orbax'} failed: {last}")


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, export: bool = True) -> TrainResult:
    """Train (or resume) the run `cfg` describes; see `Trainer`."""
    with Trainer(cfg, resume=resume) as trainer:
        return trainer.run(progress=progress, export=export)


def _on_mesh(mesh, tree):
    """`tree` with every leaf that lives off `mesh` (the optimizer's step counter, made on the
    default device) replicated over it: a step under the mesh takes arguments on its devices
    only. The value is the same on every process, so each places its own copy."""
    devices = set(mesh.devices.flat)
    everywhere = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: a if a.sharding.device_set == devices else jax.device_put(np.asarray(a), everywhere),
                        tree)


def _batch_sharding(mesh, rows: int, seq_len: int, rules=None, *, micro_batches: bool = True) -> NamedSharding:
    """Where a `[grad_accum, rows, seq_len]` batch (`micro_batches`, else `[rows, seq_len]`)
    lives: rows split over the batch axes where they divide (`rules`, default the active
    ones), the micro-batches and tokens whole."""
    spec = logical_to_spec(("batch", "seq"), (rows, seq_len), dict(mesh.shape), rules)
    return NamedSharding(mesh, P(None, *spec) if micro_batches else P(*spec))


def _global_batch(mesh, batch: dict[str, np.ndarray], *, micro_batches: bool = False) -> dict[str, jax.Array]:
    """This process's rows of a batch (`[grad_accum,] rows, seq_len`) as the global batch on
    `mesh` (without a mesh: on the default device)."""
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    shape = batch["tokens"].shape
    rows = shape[-2] * jax.process_count()  # the global batch's rows
    where = _batch_sharding(mesh, rows, shape[-1], micro_batches=micro_batches)
    if jax.process_count() == 1:
        return {k: jax.device_put(v, where) for k, v in batch.items()}
    return {k: jax.make_array_from_process_local_data(where, v) for k, v in batch.items()}


def abstract_train_step(model_config: ModelConfig, mesh, rules=None, *, optim: OptimConfig | None = None,
                        qat: bool = True, master_dtype: str = "float32", remat: str = "full", lora_rank: int = 0,
                        lora_alpha: float = 16.0, lora_experts: bool = False, micro_batch: int = 1, grad_accum: int = 1, seq_len: int = 4096,
                        vocab_chunk: int = 4096, backends: Backends | None = None):
    """`(jitted step, arguments)` of the trainer's step for `model_config` on `mesh`, from
    abstract shapes only: `jitted.lower(*arguments)` is the program `Trainer` runs (float
    master experts, or under LoRA packed MXFP4 ones where the config has them; the trainable
    split or LoRA adapters, the optimizer state; params,
    optimizer state and trainable donated). For ahead-of-time compilation (`k31jax.aot`)."""
    from ..distributed import abstract_state

    optim = optim or OptimConfig(trainable="experts")
    packed = bool(lora_rank) and model_config.expert_weights == "mxfp4"  # as `training_form` keeps them
    cfg = model_config.replace(expert_weights="mxfp4" if packed else "bf16", dtype=master_dtype,
                               expert_qat=qat and bool(model_config.moe_layers) and not packed,
                               expert_adapter_rank=lora_rank if packed and lora_experts else 0)
    graphdef, state = abstract_state(cfg, mesh, rules)
    if lora_rank:
        trainable = jax.eval_shape(lambda: init_lora(state, lora_targets(lora_experts), lora_rank, lora_alpha,
                                                     jax.random.key(0)))
        trainable = jax.tree.map(lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where), trainable,
                                 lora_shardings(trainable, state, mesh, rules))
        params, tx = nnx.to_pure_dict(state), make_lora_optimizer(optim)
    else:
        params, trainable, tx = split_for_training(state, optim)
    replicated = NamedSharding(mesh, P())
    # an optimizer-state leaf that mirrors a trained leaf (same path suffix and shape: moments,
    # momenta) is split like it; the rest (counters, scalars) is replicated
    leaves = {tuple(str(k) for k in path): a for path, a in jax.tree_util.tree_flatten_with_path(trainable)[0]}

    def placed(path, a):
        keys = tuple(str(k) for k in path)
        for n in range(len(keys)):
            twin = leaves.get(keys[n:])
            if twin is not None and twin.shape == a.shape:
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=twin.sharding)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated)

    opt_state = jax.tree_util.tree_map_with_path(placed, jax.eval_shape(tx.init, trainable))
    shape = (grad_accum, micro_batch, seq_len)
    dtypes = dict(tokens=jnp.int32, targets=jnp.int32, loss_mask=jnp.float32, target_bytes=jnp.int32,
                  segment_ids=jnp.int32, positions=jnp.int32)
    where = _batch_sharding(mesh, micro_batch, seq_len, rules)  # as `Trainer` places a batch
    batch = {k: jax.ShapeDtypeStruct(shape, dt, sharding=where) for k, dt in dtypes.items()}
    settings = StepSettings(backends=backends or Backends(), remat=remat, vocab_chunk=vocab_chunk,
                            lora_scale=lora_alpha / lora_rank if lora_rank else None)
    args = (graphdef, tx, settings, params, opt_state, trainable, batch)
    return _TRAIN_STEP.jitted(*args), args
