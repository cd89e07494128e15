"""K3.1 Pro's programs compiled by XLA's TPU compiler on this CPU host (`k31jax.aot`, issue #26).

The compiler is deterministic, so one compile per shape: its memory, the traffic it implies
(loop trip counts included), and the planner beside it. Only the compile time depends on the
machine (and on what else it runs: the header's load). Needs the `tpu` extra (libtpu).

    python benchmarks/compile.py --record              # every case below
    python benchmarks/compile.py --case decode-4k      # one
    python benchmarks/compile.py --case decode-4k --case verify-4k --record   # a block of their own
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from _harness import Session, add_record_arguments, report  # noqa: E402

from k31jax import ModelConfig, aot  # noqa: E402

GB = 1e9
# name -> (step, topology, mesh, batch, context, chunk; for "verify" the drafted tokens per row)
CASES = {
    "decode-4k": ("decode", "v5p:4x4x4", "expert=8,tensor=8", 8, 4096, 1),
    # the speculative verify step beside it: 8 drafted tokens and the last one per row (issue #30)
    "verify-4k": ("verify", "v5p:4x4x4", "expert=8,tensor=8", 8, 4096, 8),
    "decode-128k": ("decode", "v5p:4x4x4", "expert=8,tensor=8", 8, 131072, 1),
    "decode-1m-tpu7x-32": ("decode", "tpu7x:2x2x4", "expert=4,tensor=8", 8, 1 << 20, 1),
    "decode-1m-tpu7x-64": ("decode", "tpu7x:2x4x4", "expert=8,tensor=8", 8, 1 << 20, 1),
    "prefill-2k": ("prefill", "v5p:4x4x4", "expert=8,tensor=8", 1, 8192, 2048),
    # QAT fine-tuning of the routed experts, AdamW, bf16 masters: one 4,096-token row (the
    # compiler spreads its tokens over the 64 data-parallel devices), and 64 x 1,024-token rows
    # (one row per data-parallel device)
    "train-qat": ("train", "v5p:8x8x8", "fsdp=8,expert=8,tensor=8", 1, 4096, 1),
    "train-qat-64x1024": ("train", "v5p:8x8x8", "fsdp=8,expert=8,tensor=8", 64, 1024, 1),
    # LoRA on the frozen packed base (issue #31): rank-16 adapters on attention and the shared
    # experts, the routed experts packed MXFP4 and frozen, on the inference slice; and with
    # adapters beside the routed experts too
    "train-lora": ("train", "v5p:4x4x4", "expert=8,tensor=8", 1, 4096, 1),
    "train-lora-experts": ("train", "v5p:4x4x4", "expert=8,tensor=8", 1, 4096, 1),
    # the same 4,096 tokens as 8 rows of 512, one per batch-parallel device (the planner's note)
    "train-lora-8x512": ("train", "v5p:4x4x4", "expert=8,tensor=8", 8, 512, 1),
}
# TrainSettings beyond the master dtype and context, per train case
TRAIN_OPTIONS = {"train-lora": dict(lora_rank=16), "train-lora-experts": dict(lora_rank=16, lora_experts=True),
                 "train-lora-8x512": dict(lora_rank=16)}


def layer_experts_bf16(cfg: ModelConfig, expert_shards: int, tensor: int) -> int:
    """Bytes of one layer's local routed experts decoded to bf16 (the float copy that must not exist)."""
    return (cfg.num_experts // expert_shards) * 3 * cfg.moe_intermediate_size // tensor * cfg.expert_in_dim * 2


def lines_for(name: str, r: aot.CompileReport, cfg: ModelConfig) -> list[str]:
    m, p, h = r.memory, r.planner, r.hlo
    local = layer_experts_bf16(cfg, r.mesh.get("expert", 1), r.mesh.get("tensor", 1))
    coll = ", ".join(f"{k} {c:,} / {b / GB:.2f} GB" for k, (c, b) in h.collectives.items())
    top = "; ".join(f"{s} {b / GB:.2f} GB ({o})" for b, s, o, _ in h.largest[:3])
    peak = "; ".join(f"{name[-60:]} {b / GB:.2f} GB" for b, name in r.peak[:5]) or "(no live-range dump)"
    moved = "; ".join(f"{name[-60:]} {b / GB:.1f} GB" for b, name in h.traffic[:4])
    return [
        f"[{name}] {r.step} of k31_pro (93 layers) on {r.topology} ({r.devices} x {r.device_kind}), mesh "
        f"{','.join(f'{k}={v}' for k, v in r.mesh.items() if v > 1)}, batch {r.batch}, context {r.context:,}",
        f"  lower {r.lower_seconds:.1f} s, compile {r.compile_seconds:.1f} s",
        f"  per device: arguments {m['arguments'] / GB:.2f} GB, temporaries {m['temporaries'] / GB:.2f} GB "
        f"({m['temporaries'] / max(m['arguments'], 1):.1%} of arguments), aliased {m['aliased'] / GB:.3f} GB "
        f"(donated {p['donated'] / GB:.3f} GB: {'all aliased' if m['aliased'] >= p['donated'] else 'NOT ALL ALIASED'}),"
        f" total {r.total / GB:.2f} GB of {r.hbm_per_device / GB:.1f} GB: {'fits' if r.fits else 'does not fit'}",
        f"  planner total {p['total'] / GB:.2f} GB: planner / compiler (total less generated code "
        f"{r.buffers / GB:.2f} GB) {r.planner_ratio:.3f}",
        f"  largest float buffer {h.largest_float[1]} {h.largest_float[0] / GB:.3f} GB; one layer's local experts "
        f"in bf16 {local / GB:.3f} GB",
        f"  HBM traffic per call (trip counts) {h.hbm_bytes / GB:.2f} GB; planner floor {r.floor_bytes / GB:.2f} GB "
        f"({r.floor_note}): {h.hbm_bytes / max(r.floor_bytes, 1):.2f}x; XLA's own total (loop bodies once) "
        f"{r.xla_cost.get('bytes accessed', 0) / GB:.2f} GB",
        f"  {h.flops / 1e12:.3f} TFLOP per call; collectives: {coll or 'none'}",
        f"  largest buffers: {top}",
        f"  at the compiler's memory peak: {peak}",
        f"  HBM traffic by source (op_name): {moved}",
    ] + ([] if r.state_formats_changed is None else
         [f"  donated state in the layouts the compiler chose: {r.state_formats_note()}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="run only these (repeatable)")
    add_record_arguments(parser)
    args = parser.parse_args()
    if not aot.libtpu_available():
        raise SystemExit("benchmarks/compile.py needs libtpu: pip install 'k31jax[tpu]'")
    cfg = ModelConfig.preset("k31_pro")
    session = Session()
    lines = [f"jax {jax.__version__}; the compiler's figures do not depend on the machine, the compile "
             "times do (see the load above)"]
    for name in args.case or CASES:
        step, topology, mesh, batch, context, chunk = CASES[name]
        train = aot.TrainSettings(master_dtype="bfloat16", seq_len=context, **TRAIN_OPTIONS.get(name, {}))
        try:
            r = aot.compile_program(cfg, topology, mesh, step=step, batch=batch, context=context, chunk=chunk,
                                    train=train, draft=chunk)
        except aot.CompileError as exc:
            lines.append(f"[{name}] {step} on {topology} mesh {mesh}, batch {batch}, context {context:,}: {exc}")
            continue
        lines += lines_for(name, r, cfg)
        print("\n".join(lines_for(name, r, cfg)), flush=True)
    session.finish()
    # a chosen set of cases is a block of its own beside the full record
    report("compile", "compile", lines, session, args,
           part="_".join(args.case).replace("-", "_") if args.case else None)


if __name__ == "__main__":
    main()
