"""PyTorch (HF transformers) training-step baseline for Kimi Linear models, driven over stdin.

A standalone script for the torch venv (scripts/make_torch_venv.sh), never imported by k31jax;
`benchmarks/train.py` starts it and alternates its timed repeats with k31jax's:

    ./.torchvenv/bin/python benchmarks/_torch_train_runner.py --config-json CFG.json \
        --batch 2 --seq-len 128 --steps-per-repeat 2 --threads 2 [--lr 1e-3 ...]

Model: `KimiLinearForCausalLM` from the HF config dict, random init (transformers' own), float32,
train mode, eager attention, `--experts-implementation` (eager | grouped_mm | batched_mm).
Optimizer: `torch.optim.AdamW` (decoupled decay scaled by the learning rate, as optax.adamw),
constant learning rate, no gradient clipping; weight decay only on the tensors k31jax decays
(matrices and stacked tensors: `ndim >= 2`, except the KDA `A_log`, which is a per-head vector
stored `[1, 1, H, 1]`); norms, `dt_bias` and every other vector get none.
Step: `loss = model(input_ids=x, labels=x).loss` (transformers shifts the labels: T - 1
targets per row; mean cross entropy over the full-vocabulary logits), `backward()`,
`opt.step()`, `opt.zero_grad(set_to_none=True)`. One fixed random batch `[B, T]`.

Protocol: after building the model and `--warmup-steps` untimed steps it prints one JSON line
`{"ready": ...}` to stdout; then for each stdin line "run" it times `--steps-per-repeat` steps
(wall clock, perf_counter) and prints `{"seconds": s, "loss": l}`; on "quit" (or EOF) it prints
the final `{"done": ...}` line with the process's peak RSS and exits. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def rss_now_mb() -> float:
    """Current resident set size (VmRSS) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def peak_rss_mb() -> float:
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 2**20


def decays(name: str, tensor) -> bool:
    """k31jax's decay rule (`k31jax.train.decay_mask`) on transformers' parameter names."""
    return tensor.ndim >= 2 and not name.endswith("A_log")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-json", required=True, help="HF KimiLinearConfig-style config.json")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--steps-per-repeat", type=int, default=2)
    ap.add_argument("--warmup-steps", type=int, default=1)
    ap.add_argument("--threads", type=int, required=True, help="torch.set_num_threads / OMP_NUM_THREADS")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--b1", type=float, default=0.9)
    ap.add_argument("--b2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--experts-implementation", default="grouped_mm", help="eager | grouped_mm | batched_mm")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import torch
    import transformers
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rss_after_import = rss_now_mb()

    with open(args.config_json) as f:
        cfg_dict = json.load(f)
    cfg = KimiLinearConfig(**{k: v for k, v in cfg_dict.items() if k != "model_type"})
    model = KimiLinearForCausalLM._from_config(cfg, attn_implementation="eager",
                                               experts_implementation=args.experts_implementation,
                                               dtype=torch.float32)
    model.train()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if decays(name, p) else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(args.b1, args.b2), eps=args.eps)
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(3, cfg.vocab_size, (args.batch, args.seq_len), generator=g)

    def step() -> float:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    t0 = time.perf_counter()
    loss = float("nan")
    for _ in range(args.warmup_steps):
        loss = step()
    log(f"torch: {args.warmup_steps} warm-up step(s) in {time.perf_counter() - t0:.1f} s, loss {loss:.4f}")
    emit({
        "ready": True,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "experts_implementation": model.config._experts_implementation,
        "attn_implementation": model.config._attn_implementation,
        "fla_installed": importlib.util.find_spec("fla") is not None,
        "causal_conv1d_installed": importlib.util.find_spec("causal_conv1d") is not None,
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_params_decayed": sum(p.numel() for p in decay),
        "warmup_s": time.perf_counter() - t0,
        "rss_after_import_mb": rss_after_import,
    })
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "run":
            log(f"torch runner: unknown command {command!r} (expected 'run' or 'quit')")
            sys.exit(2)
        t = time.perf_counter()
        for _ in range(args.steps_per_repeat):
            loss = step()
        emit({"seconds": time.perf_counter() - t, "loss": loss})
    emit({"done": True, "peak_rss_mb": peak_rss_mb(), "rss_now_mb": rss_now_mb()})


if __name__ == "__main__":
    main()
