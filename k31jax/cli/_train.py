"""`k31jax train`, `k31jax eval` and `k31jax plot`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import threading
from pathlib import Path
from typing import NoReturn

import jax

from ..distributed import is_primary, peer_failure, shard_model, watch_peers
from ..sharding import activate
from ..nn import REMAT_POLICIES, quantize_experts, reconfigure
from ..generate import DEFAULT_MODEL
from ..train import (DISTILL_STAGES, MASTER_DTYPES, OPTIMIZERS, RUN_FILE, SIGTERM_EXIT, TRAINABLE_SETS, DataConfig,
                     OptimConfig, TrainConfig, Trainer, eval_split, evaluate, indexer_recall, load_any, plot_metrics,
                     with_config, with_index_topk)
from ._common import (UsageError, add_distributed_arguments, check_float, check_int, check_mesh_args,
                      enable_compile_cache, initialize_from_args, install, mesh_from_args)

# Settings a resumed run may change; everything else must stay as the run was started. The
# mesh may change too: a checkpoint restores onto another mesh and number of processes.
_RESUMABLE = ("steps", "save_every", "keep", "log_every", "eval_every", "eval_batches", "mesh", "rules")


def _fail(cmd: str, message: str, code: int = 1) -> int:
    print(f"k31jax {cmd}: error: {message}", file=sys.stderr)
    return code


_stopping = threading.Lock()


def _stop_for_lost_peer(cmd: str, line: str) -> NoReturn:
    """A peer process died: say so in one line and leave at once. Returning would run
    `jax.distributed`'s shutdown, which waits for the dead peer and then aborts with a
    multi-line fatal log; the last checkpoint stays the place to resume from. The lock lets
    only the first of the two threads that may notice (the watch, a failed collective) speak."""
    with _stopping:
        print(f"k31jax {cmd}: error: {line}; this process stops too (resume from the last checkpoint with --resume)",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def _lost_peer(cmd: str, error: BaseException, watch) -> None:
    """Stop with one line if `error` is a cross-process collective that lost its peer; else return."""
    line = peer_failure(error)
    if line is None:
        return
    if watch is not None:  # the watch names the dead process, where the collective names an address
        watch.settle(timeout=5)
    _stop_for_lost_peer(cmd, line)


@contextlib.contextmanager
def _peers_watched(cmd: str):
    """`watch_peers` stopping this process with one line when another dies (a no-op alone)."""
    with watch_peers(lambda line: _stop_for_lost_peer(cmd, line)) as watch:
        try:
            yield watch
        except jax.errors.JaxRuntimeError as e:
            _lost_peer(cmd, e, watch)
            raise


def _config_from_args(args) -> TrainConfig:
    data = DataConfig(paths=tuple(args.data), seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
                      holdout_fraction=args.holdout_fraction, shards=args.data_shards or jax.process_count())
    warmup = min(20, args.steps // 10) if args.warmup is None else args.warmup
    optim = OptimConfig(optimizer=args.optimizer, learning_rate=args.lr, warmup_steps=warmup,
                        total_steps=args.steps, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
                        clip_norm=args.clip_norm or None,
                        trainable=args.trainable or ("indexer" if args.distill_indexer else "all"))
    return TrainConfig(out=args.out, data=data, optim=optim, steps=args.steps, model=args.config, init=args.init,
                       tokenizer=args.tokenizer, dtype=args.dtype, qat=args.qat,
                       mxfp8_activations=args.mxfp8_activations, grad_accum=args.grad_accum, remat=args.remat,
                       vocab_chunk=args.vocab_chunk, z_loss=args.z_loss, bias_update_rate=args.bias_update_rate,
                       balance_loss=args.balance_loss, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                       lora_experts=args.lora_experts,
                       save_every=args.save_every, keep=args.keep, log_every=args.log_every,
                       eval_every=args.eval_every, eval_batches=args.eval_batches, mesh=args.mesh,
                       rules=args.rules, seed=args.seed, distill_indexer=args.distill_indexer,
                       index_topk=args.index_topk)


def _resumed_config(args) -> TrainConfig:
    saved = TrainConfig.from_json(json.loads((Path(args.out) / RUN_FILE).read_text()))
    changes = {name: getattr(args, name) for name in _RESUMABLE if getattr(args, name) is not None}
    # the folder as given now: a run folder that was moved or copied resumes where it is
    return dataclasses.replace(saved, out=args.out, **changes)


def _defaults(args: argparse.Namespace) -> None:
    """Defaults of the settings a --resume may override (None: keep the run's own)."""
    for name, value in (("save_every", 100), ("keep", 3), ("log_every", 1), ("eval_every", 0),
                        ("eval_batches", 16)):
        if getattr(args, name, None) is None and not getattr(args, "resume", False):
            setattr(args, name, value)


def _cmd_train(args) -> int:
    _defaults(args)
    enable_compile_cache()
    # several processes: the flags, or K31JAX_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID
    initialize_from_args(args)
    with _peers_watched("train") as watch:
        try:
            return _train(args, watch)
        except (ValueError, FileNotFoundError, FileExistsError, OSError) as e:
            if args.debug:
                raise
            return _fail("train", str(e))


def _train(args, watch) -> int:
    if args.resume:
        if not (Path(args.out) / RUN_FILE).exists():
            return _fail("train", f"--resume: {args.out} holds no training run ({RUN_FILE} missing)")
        cfg = _resumed_config(args)
    else:
        missing = [flag for flag, value in (("--data", args.data), ("--steps", args.steps)) if not value]
        if missing:
            return _fail("train", f"{' and '.join(missing)} required (or --resume an existing --out)", 2)
        cfg = _config_from_args(args)
    with Trainer(cfg, resume=args.resume) as trainer:
        if is_primary():
            print(f"[k31jax] {trainer.holdout.line(trainer.cfg.data.holdout_fraction)}", file=sys.stderr)
        try:
            result = trainer.run(progress=not args.no_progress, export=not args.no_export)
        except jax.errors.JaxRuntimeError as e:  # before closing the checkpoints waits for the dead peer
            _lost_peer("train", e, watch)
            raise
    if not is_primary():  # process 0 reports the run
        return SIGTERM_EXIT if result.interrupted else 0
    if result.interrupted:
        print(f"[k31jax] stopped by a signal at step {result.step}; checkpoint saved, continue with --resume",
              file=sys.stderr)
        return SIGTERM_EXIT
    held_out = f"; held-out {result.eval.line()}" if result.eval else " (no held-out split)"
    kl = result.last_metrics.get("indexer_kl")
    kl = "" if kl is None else f", indexer KL {float(kl):.4f} nats/query"
    print(f"step {result.step}: train loss {float(result.last_metrics['loss']):.4f}{kl}{held_out}")
    if result.final_dir is not None:
        print(f"exported: {result.final_dir / 'release'} (release layout), {result.final_dir / 'orbax'} (k31jax Orbax)")
    return 0


def _cmd_eval(args) -> int:
    enable_compile_cache()
    initialize_from_args(args)
    mesh = mesh_from_args(args)
    if jax.process_count() > 1 and mesh is None:
        return _fail("eval", f"--num-processes {jax.process_count()}: evaluating on several processes needs "
                             "--mesh over every process's devices")
    with _peers_watched("eval"), activate(mesh, args.rules) if mesh is not None else contextlib.nullcontext():
        return _evaluate(args, mesh)


def _evaluate(args, mesh) -> int:
    try:
        model, tokenizer, source = load_any(args.ckpt, tokenizer=args.tokenizer)
        if args.dtype is not None and args.dtype != model.config.dtype:
            model = with_config(model, model.config.replace(dtype=args.dtype))
        if args.quantize_experts:
            if not model.config.moe_layers or model.config.expert_weights == "mxfp4":
                return _fail("eval", "--quantize-experts needs a model with float routed experts")
            model = quantize_experts(model)
        if args.mxfp8_activations:
            model = reconfigure(model, expert_activations="mxfp8")
        data = DataConfig(paths=tuple(args.data), seq_len=args.seq_len, batch_size=args.batch_size)
        data, split, why = eval_split(data, args.ckpt, split=args.split, holdout_fraction=args.holdout_fraction)
        if why and is_primary():
            print(f"[k31jax] {why}", file=sys.stderr)
        recall = None
        if args.indexer_recall:
            if jax.process_count() > 1:
                return _fail("eval", "--indexer-recall runs on one process (drop --num-processes)")
            if not model.config.use_indexer:
                return _fail("eval", "--indexer-recall needs a model with the lightning indexer (index_topk is None)")
            top_k = args.top_k or (max(1, round(args.top_k_fraction * args.seq_len)) if args.top_k_fraction
                                   else model.config.index_topk)
            recall = indexer_recall(model, tokenizer, data, top_k=top_k, max_batches=args.max_batches, split=split)
        if args.index_topk is not None:
            if not model.config.use_indexer:
                return _fail("eval", "--index-topk needs a model with the lightning indexer (index_topk is None)")
            model = with_index_topk(model, args.seq_len if args.index_topk == "dense" else int(args.index_topk))
        if mesh is not None:
            model = shard_model(model, mesh, args.rules)
        result = evaluate(model, tokenizer, data, max_batches=args.max_batches, split=split,
                          progress=not args.no_progress, mesh=mesh)
    except (ValueError, FileNotFoundError, OSError) as e:
        if args.debug:
            raise
        return _fail("eval", str(e))
    if not is_primary():  # process 0 reports the result
        return 0
    what = " (routed experts rounded to MXFP4 after training)" if args.quantize_experts else ""
    if model.config.expert_activations == "mxfp8":
        what += ", routed experts' GEMM inputs in MXFP8"
    if model.config.use_indexer:
        k = model.config.index_topk
        what += (", dense attention (no top-k selection)" if k >= args.seq_len
                 else f", sparse attention (top-{k} of {args.seq_len})")
    print(f"{source}{what}, {split} split of {', '.join(args.data)}: {result.line()}")
    if recall is not None:
        print(f"indexer: {recall.line()}")
    if args.json:
        row = dataclasses.asdict(result) | {"expert_activations": model.config.expert_activations}
        if model.config.use_indexer:
            row["index_topk"] = model.config.index_topk
        if recall is not None:
            row["indexer_recall"] = dataclasses.asdict(recall)
        print(json.dumps(row))
    return 0


def _cmd_plot(args) -> int:
    try:
        out = plot_metrics(args.runs, args.output, keys=tuple(args.keys.split(",")),
                           labels=args.labels.split(",") if args.labels else None)
    except (ValueError, FileNotFoundError, OSError) as e:
        return _fail("plot", str(e))
    print(f"wrote {out}")
    return 0


def register(sub) -> None:
    t = sub.add_parser("train", help="(QAT) fine-tune or train a model; checkpoints, metrics, MXFP4 export",
                       description="Train on text files / JSONL chat transcripts packed into fixed-length rows. "
                                   "Checkpoints every --save-every steps (Orbax, asynchronous), resume bit-exact "
                                   "with --resume; SIGTERM saves and exits 143.")
    t.add_argument("--config", default="tiny", help="preset or config.json for a model from random weights")
    t.add_argument("--init", default=None, help=f"start from a checkpoint: '{DEFAULT_MODEL}' (the shipped model), "
                                                "a converted Orbax or release safetensors folder, or a training "
                                                "run's --out")
    t.add_argument("--tokenizer", default=None, help="folder with tiktoken.model (default: byte-level)")
    t.add_argument("--data", nargs="+", default=None, help="text files, .jsonl chat transcripts or folders")
    t.add_argument("--out", required=True, help="run folder (checkpoints, metrics.jsonl, tb/, final/)")
    t.add_argument("--steps", type=int, default=None, help="optimizer steps in all")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    t.add_argument("--qat", action="store_true", help="fake-quantise routed experts to MXFP4 (straight-through)")
    t.add_argument("--mxfp8-activations", action="store_true", help="also round expert GEMM inputs to MXFP8")
    t.add_argument("--dtype", default="float32", choices=MASTER_DTYPES, help="master weights (default float32)")
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--batch-size", type=int, default=8, help="packed rows per micro-batch, all processes together")
    t.add_argument("--data-shards", type=int, default=None,
                   help="split the training documents into this many streams, each packed on its own, every "
                        "batch taking the same rows from each; a process reads only the shards of its rows. "
                        "Default: the number of processes (kept on --resume, which may use any count)")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--warmup", type=int, default=None, help="warmup steps (default: min(20, steps / 10))")
    t.add_argument("--min-lr-ratio", type=float, default=0.1)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip-norm", type=float, default=1.0, help="global-norm clip (0: off)")
    t.add_argument("--trainable", default=None, choices=TRAINABLE_SETS,
                   help="weights to train (default: all; with --distill-indexer: indexer)")
    t.add_argument("--distill-indexer", nargs="?", const="dense", default=None, choices=DISTILL_STAGES,
                   help="indexer distillation (DeepSeek-V3.2): 'dense' (the default) = the warm-up, the model "
                        "frozen, attention dense, the indexer trained by KL to the layer's attention summed over "
                        "heads; 'sparse' = attention on the model's top-k, the indexer trained by the KL over the "
                        "selection, other --trainable weights by the LM loss. Start from --init; pass --qat to "
                        "export an MXFP4 model's experts packed again")
    t.add_argument("--index-topk", type=int, default=None,
                   help="the indexer's top-k for this run and its export (default: the model's); >= --seq-len "
                        "trains dense attention, the first stage before --distill-indexer")
    t.add_argument("--lora-rank", type=int, default=0, help="> 0: train LoRA adapters only")
    t.add_argument("--lora-alpha", type=float, default=16.0)
    t.add_argument("--lora-experts", action="store_true",
                   help="with --lora-rank: adapters on the routed experts too (beside packed MXFP4 experts, "
                        "whose bytes stay as they are)")
    t.add_argument("--remat", default="none", choices=REMAT_POLICIES)
    t.add_argument("--vocab-chunk", type=int, default=4096)
    t.add_argument("--z-loss", type=float, default=0.0)
    t.add_argument("--bias-update-rate", type=float, default=1e-3, help="router bias sign-update rate (0: off)")
    t.add_argument("--balance-loss", type=float, default=0.0, help="sequence-level balance loss weight")
    t.add_argument("--holdout-fraction", type=float, default=0.05,
                   help="share held out for evaluation (default 0.05): whole documents, or, when there are too few "
                        "documents, chunks of the text (the run records which)")
    t.add_argument("--save-every", type=int, default=None)
    t.add_argument("--keep", type=int, default=None)
    t.add_argument("--log-every", type=int, default=None)
    t.add_argument("--eval-every", type=int, default=None)
    t.add_argument("--eval-batches", type=int, default=None)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--no-export", action="store_true", help="skip the final release / Orbax export")
    t.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    add_distributed_arguments(t, mesh_help="train sharded on this mesh, e.g. fsdp=2,expert=2,tensor=2 (with "
                                           "several processes: over every process's devices)")
    install(t, "train", _cmd_train, validate=_check_train_args)

    e = sub.add_parser("eval", help="held-out loss and bits per byte of a checkpoint (or the embedded model)")
    e.add_argument("--ckpt", default=None, help="training run --out, converted Orbax, or safetensors folder")
    e.add_argument("--tokenizer", default=None)
    e.add_argument("--data", nargs="+", required=True)
    e.add_argument("--split", default=None, choices=("heldout", "all", "train"),
                   help="heldout: what the model's training held out; all: everything (default: heldout when the "
                        "data includes the model's own training files, as a run or the embedded model's "
                        "corpus.json records them, else all)")
    e.add_argument("--holdout-fraction", type=float, default=None,
                   help="the held-out share (default: the model's training run's, else 0.05)")
    e.add_argument("--seq-len", type=int, default=512)
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--max-batches", type=int, default=None)
    e.add_argument("--quantize-experts", action="store_true",
                   help="round float routed experts to MXFP4 first (the post-training-quantisation baseline)")
    e.add_argument("--mxfp8-activations", action="store_true",
                   help="round the routed experts' GEMM inputs to MXFP8, as `generate` / `serve --mxfp8-activations`")
    e.add_argument("--dtype", default=None, choices=MASTER_DTYPES,
                   help="compute dtype (default: the checkpoint's; a release folder is bfloat16, the embedded "
                        "model float32)")
    e.add_argument("--index-topk", default=None,
                   help="override the indexer's top-k for the loss: a number, or 'dense' (no selection)")
    e.add_argument("--indexer-recall", action="store_true",
                   help="also report the indexers' top-k recall: the share of each query's dense attention "
                        "(summed over heads) on the keys the indexer ranks top-k, averaged over queries with more "
                        "than k candidates")
    k = e.add_mutually_exclusive_group()
    k.add_argument("--top-k", type=int, default=None, help="k for --indexer-recall (default: the model's index_topk)")
    k.add_argument("--top-k-fraction", type=float, default=None,
                   help="k for --indexer-recall as a fraction of --seq-len (e.g. 0.125)")
    e.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    e.add_argument("--no-progress", action="store_true")
    e.add_argument("--debug", action="store_true")
    add_distributed_arguments(e, mesh_help="evaluate sharded on this mesh (with several processes: over every "
                                           "process's devices)")
    install(e, "eval", _cmd_eval, validate=_check_eval_args)

    p = sub.add_parser("plot", help="loss curves of training runs (matplotlib)")
    p.add_argument("runs", nargs="+", help="run folders or metrics.jsonl files")
    p.add_argument("-o", "--output", required=True, help="image file (.png, .svg, .pdf)")
    p.add_argument("--keys", default="loss,eval_loss", help="comma-separated metric names")
    p.add_argument("--labels", default=None, help="comma-separated run labels")
    install(p, "plot", _cmd_plot)


def _check_data_args(args) -> None:
    for flag in ("seq_len", "batch_size"):
        check_int(f"--{flag.replace('_', '-')}", getattr(args, flag), low=1)
    check_float("--holdout-fraction", args.holdout_fraction, low=0, high=0.99, optional=True)


def _check_data_paths(args, what: str) -> None:
    """After the numbers: a missing --data path is named as the command's own data."""
    for path in args.data or ():
        if not Path(path).exists():
            raise UsageError(f"--data {path}: no such {what} file or folder")


def _check_train_args(args) -> None:
    """The numbers of `k31jax train` (exit 2), before any data is read or model built."""
    _check_data_args(args)
    for flag, low in (("steps", 1), ("index_topk", 1), ("grad_accum", 1), ("vocab_chunk", 1), ("warmup", 0),
                      ("lora_rank", 0), ("save_every", 1), ("keep", 1), ("log_every", 1), ("eval_every", 0),
                      ("eval_batches", 1), ("data_shards", 1)):
        check_int(f"--{flag.replace('_', '-')}", getattr(args, flag), low=low, optional=True)
    check_float("--lr", args.lr, low=0, low_open=True)
    check_float("--min-lr-ratio", args.min_lr_ratio, low=0, high=1)
    check_float("--lora-alpha", args.lora_alpha, low=0, low_open=True)
    for flag in ("weight_decay", "clip_norm", "z_loss", "bias_update_rate", "balance_loss"):
        check_float(f"--{flag.replace('_', '-')}", getattr(args, flag), low=0)
    check_mesh_args(args)
    _check_data_paths(args, "training data")


def _check_eval_args(args) -> None:
    _check_data_args(args)
    check_mesh_args(args)
    check_int("--max-batches", args.max_batches, low=1, optional=True)
    if args.index_topk is not None and args.index_topk != "dense":
        try:
            value = int(args.index_topk)
        except ValueError:
            value = 0
        if value < 1:
            raise UsageError(f"--index-topk {args.index_topk!r}: expected a positive integer or 'dense'")
    if (args.top_k is not None or args.top_k_fraction is not None) and not args.indexer_recall:
        raise UsageError("--top-k / --top-k-fraction set the k of --indexer-recall; add --indexer-recall")
    check_int("--top-k", args.top_k, low=1, optional=True)
    check_float("--top-k-fraction", args.top_k_fraction, low=0, high=1, low_open=True, optional=True)
    _check_data_paths(args, "eval data")

