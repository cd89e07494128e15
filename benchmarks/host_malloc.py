"""Decode and TTFT with `k31jax.distributed.tune_host_malloc` against glibc's default malloc.

    .venv/bin/python benchmarks/host_malloc.py [--batches 1 8] [--context 512] [--record]

The setting belongs to a process and must precede JAX's first computation, so each side runs
in a fresh process per call (`K31JAX_HOST_MALLOC=1` / `0`): it builds `generate.py`'s 331M
Kimi-Linear-shaped model (float32, random weights), compiles with a first `generate`, then
times one `generate` of `--new-tokens` at batch B after a `--context`-token prompt. The
sides alternate (`_harness.alternate`: one warm-up call each, then 3 recorded rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _harness  # noqa: E402  (applies tune_host_malloc unless K31JAX_HOST_MALLOC=0, before JAX starts)
from _harness import Session, add_record_arguments, alternate, ratio, report  # noqa: E402


def child(batch: int, context: int, new_tokens: int) -> None:
    import numpy as np
    from flax import nnx

    import k31jax
    from generate import CONFIG
    from k31jax.generate import Engine

    cfg = k31jax.ModelConfig.from_hf(CONFIG, dtype="float32")
    engine = Engine(k31jax.K31ForCausalLM(cfg, rngs=nnx.Rngs(0)), max_len=context + new_tokens, prefill_chunk=512)
    prompts = np.random.default_rng(1).integers(3, cfg.vocab_size, (batch, context)).tolist()
    engine.generate(prompts, 2, stop_ids=frozenset())  # compiles every program
    r = engine.generate(prompts, new_tokens, stop_ids=frozenset())
    print(json.dumps({"decode_tok_s": r.decode_tok_s, "ttft_s": r.prefill_seconds, "tuned": _harness.HOST_MALLOC}))


def run_side(tuned: bool, batch: int, context: int, new_tokens: int) -> dict[str, float]:
    env = {**os.environ, "K31JAX_HOST_MALLOC": "1" if tuned else "0"}
    out = subprocess.run([sys.executable, __file__, "--child", "--batches", str(batch), "--context", str(context),
                          "--new-tokens", str(new_tokens)], env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"child (tuned={tuned}, batch {batch}) failed:\n{out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got.pop("tuned") != tuned:
        raise RuntimeError(f"child asked for tuned={tuned} ran the other way (glibc missing, or JAX started early)")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_record_arguments(ap)
    args = ap.parse_args()
    if args.child:
        child(args.batches[0], args.context, args.new_tokens)
        return
    session = Session()
    lines = [f"generate.py's 331M config, float32; prompt {args.context} tokens, {args.new_tokens} new tokens, greedy; "
             f"each call a fresh process; median [min, max] of {args.repeats} alternating rounds",
             f"{'batch':>5} {'':14}{'tuned':>26}{'glibc default':>26}{'ratio':>8}"]
    for b in args.batches:
        stats = alternate({side: (lambda tuned=(side == "tuned"), b=b: run_side(tuned, b, args.context, args.new_tokens))
                           for side in ("tuned", "default")}, args.repeats)
        ours, theirs = stats["tuned"], stats["default"]
        lines.append(f"{b:>5} {'decode tok/s':14}{str(ours['decode_tok_s']):>26}{str(theirs['decode_tok_s']):>26}"
                     f"{ratio(ours['decode_tok_s'], theirs['decode_tok_s']):7.2f}x")
        lines.append(f"{b:>5} {'TTFT s':14}{str(ours['ttft_s']):>26}{str(theirs['ttft_s']):>26}"
                     f"{ratio(theirs['ttft_s'], ours['ttft_s']):7.2f}x")
    session.finish()
    report("host_malloc", "host malloc", lines, session, args)


if __name__ == "__main__":
    main()
