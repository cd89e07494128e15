"""Why QAT: fine-tuning the shipped 4-bit model on a new domain, kept in float, rounded back to
MXFP4 (PTQ), trained through the rounding (QAT), or adapted with LoRA on the frozen packed base.

    .venv/bin/python benchmarks/qat_finetune.py [--record] [--lrs 3e-4 1e-3] [--steps 50 100 200]
        [--seeds 0 1 2] [--trainable experts] [--kinds float qat lora] [--min-lr-ratio 1]

Every run starts from the embedded default model (its routed experts shipped packed MXFP4,
decoded to float32 master weights) and fine-tunes on the Python Language Reference's prose
(`k31jax.train.language_reference_domain`: English documentation the model never saw, which it
predicts far worse than Python source). Per learning rate and seed, with the same data order
and steps for all (AdamW, constant rate after a 10-step warm-up, or with `--min-lr-ratio` below 1
a cosine decay to that share of it at the last of `--steps`; no weight decay, router bias
frozen), the held-out loss at each of `--steps`:

1. **float**: the fine-tune kept in float32;
2. **PTQ**: that model with its routed experts rounded to nearest MXFP4 (`quantize_experts`,
   the export's rule);
3. **QAT**: trained with the MXFP4 fake-quant in the forward pass (straight-through gradient),
   evaluated as its packed export;
4. **LoRA** on the frozen packed base: rank-8 adapters on the attention and shared-expert
   projections and beside the routed experts (`lora_experts`), which stay packed MXFP4 through
   training (their bytes checked equal to the shipped ones), served unmerged; and **LoRA
   merged**: the expert adapters merged into the experts and re-rounded to MXFP4
   (`merge_expert_adapters`, what the run's release holds).

`--trainable experts` (default) trains only the routed experts in 1-3, where PTQ's effect is
cleanest: a fine-tune moves each expert weight by less than one MXFP4 step, so rounding back
snaps most of it to where it started. "kept" is the share of the float fine-tune's gain on the
new domain (base model's loss minus the fine-tune's) that a model keeps; PTQ - QAT is paired
per seed, with its standard error over seeds. Losses are nats per token (float32 compute,
sparse top-64 attention as shipped), on both domains' held-out text: the new domain's 17
held-out topics, and the embedded model's own held-out standard-library files (the first
`--base-batches` batches). The figures are losses, not timings, so they do not depend on the
machine's load and are recorded whatever it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Session, record  # noqa: E402

MODELS = {"float": ("float", "PTQ"), "qat": ("QAT",), "lora": ("LoRA", "LoRA merged")}
PAIRS = (("PTQ", "QAT"), ("LoRA merged", "LoRA"))  # (rounded after training, the model served as trained)


@dataclasses.dataclass(frozen=True)
class Setup:
    new: object  # DomainSplit
    base: object  # DomainSplit
    seq_len: int
    batch_size: int
    base_batches: int
    trainable: str
    lora_rank: int
    min_lr_ratio: float


def _eval_data(folder, setup: Setup):
    from k31jax.train import DataConfig
    return DataConfig(paths=(str(folder),), seq_len=setup.seq_len, batch_size=setup.batch_size)


def evaluate_both(model, tokenizer, setup: Setup) -> tuple[float, float]:
    """(new-domain held-out loss, base-domain held-out loss), nats per token."""
    from k31jax.train import evaluate
    new = evaluate(model, tokenizer, _eval_data(setup.new.heldout, setup), split="all")
    base = evaluate(model, tokenizer, _eval_data(setup.base.heldout, setup), split="all",
                    max_batches=setup.base_batches)
    return new.loss, base.loss


def packed_experts(model) -> list[np.ndarray]:
    """The routed experts' packed codes and scales, as host arrays."""
    moe = model.moe
    return [np.asarray(getattr(getattr(moe, w), part)[...]) for w in ("w_gate", "w_up", "w_down")
            for part in ("packed", "scale")]


def finetune(kind: str, lr: float, seed: int, steps: list[int], setup: Setup, work: Path, tokenizer,
             base_bytes: list[np.ndarray]) -> list[dict]:
    """One run; a row per evaluated step with each of its models' two losses."""
    from k31jax.generate import embedded_model_dir
    from k31jax.nn import merge_expert_adapters, quantize_experts
    from k31jax.train import DataConfig, OptimConfig, Trainer, TrainConfig

    data = DataConfig(paths=(str(setup.new.train),), seq_len=setup.seq_len, batch_size=setup.batch_size, seed=seed)
    optim = OptimConfig(learning_rate=lr, warmup_steps=10, total_steps=max(steps), min_lr_ratio=setup.min_lr_ratio,
                        weight_decay=0.0,
                        trainable="all" if kind == "lora" else setup.trainable)
    cfg = TrainConfig(out=str(work / f"{kind}_lr{lr:g}_seed{seed}"), data=data, optim=optim, steps=max(steps),
                      init=str(embedded_model_dir()), qat=kind == "qat", bias_update_rate=0.0, seed=seed,
                      lora_rank=setup.lora_rank if kind == "lora" else 0, lora_experts=kind == "lora",
                      save_every=max(steps) + 1)
    trainer = Trainer(cfg, progress=False)
    rows, done, started = [], 0, time.perf_counter()
    try:
        for step in sorted(steps):
            metrics = trainer.train_steps(step - done)
            done = step
            model = trainer.model()
            models = {}
            if kind == "float":
                models["float"] = model
                models["PTQ"] = quantize_experts(model)
            elif kind == "qat":
                models["QAT"] = quantize_experts(model)
            else:
                if not all(np.array_equal(a, b) for a, b in zip(packed_experts(model), base_bytes)):
                    raise AssertionError("LoRA changed the base model's packed experts")
                models["LoRA"] = model
                models["LoRA merged"] = merge_expert_adapters(model)
            for label, m in models.items():
                new, base = evaluate_both(m, tokenizer, setup)
                rows.append(dict(model=label, lr=lr, seed=seed, step=step, new=new, base=base,
                                 train_loss=float(metrics[-1]["loss"]), min_lr_ratio=setup.min_lr_ratio))
            print(f"  {kind} lr {lr:g} seed {seed} step {step}: "
                  + ", ".join(f"{r['model']} {r['new']:.4f}/{r['base']:.4f}" for r in rows if r["step"] == step)
                  + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        trainer.close()
    return rows


def _mean_sd(values) -> str:
    v = np.asarray(values, np.float64)
    return f"{v.mean():.4f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.4f}"


def _mean_se(values) -> tuple[float, float]:
    v = np.asarray(values, np.float64)
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")


def summary(rows: list[dict], base_losses: tuple[float, float]) -> list[str]:
    """The table: per (lr, step) each model's losses (mean ± sd over seeds), the share of the
    float fine-tune's new-domain gain it keeps, and PTQ - QAT paired by seed."""
    base_new, base_base = base_losses
    lines = [f"base model (shipped, packed MXFP4): new domain {base_new:.4f}, base domain {base_base:.4f} nats/token",
             "", "| lr | steps | model | new domain (held-out) | base domain | gain kept (mean ± se) |",
             "|---|---|---|---|---|---|"]
    gaps = []
    for lr in sorted({r["lr"] for r in rows}):
        for step in sorted({r["step"] for r in rows if r["lr"] == lr}):
            at = [r for r in rows if r["lr"] == lr and r["step"] == step]
            floats = {r["seed"]: r["new"] for r in at if r["model"] == "float"}
            for label in ("float", "PTQ", "QAT", "LoRA", "LoRA merged"):
                mine = [r for r in at if r["model"] == label]
                if not mine:
                    continue
                kept = [(base_new - r["new"]) / (base_new - floats[r["seed"]]) for r in mine if r["seed"] in floats]
                kept_text = "-" if label == "float" or not kept else "{:.1%} ± {:.1%}".format(*_mean_se(kept))
                lines.append(f"| {lr:g} | {step} | {label} | {_mean_sd([r['new'] for r in mine])} | "
                             f"{_mean_sd([r['base'] for r in mine])} | {kept_text} |")
            for worse, better in PAIRS:
                first = {r["seed"]: r["new"] for r in at if r["model"] == worse}
                second = {r["seed"]: r["new"] for r in at if r["model"] == better}
                paired = [first[s] - second[s] for s in sorted(first.keys() & second.keys())]
                if paired:
                    gaps.append((f"{worse} - {better}", lr, step, len(paired), *_mean_se(paired)))
    if gaps:
        lines += ["", "Differences on the new domain, paired by seed (positive: the second model is better):", "",
                  "| difference | lr | steps | seeds | mean nats/token | standard error | in SE |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {what} | {lr:g} | {step} | {n} | {m:+.5f} | {se:.5f} | "
                  f"{f'{m / se:+.1f}' if se > 0 else '-'} |" for what, lr, step, n, m, se in gaps]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3])
    parser.add_argument("--steps", type=int, nargs="+", default=[50, 100, 200],
                        help="evaluate after each of these steps (one run per lr and seed reaches the largest)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--kinds", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--trainable", default="experts", help="trained weights in the float and QAT runs")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--min-lr-ratio", type=float, default=1.0,
                        help="1: a constant rate after the warm-up; below 1: cosine decay to this share of it at the "
                             "largest --steps (recorded in its own block)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--base-batches", type=int, default=8)
    parser.add_argument("--work", type=Path, default=None, help="runs and rows.jsonl here (default: a temporary folder)")
    parser.add_argument("--rows", type=Path, default=None,
                        help="summarise (and --record) the rows.jsonl of an earlier run instead of training")
    parser.add_argument("--record", action="store_true",
                        help="write the table into benchmarks/RESULTS.md (block `qat_finetune_<trainable>`)")
    args = parser.parse_args()
    if min(args.steps) < 1 or any(s <= 10 for s in args.steps):
        parser.error("--steps: each must be > 10 (the warm-up)")
    earlier = [json.loads(line) for line in args.rows.read_text().splitlines()] if args.rows else []
    schedules = {r.get("min_lr_ratio", 1.0) for r in earlier if r["model"] != "shipped"}  # unrecorded: constant
    if schedules - {args.min_lr_ratio}:  # the block's header states the flag's schedule
        parser.error(f"--rows {args.rows}: its runs used min_lr_ratio {sorted(schedules)}, "
                     f"not --min-lr-ratio {args.min_lr_ratio:g}")

    from k31jax.generate import load_model
    from k31jax.train import embedded_heldout_domain, language_reference_domain

    session = Session()
    work = args.work or Path(tempfile.mkdtemp(prefix="qat_finetune_"))
    setup = Setup(new=language_reference_domain(work / "new"), base=embedded_heldout_domain(work / "base"),
                  seq_len=args.seq_len, batch_size=args.batch_size, base_batches=args.base_batches,
                  trainable=args.trainable, lora_rank=args.lora_rank, min_lr_ratio=args.min_lr_ratio)
    shipped = load_model()
    shipped_rows = [r for r in earlier if r["model"] == "shipped"]
    base_losses = ((shipped_rows[0]["new"], shipped_rows[0]["base"]) if shipped_rows
                   else evaluate_both(shipped.model, shipped.tokenizer, setup))
    print(f"new domain: {setup.new.name}, {len(setup.new.train_documents)} training / "
          f"{len(setup.new.heldout_documents)} held-out topics, sha256 {setup.new.sha256[:16]}, {setup.new.licence}")
    print(f"base domain: {setup.base.name}")
    rows = [r for r in earlier if r["model"] != "shipped"]
    if args.rows is None:
        base_bytes = packed_experts(shipped.model)
        with open(work / "rows.jsonl", "w") as log:
            log.write(json.dumps(dict(model="shipped", new=base_losses[0], base=base_losses[1])) + "\n")
            for lr in args.lrs:
                for seed in args.seeds:
                    for kind in args.kinds:
                        for row in finetune(kind, lr, seed, args.steps, setup, work, shipped.tokenizer, base_bytes):
                            rows.append(row)
                            log.write(json.dumps(row) + "\n")
                            log.flush()
    seeds = sorted({r["seed"] for r in rows})
    cosine = args.min_lr_ratio < 1
    schedule = (f"cosine decay to {args.min_lr_ratio:g} of the rate at step {max(r['step'] for r in rows)}" if cosine
                else "constant rate")
    lines = [f"new domain: {setup.new.name} ({len(setup.new.train_documents)} training, "
             f"{len(setup.new.heldout_documents)} held-out topics; text sha256 {setup.new.sha256[:16]}; "
             f"{setup.new.licence}); base domain: {setup.base.name}, first {args.base_batches} batches",
             f"trainable (float, QAT): {args.trainable}; LoRA rank {args.lora_rank}; rows of {args.seq_len} tokens, "
             f"batch {args.batch_size}; seeds {seeds}; {schedule}", ""] + summary(rows, base_losses)
    print("\n".join(lines))
    if args.record:
        record("qat_finetune", lines, session, force=True, part=args.trainable + ("_cosine" if cosine else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
