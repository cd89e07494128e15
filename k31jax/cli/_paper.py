"""`k31jax info` (parameter counts) and `k31jax plan` (per-device memory of inference, or with
`--train` of a QAT or LoRA fine-tuning step), both on paper."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import ModelConfig, preset_names
from ..distributed import (DEVICES, GB, MASTER_DTYPES, OPTIMIZERS, TRAINABLE_SETS, plan_memory, plan_training,
                           suggest_mesh, suggest_training_mesh)
from ..generate import DEFAULT_MODEL, embedded_model_dir
from ..nn import REMAT_POLICIES
from ..nn import count_params
from ..sharding import RULE_TABLES, mesh_str, parse_mesh
from ..vision import count_vision_params
from ._common import UsageError, check_float, check_int, check_mesh_spec, install


def read_config(spec: str) -> ModelConfig:
    if spec == DEFAULT_MODEL:  # the shipped model's own config (its preset differs: bf16 experts)
        return ModelConfig.from_hf(embedded_model_dir() / "config.json")
    return ModelConfig.from_hf(spec) if Path(spec).exists() else ModelConfig.preset(spec)


def config_help(default: str) -> str:
    return f"preset ({', '.join(preset_names())}) or path to a config.json (default: {default})"


def check_config_arg(spec: str) -> None:
    if not Path(spec).exists() and spec not in preset_names():
        raise UsageError(f"--config {spec!r}: no such config file, and not a preset (presets: "
                         f"{', '.join(preset_names())})")


def _check_info_args(args) -> None:
    check_config_arg(args.config)


def _check_plan_args(args) -> None:
    check_config_arg(args.config)
    check_mesh_spec("--mesh", args.mesh)
    for flag in ("batch", "context", "chunk", "seq_len", "micro_batch", "grad_accum", "vocab_chunk", "slices"):
        check_int(f"--{flag.replace('_', '-')}", getattr(args, flag), low=1)
    check_int("--prefill-batch", args.prefill_batch, low=1, optional=True)
    if args.slices > 1 and not args.train:
        raise UsageError("--slices applies with --train (inference replicas on several slices exchange nothing)")
    if args.train and parse_mesh(args.mesh)["data"] % args.slices:
        raise UsageError(f"--slices {args.slices}: the --mesh data axis ({parse_mesh(args.mesh)['data']}) must be a "
                         "multiple of the slices (data parallelism runs across slices)")
    check_float("--usable", args.usable, low=0, low_open=True, high=1)
    if args.train and args.expert_weights:
        raise UsageError("--expert-weights does not apply with --train (QAT trains float master experts; LoRA keeps "
                         "the config's)")
    check_int("--lora-rank", args.lora_rank, low=0)
    if (args.lora_rank or args.lora_experts) and not args.train:
        raise UsageError("--lora-rank / --lora-experts apply with --train")
    if args.lora_experts and not args.lora_rank:
        raise UsageError("--lora-experts needs --lora-rank > 0 (adapters need a rank)")
    if args.lora_rank and args.optimizer != "adamw":
        raise UsageError(f"--optimizer {args.optimizer} with --lora-rank: LoRA adapters train with AdamW")


def _cmd_info(args) -> int:
    cfg = read_config(args.config)
    counts = count_params(cfg)
    what = (" (the embedded default model: what generate, chat and serve run without --ckpt)"
            if args.config == DEFAULT_MODEL else "")
    print(f"{args.config}{what}: {cfg.num_hidden_layers} layers ({len(cfg.kda_layers)} KDA, "
          f"{len(cfg.mla_layers)} MLA{' + lightning indexer' if cfg.use_indexer else ''}), "
          f"{cfg.num_experts} experts top-{cfg.num_experts_per_token}, hidden {cfg.hidden_size}")
    print(counts.table())
    if cfg.vision is not None:
        vision = count_vision_params(cfg.vision)
        v = cfg.vision
        print(f"\nvision (MoonViT-V2, {v.num_hidden_layers} blocks, width {v.hidden_size}; counted on the abstract model)")
        print(f"  {'vision tower':<28}{vision['tower']:>18,}")
        print(f"  {'projector (patch merger)':<28}{vision['projector']:>18,}")
        print(f"  {'vision total':<28}{vision['tower'] + vision['projector']:>18,}")
    return 0


def register_info(sub) -> None:
    info = sub.add_parser("info", help="parameter counts and bytes of a config, on paper")
    info.add_argument("--config", default=DEFAULT_MODEL, help=config_help(f"{DEFAULT_MODEL}, the embedded "
                                                                           "default model"))
    install(info, "info", _cmd_info, validate=_check_info_args)


_TRAIN_MAX_DEVICES = 4096


def _cmd_plan_train(args, cfg: ModelConfig, name: str) -> int:
    options = dict(trainable=args.trainable, optimizer=args.optimizer, master_dtype=args.master_dtype,
                   remat=args.remat, seq_len=args.seq_len, micro_batch=args.micro_batch,
                   grad_accum=args.grad_accum, vocab_chunk=args.vocab_chunk, lora_rank=args.lora_rank,
                   lora_experts=args.lora_experts)
    p = dataclasses.replace(plan_training(cfg, args.mesh, rules=args.rules, slices=args.slices, **options),
                            config_name=name)
    print(p.table(args.device, args.usable))
    label, cap = DEVICES[args.device]
    verdict = "fits" if p.fits(args.device, args.usable) else "does NOT fit"
    print(f"\n{mesh_str(p.mesh)} on {label}: {p.total / GB:,.1f} GB per device of {cap * args.usable / GB:,.1f} "
          f"usable -> {verdict}")
    print(f"\nsmallest mesh that fits this step (candidates as for inference, up to {_TRAIN_MAX_DEVICES} devices):")
    for dev in ([args.device] if not args.all_devices else list(DEVICES)):
        s = suggest_training_mesh(cfg, dev, usable=args.usable, max_devices=_TRAIN_MAX_DEVICES, **options)
        if s:
            what = f"{mesh_str(s.mesh)} ({s.devices} devices, rules {s.rules_name}), {s.total / GB:,.1f} GB per device"
        else:
            tips = [t for t in ("--master-dtype bfloat16" if args.master_dtype != "bfloat16" else "",
                                "a shorter --seq-len", "--remat full" if args.remat != "full" else "") if t]
            what = (f"none: the activations alone take {p.activation_peak / GB:,.1f} GB per device here and barely "
                    f"shrink with more devices; try {' or '.join(tips)}")
        print(f"  {DEVICES[dev][0]:<12} {what}")
    return 0


def _cmd_plan(args) -> int:
    cfg = read_config(args.config)
    name = Path(args.config).stem if Path(args.config).exists() else args.config
    if args.train:
        return _cmd_plan_train(args, cfg, name)
    if args.expert_weights:
        cfg = cfg.replace(expert_weights=args.expert_weights)
    p = plan_memory(cfg, args.mesh, batch=args.batch, context=args.context, chunk=args.chunk,
                    prefill_batch=args.prefill_batch, rules=args.rules)
    p = dataclasses.replace(p, config_name=name)
    print(p.table(args.device, args.usable))
    label, cap = DEVICES[args.device]
    verdict = "fits" if p.fits(args.device, args.usable) else "does NOT fit"
    print(f"\n{mesh_str(p.mesh)} on {label}: {p.total / GB:,.1f} GB per device of {cap * args.usable / GB:,.1f} "
          f"usable -> {verdict}")
    print("\nsmallest mesh that fits (candidates: one node with experts over `tensor`; expert x tensor; "
          "fsdp x expert x tensor):")
    for dev in ([args.device] if not args.all_devices else list(DEVICES)):
        s = suggest_mesh(cfg, dev, batch=args.batch, context=args.context, chunk=args.chunk,
                         prefill_batch=args.prefill_batch, usable=args.usable)
        what = (f"{mesh_str(s.mesh)} ({s.devices} devices, rules {s.rules_name}), {s.total / GB:,.1f} GB per device"
                if s else "none up to 1024 devices")
        print(f"  {DEVICES[dev][0]:<12} {what}")
    return 0


def register_plan(sub) -> None:
    p = sub.add_parser("plan", help="per-device memory of a config on a mesh, on paper")
    p.add_argument("--config", default="k31_pro", help=config_help("k31_pro"))
    p.add_argument("--mesh", default="expert=8,tensor=8", help="e.g. expert=8,tensor=8")
    p.add_argument("--rules", default=None, choices=sorted(RULE_TABLES), help="default: from the mesh")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096, help="cache length (tokens)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    p.add_argument("--prefill-batch", type=int, default=None,
                   help="sequences prefilled together (default: --batch)")
    p.add_argument("--device", default="b300", choices=sorted(DEVICES))
    p.add_argument("--usable", type=float, default=0.9, help="usable fraction of HBM (runtime reserve)")
    p.add_argument("--expert-weights", choices=["mxfp4", "bf16"], default=None)
    p.add_argument("--all-devices", action="store_true", help="suggest a mesh for every device type")
    t = p.add_argument_group("--train: one QAT fine-tuning step (float master experts fake-quantised to MXFP4), "
                                  "or with --lora-rank one LoRA step on the frozen base")
    t.add_argument("--train", action="store_true", help="plan a training step instead of inference")
    t.add_argument("--trainable", choices=TRAINABLE_SETS, default="experts")
    t.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    t.add_argument("--master-dtype", choices=MASTER_DTYPES, default="float32", help="master (and compute) dtype")
    t.add_argument("--remat", choices=REMAT_POLICIES, default="full", help="per-layer rematerialisation")
    t.add_argument("--seq-len", type=int, default=4096, help="tokens per packed row")
    t.add_argument("--micro-batch", type=int, default=1, help="rows per micro-batch")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--vocab-chunk", type=int, default=4096, help="the streamed loss's vocabulary chunk")
    t.add_argument("--lora-rank", type=int, default=0,
                   help="plan a LoRA step instead: adapters of this rank on attention and the shared experts, the "
                        "base frozen (packed MXFP4 experts stay packed); --trainable does not apply")
    t.add_argument("--lora-experts", action="store_true", help="LoRA adapters beside the routed experts too")
    t.add_argument("--slices", type=int, default=1,
                   help="TPU slices the mesh spans, its data axis across them: adds the bytes each device "
                        "sends between slices per step")
    install(p, "plan", _cmd_plan, validate=_check_plan_args)
