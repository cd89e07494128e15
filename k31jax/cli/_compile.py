"""`k31jax compile`: the engine's programs (and the trainer's step) compiled for a TPU slice by XLA's TPU compiler, on
any host (`k31jax.aot`; the `tpu` extra brings libtpu), with the compiler's memory beside the
planner's, traffic with loop trip counts, collectives and the largest buffers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax

from ..distributed import backends_started
from ._common import UsageError, check_int, install
from ._paper import check_config_arg, config_help, read_config


def register(sub) -> None:
    p = sub.add_parser("compile", help="compile the decode / prefill program for a TPU slice (no TPU needed) "
                                       "and report its memory and traffic")
    p.add_argument("--config", default="k31_pro", help=config_help("k31_pro"))
    p.add_argument("--topology", default="v5p:4x4x4",
                   help="libtpu topology (v5p:4x4x4, tpu7x:2x2x2, v5e:4x4, v6e:4x4, v4:2x2x2) or a named "
                        "slice (v5p-128 = 64 chips, tpu7x-64, v5e-16)")
    p.add_argument("--mesh", default="expert=8,tensor=8", help="mesh axes over the slice's devices")
    p.add_argument("--slices", type=int, default=1,
                   help="compile for this many slices of --topology joined by the data-center network "
                        "(multi-slice): --mesh spans all their devices, its data axis across the slices "
                        "(e.g. --slices 2 --mesh data=2,expert=8,tensor=8), and the report lists what "
                        "crosses between them")
    p.add_argument("--rules", default=None, help="rule table (default: the one for the mesh)")
    p.add_argument("--step", default="decode", choices=["decode", "verify", "prefill", "train"],
                   help="the engine's decode step (donated cache), its speculative verify step (--draft "
                        "drafted tokens per row), one prefill chunk, or the trainer's step")
    p.add_argument("--draft", type=int, default=8, help="drafted tokens per row (--step verify)")
    p.add_argument("--batch", type=int, default=8, help="sequences (train: rows per micro-batch)")
    p.add_argument("--context", type=int, default=4096, help="cache length in tokens")
    p.add_argument("--chunk", type=int, default=2048, help="prefill call width (--step prefill)")
    p.add_argument("--kernels", default="xla", choices=["xla", "pallas"],
                   help="the hot paths' kernel seam: the XLA paths (what the engine runs on a TPU today), or "
                        "the Pallas TPU kernels where they exist (the MXFP4 grouped matmul; not yet verified "
                        "on TPU hardware)")
    t = p.add_argument_group("--step train (the flags of k31jax train)")
    t.add_argument("--qat", action=argparse.BooleanOptionalAction, default=True, help="MXFP4 fake-quant of the experts")
    t.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (0: train --trainable); "
                   "the routed experts stay packed MXFP4")
    t.add_argument("--lora-experts", action="store_true", help="with --lora-rank: adapters beside the routed experts too")
    t.add_argument("--remat", default="full", choices=["full", "dots", "none"])
    t.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    t.add_argument("--trainable", default="experts", help="trained subset (experts, all, indexer, no_embed)")
    t.add_argument("--master-dtype", default="float32", choices=["float32", "bfloat16"])
    t.add_argument("--seq-len", type=int, default=4096, help="tokens per row")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    p.add_argument("--dump", default=None, help="write the optimized HLO text into this folder")
    install(p, "compile", _run, validate=_check)


def _check(args) -> None:
    check_config_arg(args.config)
    for flag in ("batch", "context", "chunk", "seq_len", "grad_accum", "draft", "slices"):
        check_int(f"--{flag.replace('_', '-')}", getattr(args, flag), low=1)
    check_int("--lora-rank", args.lora_rank, low=0)


def _run(args) -> int:
    from .. import aot
    from ..ops import Backends

    if not aot.libtpu_available():
        raise UsageError("the TPU compiler is not installed: pip install 'k31jax[tpu]' (or "
                         "bash scripts/install.sh --tpu), which brings libtpu")
    if not backends_started():  # compile on the host's CPU; never try to drive a TPU
        jax.config.update("jax_platforms", "cpu")
    try:
        train = aot.TrainSettings(qat=args.qat, lora_rank=args.lora_rank, lora_experts=args.lora_experts,
                                  remat=args.remat, optimizer=args.optimizer,
                                  trainable=args.trainable, master_dtype=args.master_dtype, seq_len=args.seq_len,
                                  grad_accum=args.grad_accum)
        report = aot.compile_program(read_config(args.config), args.topology, args.mesh, step=args.step,
                                     batch=args.batch, context=args.context, chunk=args.chunk, rules=args.rules,
                                     dump=args.dump, train=train, backends=Backends(kernels=args.kernels, ep="ragged"),
                                     draft=args.draft, slices=args.slices,
                                     name=Path(args.config).stem if Path(args.config).exists() else args.config)
    except aot.CompileError as exc:
        raise UsageError(str(exc)) from None
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    return 0
