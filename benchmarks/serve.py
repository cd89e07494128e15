"""Serving benchmark: continuous batching vs one static batch at a time, and session prefix
reuse vs a cold prefill (issue 14). In-process on the `Scheduler` (no HTTP), so the numbers
are the engine's.

    python benchmarks/serve.py --clients 32 --max-batch 8          # tiny model on CPU
    python benchmarks/serve.py --config <preset> --max-len 8192 --history 4000

1. Throughput and p50 / p99 time to first token for N clients with mixed prompt (16..`--max-prompt`)
   and output (8..`--max-new`) lengths, all submitted at once:
   - continuous: the scheduler (requests join and leave between decode steps);
   - static: the same requests in groups of `max_batch`, each group run to its longest output
     with `Engine.generate` (what a server without continuous batching does).
2. The second turn of a conversation with `--history` tokens: TTFT resumed from the stored
   snapshot vs prefilled cold (prefix cache off).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from k31jax.generate import Engine, Request, SamplingParams, Scheduler, load_model


def _requests(tok, n, max_prompt, max_new, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = tok.encode("".join(chr(97 + c) for c in rng.integers(0, 26, int(rng.integers(16, max_prompt)))))
        out.append(Request(p, SamplingParams(temperature=0.8, seed=i), int(rng.integers(8, max_new)),
                           stop_ids=frozenset()))
    return out


def continuous(sched, reqs):
    t0 = time.perf_counter()
    handles = [sched.submit(r) for r in reqs]
    sched._run_until_idle()
    done = [h.result(timeout=0) for h in handles]
    wall = time.perf_counter() - t0
    return sum(len(d.completion.tokens) for d in done) / wall, [d.ttft_seconds for d in done]


def static(engine, reqs, batch):
    t0 = time.perf_counter()
    tokens, ttft = 0, []
    for g in range(0, len(reqs), batch):
        group = reqs[g:g + batch]
        res = engine.generate(group)
        tokens += sum(len(c.tokens) for c in res.completions)
        ttft += [time.perf_counter() - t0 - res.decode_seconds] * len(group)
    return tokens / (time.perf_counter() - t0), ttft


def session_ttft(engine, args, reuse: bool) -> float:
    sched = Scheduler(engine, max_batch=args.max_batch, prefill_chunk=args.chunk,
                      prefix_cache_bytes=(1 << 30) if reuse else 0)
    sched.warmup()
    first = engine.tokenizer.encode("h" * args.history)
    h = sched.submit(Request(first, max_new_tokens=4, stop_ids=frozenset()))
    sched._run_until_idle()
    h.result(timeout=0)
    second = first + engine.tokenizer.encode(" and the next question?")
    h = sched.submit(Request(second, max_new_tokens=2, stop_ids=frozenset()))
    sched._run_until_idle()
    return h.result(timeout=0).ttft_seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=200)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--history", type=int, default=800, help="tokens of history for the session test")
    args = ap.parse_args(argv)
    lm = load_model(config=args.config)
    engine = Engine(lm.model, lm.tokenizer, max_len=args.max_len, prefill_chunk=args.chunk)
    reqs = _requests(lm.tokenizer, args.clients, args.max_prompt, args.max_new, 0)
    sched = Scheduler(engine, max_batch=args.max_batch, prefill_chunk=args.chunk, max_queue=args.clients)
    sched.warmup()
    static(engine, reqs, args.max_batch)  # compile the static engine's buckets first
    c_tps, c_ttft = continuous(sched, reqs)
    s_tps, s_ttft = static(engine, reqs, args.max_batch)
    q = lambda xs, p: float(np.quantile(xs, p)) * 1e3  # noqa: E731
    print(f"clients {args.clients}, max_batch {args.max_batch}, model {args.config}")
    print(f"continuous: {c_tps:,.1f} tok/s, TTFT p50 {q(c_ttft, .5):,.1f} ms p99 {q(c_ttft, .99):,.1f} ms")
    print(f"static    : {s_tps:,.1f} tok/s, TTFT p50 {q(s_ttft, .5):,.1f} ms p99 {q(s_ttft, .99):,.1f} ms")
    print(f"throughput ratio (continuous / static): {c_tps / s_tps:.2f}x")
    warm, cold = session_ttft(engine, args, True), session_ttft(engine, args, False)
    print(f"second turn at {args.history} tokens of history: TTFT {warm * 1e3:,.1f} ms with session reuse, "
          f"{cold * 1e3:,.1f} ms cold ({cold / warm:.2f}x)")


if __name__ == "__main__":
    main()
