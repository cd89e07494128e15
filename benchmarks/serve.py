"""Serving benchmark (issue 14): continuous batching vs one static batch at a time, and the
second turn of a long conversation resumed from the session snapshot vs prefilled cold.
In-process on the `Scheduler` (its own thread, as in `k31jax serve`; no HTTP), so the
numbers are the scheduler's and the engine's.

    .venv/bin/python benchmarks/serve.py [--config PRESET] [--clients 32] [--max-batch 8] [--repeats 3] [--record]

Model: the embedded default model (`load_model()`: 4.5M parameters, hidden 128, 8 layers, what
`k31jax serve` serves without --ckpt) unless `--config PRESET` (seeded random weights).
Prompts are Python standard-library source text (what the embedded model was trained on).

1. Throughput and p50 / p99 time to first token: `--clients` requests submitted at once, with
   prompt and output lengths drawn log-uniformly (many short, a few long, as chat traffic is):
   prompts 16..`--max-prompt` tokens, outputs 8..`--max-new` tokens. Sampling at temperature
   0.8 with a seed per request and no stop ids, so every request makes exactly its output
   length on both sides (the same tokens are counted).
   - continuous: the `Scheduler` with `--max-batch` slots: requests join and leave between
     decode steps, prompts are prefilled in `--chunk`-token calls between decode steps;
   - static: the same requests in submission order, `--max-batch` at a time, each group run to
     its longest output by `Engine.generate` (the group's prompts padded to one bucket): a
     server without continuous batching. Same model, context length and chunk.
   TTFT: from submission (all at t = 0) to the request's first token. "Ideal" is the ratio a
   perfect continuous batcher would reach if a decode step cost the same whatever rows it
   holds and prefill were free: static's decode steps (each group's longest output, summed)
   over continuous's (all outputs / max_batch). It depends on the length spread only: with
   uniform 8..128 outputs it is ~1.7x, so no batcher reaches 2x there.
2. Session reuse: a conversation whose first turn is `--history` tokens; the second turn is the
   first prompt + the reply it got + a new question (~40 tokens). Its TTFT on an idle
   scheduler, resumed from the snapshot stored at the end of turn 1 (prefix cache on) vs
   prefilled cold (prefix cache off: the whole prompt in `--chunk`-token calls). The same
   compiled programs serve both sides.
Method (`benchmarks/_harness.py`): in each part the two sides alternate, one warm-up each,
then `--repeats` rounds; median [min, max]; the 1-minute load average before and after every
timed run. `--record` writes the printed block into RESULTS.md (refused when the load exceeded
the core count, unless `--force`, which marks it as measured under load).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import Session, alternate, ratio, record  # noqa: E402

from k31jax.generate import Engine, PrefixCache, Request, SamplingParams, Scheduler, load_model  # noqa: E402

SOURCES = ("argparse.py", "typing.py", "inspect.py", "pathlib/_local.py", "dataclasses.py")
QUESTION = "\n# Now, what does the function above return when its argument is empty?\n"


class Lines:
    """Prints lines and keeps them (for --record)."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def corpus_ids(tok) -> list[int]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / name).read_text() for name in SOURCES if (stdlib / name).exists())
    return list(tok.encode(text))


def log_uniform(rng, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def make_requests(ids, n, max_prompt, max_new, seed) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = log_uniform(rng, 16, max_prompt)
        start = int(rng.integers(0, len(ids) - length))
        out.append(Request(ids[start:start + length], SamplingParams(temperature=0.8, seed=i),
                           log_uniform(rng, 8, max_new), stop_ids=frozenset()))
    return out


def load_now() -> float:
    return os.getloadavg()[0]


def timed(fn, loads: list[str]):
    """Run `fn`, noting the 1-minute load average before and after."""
    before = load_now()
    out = fn()
    loads.append(f"{before:.1f}/{load_now():.1f}")
    return out


def continuous_side(sched: Scheduler, reqs, loads):
    def run():
        t0 = time.perf_counter()
        handles = [sched.submit(r) for r in reqs]
        done = [h.result(timeout=3600) for h in handles]
        wall = time.perf_counter() - t0
        ttft = np.asarray([d.ttft_seconds for d in done]) * 1e3
        tokens = sum(len(d.completion.tokens) for d in done)
        return {"tok_s": tokens / wall, "ttft_p50_ms": np.quantile(ttft, 0.5),
                "ttft_p99_ms": np.quantile(ttft, 0.99), "tokens": tokens}
    return lambda: timed(run, loads)


def static_side(engine: Engine, reqs, batch, loads):
    def run():
        t0 = time.perf_counter()
        tokens, ttft = 0, []
        for g in range(0, len(reqs), batch):
            group = reqs[g:g + batch]
            start = time.perf_counter() - t0
            res = engine.generate(group)
            tokens += sum(len(c.tokens) for c in res.completions)
            ttft += [(start + res.prefill_seconds) * 1e3] * len(group)
        wall = time.perf_counter() - t0
        return {"tok_s": tokens / wall, "ttft_p50_ms": np.quantile(ttft, 0.5),
                "ttft_p99_ms": np.quantile(ttft, 0.99), "tokens": tokens}
    return lambda: timed(run, loads)


def session_side(sched: Scheduler, turn1: list[int], reply: int, turn2: list[int], reuse: bool, loads):
    def run():
        sched.prefix = PrefixCache((1 << 30) if reuse else 0)
        if reuse:  # the first turn, which stores the snapshots
            sched.submit(Request(turn1, max_new_tokens=reply, stop_ids=frozenset())).result(timeout=3600)
        fin = sched.submit(Request(turn2, max_new_tokens=4, stop_ids=frozenset())).result(timeout=3600)
        return {"ttft_ms": fin.ttft_seconds * 1e3, "cached": fin.cached_tokens}
    return lambda: timed(run, loads)


def throughput(args, lm, ids, say: Lines) -> None:
    engine = Engine(lm.model, lm.tokenizer, max_len=args.max_len, prefill_chunk=args.chunk)
    reqs = make_requests(ids, args.clients, args.max_prompt, args.max_new, args.seed)
    outs = np.asarray([r.max_new_tokens for r in reqs])
    prompts = np.asarray([len(r.prompt) for r in reqs])
    groups = [outs[g:g + args.max_batch] for g in range(0, len(outs), args.max_batch)]
    ideal = sum(g.max() for g in groups) / (outs.sum() / args.max_batch)
    sched = Scheduler(engine, max_batch=args.max_batch, prefill_chunk=args.chunk, max_queue=args.clients)
    t0 = time.perf_counter()
    sched.warmup()
    compile_s = time.perf_counter() - t0
    sched.start()
    loads = {"continuous": [], "static": []}
    try:
        stats = alternate({"continuous": continuous_side(sched, reqs, loads["continuous"]),
                           "static": static_side(engine, reqs, args.max_batch, loads["static"])}, args.repeats)
    finally:
        sched.stop()
    c, s = stats["continuous"], stats["static"]
    say("## throughput: continuous batching vs one static batch at a time")
    say(f"{args.clients} clients at once, max_batch {args.max_batch}, context {args.max_len}, prefill chunk "
        f"{args.chunk}; prompts {prompts.min()}..{prompts.max()} tokens (median {int(np.median(prompts))}), "
        f"outputs {outs.min()}..{outs.max()} (median {int(np.median(outs))}, total {outs.sum()}), log-uniform")
    say(f"scheduler warm-up (compiles) {compile_s:.1f} s, excluded; {args.repeats} rounds alternating, after one "
        "warm-up round each")
    say(f"{'':24}{'tok/s':>24}{'TTFT p50 ms':>26}{'TTFT p99 ms':>26}")
    for name, st in (("continuous (scheduler)", c), ("static (Engine.generate)", s)):
        say(f"{name:24}{str(st['tok_s']):>24}{str(st['ttft_p50_ms']):>26}{str(st['ttft_p99_ms']):>26}")
    say(f"throughput ratio of medians (continuous / static): {ratio(c['tok_s'], s['tok_s']):.2f}x   "
        f"(target >= 2x; ideal for these lengths {ideal:.2f}x)")
    say(f"TTFT p50 ratio (static / continuous): {ratio(s['ttft_p50_ms'], c['ttft_p50_ms']):.2f}x")
    say(f"1-min load before/after each timed run: continuous {' '.join(loads['continuous'][1:])}; "
        f"static {' '.join(loads['static'][1:])}")


def session(args, lm, ids, say: Lines) -> None:
    tok = lm.tokenizer
    longest = max(args.history)
    engine = Engine(lm.model, tok, max_len=longest + args.reply + 256, prefill_chunk=args.chunk)
    sched = Scheduler(engine, max_batch=args.max_batch, prefill_chunk=args.chunk, max_queue=4)
    t0 = time.perf_counter()
    sched.warmup()
    compile_s = time.perf_counter() - t0
    sched.start()
    question = list(tok.encode(QUESTION))
    say("## session reuse: the second turn of a long conversation, resumed vs cold")
    say(f"context {engine.max_len}, prefill chunk {args.chunk}, max_batch {args.max_batch}, idle scheduler; "
        f"turn 2 = turn 1 + its {args.reply}-token reply + a {len(question)}-token question; warm-up "
        f"(compiles) {compile_s:.1f} s, excluded; {args.repeats} rounds alternating")
    say(f"{'history':>8}{'turn-2 prompt':>15}{'resumed TTFT ms':>28}{'cached':>8}{'cold TTFT ms':>28}{'cold/resumed':>14}")
    try:
        for hist in args.history:
            turn1 = ids[:hist]
            sched.prefix = PrefixCache(1 << 30)
            first = sched.submit(Request(turn1, max_new_tokens=args.reply, stop_ids=frozenset())).result(timeout=3600)
            turn2 = turn1 + first.completion.tokens + question
            loads = {"resumed": [], "cold": []}
            st = alternate({"resumed": session_side(sched, turn1, args.reply, turn2, True, loads["resumed"]),
                            "cold": session_side(sched, turn1, args.reply, turn2, False, loads["cold"])},
                           args.repeats)
            r, c = st["resumed"], st["cold"]
            say(f"{hist:>8}{len(turn2):>15}{str(r['ttft_ms']):>28}{int(r['cached'].median):>8}"
                f"{str(c['ttft_ms']):>28}{ratio(c['ttft_ms'], r['ttft_ms']):>13.2f}x")
            say(f"{'':8}1-min load before/after each timed run: resumed {' '.join(loads['resumed'][1:])}; "
                f"cold {' '.join(loads['cold'][1:])}")
    finally:
        sched.stop()
    say("target: >= 3x faster time to first token at a few thousand tokens of history")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="preset with random weights (default: the embedded model)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024, help="context of the throughput part")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (k31jax serve's default)")
    ap.add_argument("--max-prompt", type=int, default=480)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--history", type=int, nargs="+", default=[1000, 3000],
                    help="tokens of history for the session part")
    ap.add_argument("--reply", type=int, default=32, help="tokens of the first turn's reply")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-session", action="store_true")
    ap.add_argument("--record", action="store_true", help="write the block into benchmarks/RESULTS.md")
    ap.add_argument("--force", action="store_true", help="record even under load (marked)")
    args = ap.parse_args(argv)
    sess = Session()
    say = Lines()
    lm = load_model(config=args.config)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(lm.model)))
    say(f"model: {args.config or 'the embedded default model (trained)'}, {n_params:,} parameters, "
        f"{lm.model.config.dtype}")
    ids = corpus_ids(lm.tokenizer)
    if not args.skip_throughput:
        throughput(args, lm, ids, say)
    if not args.skip_session:
        session(args, lm, ids, say)
    sess.finish()
    print(f"# {sess.header()}")
    if args.record:
        record("serve", say.lines, sess, force=args.force)


if __name__ == "__main__":
    main()
