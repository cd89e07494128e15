"""Serving benchmark (issue 14): continuous batching vs one static batch at a time, and the
second turn of a long conversation resumed from the session snapshot vs prefilled cold.
In-process on the `Scheduler` (its own thread, as in `k31jax serve`; no HTTP), so the
numbers are the scheduler's and the engine's.

    .venv/bin/python benchmarks/serve.py [--config PRESET] [--clients 32] [--requests-per-client 4] [--max-batch 8]
                                         [--repeats 3] [--skip-throughput] [--skip-session] [--skip-startup]
                                         [--record]

Model: the embedded default model (`load_model()`: 7.8M parameters, hidden 128, 8 layers, what
`k31jax serve` serves without --ckpt) unless `--config PRESET` (seeded random weights).
Prompts are Python standard-library source text (what the embedded model was trained on).

1. Throughput and p50 / p99 time to first token for `--clients` concurrent clients, each
   sending `--requests-per-client` requests one after another (the next when the last one's
   answer is complete: a closed loop, as agents and chat users do). Prompt and output lengths
   are drawn log-uniformly (many short, a few long, as chat traffic is): prompts
   16..`--max-prompt` tokens, outputs 8..`--max-new` tokens. Sampling at temperature 0.8 with
   a seed per request and no stop ids, so every request makes exactly its output length on both
   sides (the same tokens are counted).
   - continuous: the `Scheduler` with `--max-batch` slots on its thread, one client thread per
     client: requests join and leave between decode steps, prompts are prefilled in
     `--chunk`-token calls between decode steps;
   - static: a server without continuous batching, simulated exactly: it takes the first
     `--max-batch` waiting requests, runs them to the longest output with `Engine.generate`
     (the group's prompts padded to one bucket), answers them all, then takes the next group;
     a client's next request arrives when its answer is complete. Same model, context length,
     chunk and requests.
   TTFT: from a request's submission to its first token (queueing included). "Ideal" is the
   ratio a perfect continuous batcher would reach if a decode step cost the same whatever rows
   it holds and prefill were free: static's decode steps (each group's longest output, summed)
   over all outputs / max_batch. It depends on the length spread: with uniform 8..128 outputs
   it is ~1.7x, so no batcher reaches 2x there. `--requests-per-client 1` is one burst (all
   requests at t = 0): the end of that run, when the last long requests decode alone, weighs
   more.
2. Session reuse: a conversation whose first turn is `--history` tokens; the second turn is the
   first prompt + the reply it got + a new question (~40 tokens). Its TTFT on an idle
   scheduler, resumed from the snapshot stored at the end of turn 1 (prefix cache on) vs
   prefilled cold (prefix cache off: the whole prompt in `--chunk`-token calls). The same
   compiled programs serve both sides.
3. Shared prefix (issue 29, `--skip-shared`): `--shared-clients` clients whose prompts share a
   `--shared-prefix`-token head (a system prompt and tool list), all at once, greedy: time to
   first token with the cross-session prefix cache (the second prompt that reaches the shared
   head stores the state there, a branch point; the rest resume from it) vs with no prefix
   cache; the outputs must be the same on both sides. Target: >= 5x at 32 clients x 2,000 tokens.
4. Compaction (issue 29, `--skip-compaction`): an agent history of `--results` tool results
   of `--result-tokens` tokens; the turn that brought them is prefilled with each result's start
   marked (as `k31jax serve` marks a turn's new tool results), then the results from the
   `--compact-from`-th to the one before the last are replaced by stubs
   (`k31jax.chat.compact_history`; the first ones, the documents the task is about, stay): time
   to first token of the next turn
   resumed from the state stored before the first stub vs a cold prefill of the compacted
   history (prefix cache off); the greedy outputs must be the same.
5. Start-up (issue 32): `k31jax serve` as users start it (the embedded model, its default
   context, chunk and batch; `--quiet`), from the process start to its first /health answer
   (listening), to the first answered request (a chat completion of 8 tokens, sent as soon as
   it listens: it waits for the programs it needs), and to the end of the warm-up (every
   program compiled, /health 200). Cold: an empty persistent compile cache
   (`K31JAX_COMPILE_CACHE`); warm: one that an earlier start filled (one start fills it before
   the timed rounds). Targets: the first answer within 30 s cold, 10 s warm, on the 2-core
   machine.
Method (`benchmarks/_harness.py`): in each part the two sides alternate, one warm-up each
(throughput: every program of the run compiled and run once with 2 output tokens; start-up:
the start that fills the warm cache), then `--repeats` rounds; median [min, max]; the 1-minute
load average before and after every timed run (it counts this benchmark's own 2 busy threads)
and the CPU other processes used during the timed runs (`_harness.OtherCPU`). `--record` writes
the printed blocks into RESULTS.md's section `serve`: parts 1-2 as block `serve`, 3 as
`serve_shared`, 4 as `serve_compaction`, 5 as `serve_startup` (refused when other processes
shared the cores, unless `--force`, which marks it).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import OtherCPU, Session, add_record_arguments, alternate, ratio, record  # noqa: E402

from k31jax import count_params  # noqa: E402
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


def timed(fn, loads: list[str], foreign: OtherCPU):
    """Run `fn`, noting the 1-minute load average before and after and other processes' CPU."""
    before = load_now()
    foreign.start()
    out = fn()
    foreign.stop()
    loads.append(f"{before:.1f}/{load_now():.1f}")
    return out


def _summary(tokens: int, wall: float, ttft_ms) -> dict[str, float]:
    return {"tok_s": tokens / wall, "ttft_p50_ms": np.quantile(ttft_ms, 0.5),
            "ttft_p99_ms": np.quantile(ttft_ms, 0.99), "tokens": tokens}


def continuous_side(sched: Scheduler, clients: list[list[Request]]):
    """One thread per client, each sending its requests one after another."""
    def run():
        done: list = []

        def client(reqs):
            for r in reqs:
                done.append(sched.submit(r).result(timeout=3600))

        threads = [threading.Thread(target=client, args=(c,)) for c in clients]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        return _summary(sum(len(d.completion.tokens) for d in done), wall,
                        np.asarray([d.ttft_seconds for d in done]) * 1e3)
    return run


def static_order(clients: list[list[Request]], batch: int) -> list[list[tuple[int, int]]]:
    """The groups a static server forms: first come, first served, `batch` at a time; a client's
    next request arrives when its group ends, behind the requests already waiting."""
    waiting = collections.deque((c, 0) for c in range(len(clients)))
    groups = []
    while waiting:
        group = [waiting.popleft() for _ in range(min(batch, len(waiting)))]
        groups.append(group)
        waiting.extend((c, k + 1) for c, k in group if k + 1 < len(clients[c]))
    return groups


def static_side(engine: Engine, clients: list[list[Request]], batch: int):
    groups = static_order(clients, batch)

    def run():
        sent = {(c, 0): 0.0 for c in range(len(clients))}  # submission times
        tokens, ttft = 0, []
        t0 = time.perf_counter()
        for group in groups:
            start = time.perf_counter() - t0
            res = engine.generate([clients[c][k] for c, k in group])
            end = time.perf_counter() - t0
            tokens += sum(len(c.tokens) for c in res.completions)
            ttft += [(start + res.prefill_seconds - sent[key]) * 1e3 for key in group]
            sent.update({(c, k + 1): end for c, k in group})
        return _summary(tokens, time.perf_counter() - t0, np.asarray(ttft))
    return run, groups


def session_side(sched: Scheduler, turn1: list[int], reply: int, turn2: list[int], reuse: bool, loads, foreign):
    def run():
        sched.prefix = PrefixCache((1 << 30) if reuse else 0)
        if reuse:  # the first turn, which stores the snapshots
            sched.submit(Request(turn1, max_new_tokens=reply, stop_ids=frozenset())).result(timeout=3600)
        fin = sched.submit(Request(turn2, max_new_tokens=4, stop_ids=frozenset())).result(timeout=3600)
        return {"ttft_ms": fin.ttft_seconds * 1e3, "cached": fin.cached_tokens}
    return lambda: timed(run, loads, foreign)


def throughput(args, lm, ids, say: Lines) -> None:
    engine = Engine(lm.model, lm.tokenizer, max_len=args.max_len, prefill_chunk=args.chunk)
    n, per = args.clients, args.requests_per_client
    reqs = make_requests(ids, n * per, args.max_prompt, args.max_new, args.seed)
    clients = [reqs[c * per:(c + 1) * per] for c in range(n)]
    outs = np.asarray([r.max_new_tokens for r in reqs])
    prompts = np.asarray([len(r.prompt) for r in reqs])
    sched = Scheduler(engine, max_batch=args.max_batch, prefill_chunk=args.chunk, max_queue=n)
    t0 = time.perf_counter()
    sched.warmup()
    static_run, groups = static_side(engine, clients, args.max_batch)
    for group in groups:  # compile and run every static group shape once (2 tokens each)
        engine.generate([dataclasses.replace(clients[c][k], max_new_tokens=2) for c, k in group])
    compile_s = time.perf_counter() - t0
    ideal = sum(max(clients[c][k].max_new_tokens for c, k in g) for g in groups) / (outs.sum() / args.max_batch)
    sched.start()
    loads = {"continuous": [], "static": []}
    foreign = OtherCPU()
    try:
        # the continuous side's short warm-up round (the static one ran above, compiling)
        continuous_side(sched, [[dataclasses.replace(r, max_new_tokens=2) for r in c] for c in clients])()
        continuous_run = continuous_side(sched, clients)
        stats = alternate({"continuous": lambda: timed(continuous_run, loads["continuous"], foreign),
                           "static": lambda: timed(static_run, loads["static"], foreign)}, args.repeats, warmup=0)
    finally:
        sched.stop()
    c, s = stats["continuous"], stats["static"]
    say("## throughput: continuous batching vs one static batch at a time")
    say(f"{n} clients x {per} requests one after another, max_batch {args.max_batch}, context {args.max_len}, "
        f"prefill chunk {args.chunk}; prompts {prompts.min()}..{prompts.max()} tokens (median "
        f"{int(np.median(prompts))}), outputs {outs.min()}..{outs.max()} (median {int(np.median(outs))}, total "
        f"{outs.sum()}), log-uniform")
    say(f"warm-up (scheduler and static programs compiled, a 2-token round each) {compile_s:.1f} s, excluded; "
        f"{args.repeats} rounds alternating")
    say(f"{'':24} {'tok/s':>23} {'TTFT p50 ms':>27} {'TTFT p99 ms':>27}")
    for name, st in (("continuous (scheduler)", c), ("static (Engine.generate)", s)):
        say(f"{name:24} {str(st['tok_s']):>23} {str(st['ttft_p50_ms']):>27} {str(st['ttft_p99_ms']):>27}")
    say(f"throughput ratio of medians (continuous / static): {ratio(c['tok_s'], s['tok_s']):.2f}x   "
        f"(target >= 2x; ideal for these lengths {ideal:.2f}x)")
    say(f"TTFT p50 ratio (static / continuous): {ratio(s['ttft_p50_ms'], c['ttft_p50_ms']):.2f}x")
    say(f"1-min load before/after each timed run: continuous {' '.join(loads['continuous'])}; "
        f"static {' '.join(loads['static'])}; other processes' CPU during them: {foreign.cores() or 0:.2f} cores")


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
            foreign = OtherCPU()
            st = alternate({"resumed": session_side(sched, turn1, args.reply, turn2, True, loads["resumed"], foreign),
                            "cold": session_side(sched, turn1, args.reply, turn2, False, loads["cold"], foreign)},
                           args.repeats)
            r, c = st["resumed"], st["cold"]
            say(f"{hist:>8}{len(turn2):>15}{str(r['ttft_ms']):>28}{int(r['cached'].median):>8}"
                f"{str(c['ttft_ms']):>28}{ratio(c['ttft_ms'], r['ttft_ms']):>13.2f}x")
            say(f"{'':8}1-min load before/after each timed run: resumed {' '.join(loads['resumed'][1:])}; "
                f"cold {' '.join(loads['cold'][1:])}; other processes' CPU: {foreign.cores() or 0:.2f} cores")
    finally:
        sched.stop()
    say("target: >= 3x faster time to first token at a few thousand tokens of history")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_start(cache: Path, log: Path, timeout: float = 1800) -> dict[str, float]:
    """Start `k31jax serve` on `cache`; seconds from the process start to its first /health
    answer, its first answered chat completion and the end of its warm-up. Stops it."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "k31jax.cli", "serve", "--port", str(port), "--quiet"]
    env = {**os.environ, "K31JAX_COMPILE_CACHE": str(cache)}
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT)
    try:
        def since() -> float:
            if proc.poll() is not None:
                raise RuntimeError(f"k31jax serve exited ({proc.returncode}): {log.read_text()[-2000:]}")
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"k31jax serve: no answer within {timeout} s")
            return time.perf_counter() - t0

        while True:
            try:
                httpx.get(f"{base}/health", timeout=5)
                listening = since()
                break
            except httpx.HTTPError:
                since()
                time.sleep(0.05)
        r = httpx.post(f"{base}/v1/chat/completions", timeout=timeout, json={
            "model": "k31jax-embedded", "max_tokens": 8,
            "messages": [{"role": "user", "content": "def add(a, b):"}]})
        r.raise_for_status()
        answered = since()
        while not httpx.get(f"{base}/health", timeout=5).json()["ready"]:
            since()
            time.sleep(0.2)
        return {"listening_s": listening, "first_answer_s": answered, "ready_s": since()}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def startup(args, say: Lines) -> None:
    root = Path(tempfile.mkdtemp(prefix="k31jax-serve-bench-"))
    warm_cache = root / "warm"
    loads = {"cold": [], "warm": []}
    foreign = OtherCPU()
    counter = iter(range(1 << 30))

    def cold():
        cache = root / f"cold{next(counter)}"
        try:
            return timed(lambda: serve_start(cache, root / "serve.log"), loads["cold"], foreign)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def warm():
        return timed(lambda: serve_start(warm_cache, root / "serve.log"), loads["warm"], foreign)

    try:
        serve_start(warm_cache, root / "serve.log")  # the warm side's warm-up: fills its cache
        stats = alternate({"cold": cold, "warm": warm}, args.repeats, warmup=0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    say("## start-up: `k31jax serve` (embedded model, defaults) to its first answered request")
    say(f"from the process start, seconds; cold = empty compile cache, warm = one an earlier start filled; "
        f"{args.repeats} rounds alternating after one start that fills the warm cache")
    say(f"{'':6}{'listening':>26}{'first answer':>26}{'warm-up done':>26}")
    for name in ("cold", "warm"):
        st = stats[name]
        say(f"{name:6}{str(st['listening_s']):>26}{str(st['first_answer_s']):>26}{str(st['ready_s']):>26}")
    say(f"targets: first answer <= 30 s cold ({stats['cold']['first_answer_s'].median:.1f}), <= 10 s warm "
        f"({stats['warm']['first_answer_s'].median:.1f})")
    say(f"1-min load before/after each timed run: cold {' '.join(loads['cold'])}; warm {' '.join(loads['warm'])}; "
        f"other processes' CPU during them: {foreign.cores() or 0:.2f} cores")


def shared_prefix(args, lm, ids, say: Lines) -> None:
    """Issue 29: `--shared-clients` clients whose prompts share a `--shared-prefix`-token head
    (one system prompt and tool list, as agents send), all at once, greedy; time to first token
    with the cross-session prefix cache (the second client stores the branch point, the rest
    resume from it) vs without it; the outputs must be the same."""
    tok = lm.tokenizer
    head = ids[:args.shared_prefix]
    rng = np.random.default_rng(args.seed)
    prompts = []
    for i in range(args.shared_clients):
        start = int(rng.integers(args.shared_prefix, len(ids) - 64))
        prompts.append(head + tok.encode(f"\n# client {i}\n") + ids[start:start + 24])
    engine = Engine(lm.model, tok, max_len=args.shared_prefix + 256, prefill_chunk=args.chunk)
    sched = Scheduler(engine, max_batch=args.max_batch, prefill_chunk=args.chunk, max_queue=args.shared_clients)
    t0 = time.perf_counter()
    sched.warmup()
    compile_s = time.perf_counter() - t0
    sched.start()
    outputs: dict[str, list] = {}
    held: dict[str, int] = {}  # the prefix cache after a round
    loads = {"shared": [], "none": []}
    foreign = OtherCPU()

    def side(name: str, cache_bytes: int):
        def run():
            sched.prefix = PrefixCache(cache_bytes)  # each round starts empty: the first clients prefill cold
            handles = [sched.submit(Request(p, SamplingParams(temperature=0.0), 8, stop_ids=frozenset()))
                       for p in prompts]
            done = [h.result(timeout=3600) for h in handles]
            outputs.setdefault(name, [d.completion.tokens for d in done])
            assert outputs[name] == [d.completion.tokens for d in done]
            ttft = np.asarray([d.ttft_seconds * 1e3 for d in done])
            if cache_bytes:
                held.update(bytes=sched.prefix.bytes, held=sched.prefix.held_tokens, snapshots=len(sched.prefix),
                            tokens=sum(len(s) for s in sched.prefix.sequences()))
            return {"ttft_p50_ms": np.quantile(ttft, 0.5), "ttft_mean_ms": ttft.mean(),
                    "cached": sum(d.cached_tokens for d in done)}
        return lambda: timed(run, loads[name], foreign)

    try:
        st = alternate({"shared": side("shared", 1 << 30), "none": side("none", 0)}, args.repeats)
    finally:
        sched.stop()
    same = outputs["shared"] == outputs["none"]
    say("## shared prefix: clients with one system prompt, the cross-session prefix cache vs none")
    say(f"{args.shared_clients} clients at once, prompts = the same {args.shared_prefix}-token head + ~30 own "
        f"tokens, 8 greedy tokens each; max_batch {args.max_batch}, prefill chunk {args.chunk}; warm-up "
        f"(compiles) {compile_s:.1f} s, excluded; {args.repeats} rounds alternating")
    say(f"{'':8}{'TTFT p50 ms':>27}{'TTFT mean ms':>27}{'cached tokens':>15}")
    for name in ("shared", "none"):
        say(f"{name:8}{str(st[name]['ttft_p50_ms']):>27}{str(st[name]['ttft_mean_ms']):>27}"
            f"{st[name]['cached'].median:>15.0f}")
    say(f"TTFT p50 ratio (none / shared): {ratio(st['none']['ttft_p50_ms'], st['shared']['ttft_p50_ms']):.2f}x "
        f"(target >= 5x); mean {ratio(st['none']['ttft_mean_ms'], st['shared']['ttft_mean_ms']):.2f}x; "
        f"greedy outputs identical: {same}")
    say(f"prefix cache after a round: {held['snapshots']} snapshots of {held['tokens']:,} tokens in all, the radix "
        f"tree holding {held['held']:,} tokens' rows (each shared prefix once): {held['bytes'] / 2**20:.1f} MiB")
    say(f"1-min load before/after each timed run: shared {' '.join(loads['shared'])}; none "
        f"{' '.join(loads['none'])}; other processes' CPU during them: {foreign.cores() or 0:.2f} cores")


def compaction(args, lm, ids, say: Lines) -> None:
    """Issue 29: an agent history of `--results` tool results (`--result-tokens` each), the turn
    that brought the last of them prefilled with its tool results marked (as `k31jax serve`
    marks them), then every result but the last compacted to a stub; time to first token of the
    next turn resumed from the state stored before the first stub vs a cold prefill of the same
    compacted history."""
    from k31jax.chat import apply_chat_template, compact_history

    tok = lm.tokenizer
    history = [{"role": "system", "content": "You are a coding agent."},
               {"role": "user", "content": "Find where the queue is drained."}]
    for i in range(args.results):
        start = 4000 + i * args.result_tokens
        history.append({"role": "assistant", "content": "", "reasoning_content": f"read part {i}", "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]})
        history.append({"role": "tool", "tool_call_id": f"call_{i}", "content": tok.decode(
            ids[start:start + args.result_tokens])})
    question = {"role": "user", "content": "Which function drains it?"}

    def render(msgs, generation=True):
        return apply_chat_template(tok, msgs, thinking=False, add_generation_prompt=generation)

    before = render(history + [question])
    marks = [len(render(history[:k], False)) for k, m in enumerate(history) if m["role"] == "tool"]
    # the results from the `--compact-from`-th on are replaced but the last (the first ones, a
    # spec or the files the task is about, stay); the rest of the history is kept
    compacted, done = compact_history(history, tok, documents=[f"call_{i}" for i in
                                                               range(args.compact_from, args.results - 1)])
    after = render(compacted + [question])
    first_edit = marks[args.compact_from]  # where the first replaced result began
    assert after[:first_edit] == before[:first_edit]
    engine = Engine(lm.model, tok, max_len=len(before) + 64, prefill_chunk=args.chunk)
    sched = Scheduler(engine, max_batch=args.max_batch, prefill_chunk=args.chunk, max_queue=4)
    t0 = time.perf_counter()
    sched.warmup()
    compile_s = time.perf_counter() - t0
    sched.start()
    loads = {"resumed": [], "cold": []}
    foreign = OtherCPU()
    outputs: dict[str, list] = {}

    def side(name: str):
        def run():
            sched.prefix = PrefixCache((1 << 30) if name == "resumed" else 0)
            if name == "resumed":  # the turn before the compaction, which stores the marked states (untimed)
                sched.submit(Request(before, max_new_tokens=2, snapshot_at=marks)).result(timeout=3600)
            fin = sched.submit(Request(after, SamplingParams(temperature=0.0), 8,
                                       stop_ids=frozenset())).result(timeout=3600)
            outputs.setdefault(name, fin.completion.tokens)
            return {"ttft_ms": fin.ttft_seconds * 1e3, "cached": fin.cached_tokens}
        return lambda: timed(run, loads[name], foreign)

    try:
        st = alternate({"resumed": side("resumed"), "cold": side("cold")}, args.repeats)
    finally:
        sched.stop()
    say("## compaction: the turn after a compaction, resumed vs a cold prefill of the compacted history")
    say(f"{args.results} tool results of {args.result_tokens} tokens; results {args.compact_from}.."
        f"{args.results - 2} replaced by stubs "
        f"({len(before)} -> {len(after)} prompt tokens; the first stub at token {first_edit}); prefill chunk "
        f"{args.chunk}; warm-up (compiles) {compile_s:.1f} s, excluded; {args.repeats} rounds alternating")
    say(f"{'':9}{'TTFT ms':>27}{'cached tokens':>15}")
    for name in ("resumed", "cold"):
        say(f"{name:9}{str(st[name]['ttft_ms']):>27}{st[name]['cached'].median:>15.0f}")
    say(f"cold / resumed: {ratio(st['cold']['ttft_ms'], st['resumed']['ttft_ms']):.2f}x; the resumed turn reuses "
        f"the history up to the first stub ({first_edit} tokens): {st['resumed']['cached'].median >= first_edit}; "
        f"greedy outputs identical: {outputs['resumed'] == outputs['cold']}")
    say(f"1-min load before/after each timed run: resumed {' '.join(loads['resumed'])}; cold "
        f"{' '.join(loads['cold'])}; other processes' CPU during them: {foreign.cores() or 0:.2f} cores")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="preset with random weights (default: the embedded model)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests-per-client", type=int, default=4)
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
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--skip-shared", action="store_true")
    ap.add_argument("--skip-compaction", action="store_true")
    ap.add_argument("--results", type=int, default=8, help="tool results in the compaction part's history")
    ap.add_argument("--result-tokens", type=int, default=400, help="tokens of each of those results")
    ap.add_argument("--compact-from", type=int, default=4,
                    help="the compaction part replaces results compact-from .. results-2 (0-based)")
    ap.add_argument("--shared-clients", type=int, default=32)
    ap.add_argument("--shared-prefix", type=int, default=2000, help="tokens the shared-prefix clients share")
    add_record_arguments(ap)
    args = ap.parse_args(argv)
    sess = Session()
    say, say_startup = Lines(), Lines()
    say_shared, say_compaction = Lines(), Lines()
    if not (args.skip_throughput and args.skip_session and args.skip_shared and args.skip_compaction):
        lm = load_model(config=args.config)
        n_params = count_params(lm.model.config).total  # packed MXFP4 stores two parameters per byte
        say(f"model: {args.config or 'the embedded default model (trained)'}, {n_params:,} parameters, "
            f"{lm.model.config.dtype}")
        ids = corpus_ids(lm.tokenizer)
        if not args.skip_throughput:
            throughput(args, lm, ids, say)
        if not args.skip_session:
            session(args, lm, ids, say)
        if not args.skip_shared:
            shared_prefix(args, lm, ids, say_shared)
        if not args.skip_compaction:
            compaction(args, lm, ids, say_compaction)
    if not args.skip_startup:
        startup(args, say_startup)
    sess.finish()
    print(f"# {sess.header()}")
    if args.record:
        parts = [("startup", say_startup.lines), ("shared", say_shared.lines), ("compaction", say_compaction.lines)]
        if not (args.skip_throughput and args.skip_session):  # (`say` also holds the model line)
            parts.insert(0, (None, say.lines))
        for part, lines in parts:
            if lines:
                record("serve", lines, sess, part=part, force=args.force)


if __name__ == "__main__":
    main()
