"""Constrained decoding (issue 29): tool-call reliability and JSON output through `k31jax serve`
with and without its grammar, and the grammar's cost per decode step.

    .venv/bin/python benchmarks/grammar.py [--requests 500] [--json-requests 100] [--repeats 3]
                                           [--skip-reliability] [--skip-overhead] [--record]

Model: the embedded default model (what `k31jax serve` serves without --ckpt). It was trained
on Python source, not on tool use, so it is the hard case: left alone it does not write the K3
call structure at all.

1. Reliability. Two `k31jax serve` processes on the embedded model: the default (constrained
   decoding) and `--no-grammar`. Each gets the same `--requests` requests, drawn from one seed:
   1-3 tools with random JSON schemas (nested objects, enums, arrays with item bounds, integers
   and numbers with bounds, booleans, nullable values, required and optional keys,
   `additionalProperties: false`), `strict: true`; `tool_choice` required, named or auto;
   OpenAI Chat Completions or Anthropic Messages through the official clients, streamed or not;
   thinking on or off; temperature 1 with a seed per request; 8 requests at a time. Every returned call is checked:
   its name is a declared tool, its arguments parse (the OpenAI string with `json.loads`; the
   Anthropic `input`) and validate against the tool's schema (`jsonschema`, draft 2020-12).
   A required or named choice that returns no call counts as failed. Then `--json-requests`
   requests with `response_format` `json_schema` (OpenAI) or `output_config.format` (Anthropic)
   on random schemas: the content must parse and validate.
2. Overhead. In-process `Scheduler` (batch 8) on 8 concurrent tool-choice-required requests
   with strict random schemas, with and without the grammar (same requests; the grammar holds
   the tool choice, the forcer does without it); the median decode step (dispatch to every
   row's token handled, `Scheduler.step_seconds`) over the steps that ran all 8 rows; the two
   sides alternate, `--repeats` rounds after one warm-up. Target: the grammar adds <= 10% to a
   step. Also the host time of one row's mask (`Scheduler.grammar_seconds`), filled while the
   device runs the step's forward pass.

`--record` writes the printed blocks into RESULTS.md's section `grammar` (refused when other
processes shared the cores, unless `--force`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

WORDS = ("city", "unit", "days", "mode", "query", "limit", "tags", "owner", "price", "active", "level", "note",
         "region", "items", "count", "label", "scope", "target", "format", "depth")


# ---- random schemas ----------------------------------------------------------------------
def random_value_schema(rng: random.Random, depth: int) -> dict:
    """One property's schema: a scalar, an enum, an array or (above depth 0) a nested object."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array", "nullable"]
    if depth < 2:
        kinds += ["object", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string"}
    if kind == "integer":
        lo = rng.randint(-5, 5)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "north", "south", "fast", "slow"],
                                                      rng.randint(2, 4))}
    if kind == "nullable":
        return {"type": ["integer", "null"]}
    if kind == "array":
        item = rng.choice([{"type": "integer"}, {"type": "string"}, {"type": "boolean"},
                           {"type": "string", "enum": ["a", "b", "c"]}])
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1), "maxItems": rng.randint(2, 4)}
    return random_object_schema(rng, depth + 1)


def random_object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(WORDS, rng.randint(1, 4 if depth else 5))
    props = {n: random_value_schema(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_tools(rng: random.Random) -> list[tuple[str, dict]]:
    names = rng.sample(["get_weather", "search_docs", "create_ticket", "send_mail", "book_room", "run_query"],
                       rng.randint(1, 3))
    return [(n, random_object_schema(rng)) for n in names]


def schema_error(schema: dict, value) -> str | None:
    """Why `value` is not valid against `schema` (draft 2020-12), or None."""
    import jsonschema

    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(value))
    return None if err is None else err.message


# ---- one server ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    """`k31jax serve` on 127.0.0.1 (the embedded model unless `args` say otherwise), stopped by its pid."""

    args: tuple[str, ...] = ()
    log: Path | None = None
    proc: subprocess.Popen | None = None
    base: str = ""

    def __enter__(self) -> "Server":
        import httpx

        port = _free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.log = self.log or Path(tempfile.mkstemp(prefix="k31jax-grammar-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "k31jax.cli", "serve", "--port", str(port), "--quiet", *self.args]
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
        deadline = time.time() + 1200
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"k31jax serve exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).json().get("ready"):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.__exit__()
        raise TimeoutError(f"k31jax serve was not ready in time: {self.log.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)

    def model(self) -> str:
        import httpx

        return httpx.get(f"{self.base}/v1/models", timeout=10).json()["data"][0]["id"]


# ---- the suites ----------------------------------------------------------------------------
@dataclasses.dataclass
class Tally:
    requests: int = 0
    calls: int = 0
    bad_calls: int = 0  # unknown name, arguments that do not parse or do not validate
    missing_calls: int = 0  # tool choice required / named, no call returned
    outputs: int = 0  # JSON suite: replies checked
    bad_outputs: int = 0  # JSON suite: content that does not parse or validate
    errors: int = 0  # requests the server or client failed
    examples: list = dataclasses.field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 3:
            self.examples.append(what[:200])


def _openai_call(client, model, messages, tools, choice, stream, thinking, max_tokens, seed):
    kw = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=1.0, seed=seed,
              tools=[{"type": "function", "function": {"name": n, "parameters": s, "strict": True}} for n, s in tools],
              tool_choice=choice, reasoning_effort=None if thinking else "none")
    if not stream:
        msg = client.chat.completions.create(**kw).choices[0].message
        return [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    calls: dict[int, list] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice_ in chunk.choices:
            for tc in choice_.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += (tc.function.name or "") if tc.function else ""
                entry[1] += (tc.function.arguments or "") if tc.function else ""
    return [tuple(calls[i]) for i in sorted(calls)]


def _anthropic_call(client, model, messages, tools, choice, stream, thinking, max_tokens, seed):
    # (temperature and seed through extra_body: newer SDKs dropped temperature from the signature)
    kw = dict(model=model, messages=messages, max_tokens=max_tokens,
              tools=[{"name": n, "input_schema": s, "strict": True} for n, s in tools],
              thinking={"type": "enabled", "budget_tokens": 64} if thinking else {"type": "disabled"},
              extra_body={"seed": seed, "temperature": 1.0})
    if choice is not None:
        kw["tool_choice"] = choice
    if stream:
        with client.messages.stream(**kw) as st:
            message = st.get_final_message()
    else:
        message = client.messages.create(**kw)
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


def _clients(base: str):
    import anthropic
    import openai

    return (openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=900),
            anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=900))


def _concurrently(check, specs, workers: int) -> Tally:
    """`check(i, spec, tally)` for every spec, `workers` at a time (the server batches them);
    each on its own tally, merged in request order."""
    import concurrent.futures

    def one(item):
        tally = Tally(requests=1)
        check(*item, tally)
        return tally

    total = Tally()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for t in pool.map(one, enumerate(specs)):
            for field in ("requests", "calls", "bad_calls", "missing_calls", "outputs", "bad_outputs", "errors"):
                setattr(total, field, getattr(total, field) + getattr(t, field))
            for example in t.examples:
                total.note(example)
    return total


def tool_suite(base: str, model: str, n: int, seed: int, max_tokens: int = 320, workers: int = 8) -> Tally:
    oai, anth = _clients(base)
    rng = random.Random(seed)
    specs = []
    for _ in range(n):  # drawn up front, so the requests do not depend on the order they finish in
        tools = random_tools(rng)
        specs.append(dict(tools=tools, mode=rng.choice(["required", "required", "named", "auto"]),
                          name=rng.choice(tools)[0], api=rng.choice(["openai", "anthropic"]),
                          stream=rng.random() < 0.5, thinking=rng.random() < 0.3))

    def check(i, spec, tally):
        tools, mode, name, api, stream = spec["tools"], spec["mode"], spec["name"], spec["api"], spec["stream"]
        messages = [{"role": "user", "content": f"Call {name} for request {i}."}]
        try:
            if api == "openai":
                choice = {"required": "required", "auto": "auto",
                          "named": {"type": "function", "function": {"name": name}}}[mode]
                calls = _openai_call(oai, model, messages, tools, choice, stream, spec["thinking"], max_tokens, i)
            else:
                choice = {"required": {"type": "any"}, "auto": {"type": "auto"},
                          "named": {"type": "tool", "name": name}}[mode]
                calls = _anthropic_call(anth, model, messages, tools, choice, stream, spec["thinking"], max_tokens, i)
        except Exception as e:  # a client that cannot read the reply counts against the server
            tally.errors += 1
            tally.note(f"request {i} ({api}, stream={stream}): {type(e).__name__}: {e}")
            return
        if mode != "auto" and not calls:
            tally.missing_calls += 1
            tally.note(f"request {i} ({api}, {mode}): no call")
        schemas = dict(tools)
        for call_name, arguments in calls:
            tally.calls += 1
            if mode == "named" and call_name != name or call_name not in schemas:
                tally.bad_calls += 1
                tally.note(f"request {i}: call to {call_name!r}")
                continue
            try:
                value = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError as e:
                tally.bad_calls += 1
                tally.note(f"request {i}: arguments do not parse: {e}")
                continue
            why = schema_error(schemas[call_name], value)
            if why is not None:
                tally.bad_calls += 1
                tally.note(f"request {i} ({api}): {why}")

    return _concurrently(check, specs, workers)


def json_suite(base: str, model: str, n: int, seed: int, max_tokens: int = 320, workers: int = 8) -> Tally:
    oai, anth = _clients(base)
    rng = random.Random(seed + 1)
    specs = [dict(schema=random_object_schema(rng), api=rng.choice(["openai", "anthropic"]),
                  thinking=rng.random() < 0.3) for _ in range(n)]

    def check(i, spec, tally):
        schema, api, thinking = spec["schema"], spec["api"], spec["thinking"]
        messages = [{"role": "user", "content": f"Describe item {i} as JSON."}]
        try:
            if api == "openai":
                text = oai.chat.completions.create(
                    model=model, messages=messages, max_tokens=max_tokens, temperature=1.0, seed=i,
                    reasoning_effort=None if thinking else "none",
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "item", "schema": schema, "strict": True}},
                ).choices[0].message.content
            else:
                message = anth.messages.create(
                    model=model, messages=messages, max_tokens=max_tokens,
                    thinking={"type": "enabled", "budget_tokens": 64} if thinking else {"type": "disabled"},
                    output_config={"format": {"type": "json_schema", "schema": schema}},
                    extra_body={"seed": i, "temperature": 1.0})
                text = "".join(b.text for b in message.content if b.type == "text")
        except Exception as e:
            tally.errors += 1
            tally.note(f"request {i} ({api}): {type(e).__name__}: {e}")
            return
        tally.outputs += 1
        try:
            value = json.loads(text or "")
        except json.JSONDecodeError:
            tally.bad_outputs += 1
            tally.note(f"request {i} ({api}): content does not parse: {(text or '')[:80]!r}")
            return
        why = schema_error(schema, value)
        if why is not None:
            tally.bad_outputs += 1
            tally.note(f"request {i} ({api}): {why}")

    return _concurrently(check, specs, workers)


def reliability(args, say) -> None:
    sides = {"grammar": Server(("--max-len", "2048", "--prefill-chunk", "128")),
             "no grammar": Server(("--max-len", "2048", "--prefill-chunk", "128", "--no-grammar"))}
    results = {}
    for name, server in sides.items():
        with server:
            model = server.model()
            t0 = time.perf_counter()
            results[name] = (tool_suite(server.base, model, args.requests, args.seed),
                             json_suite(server.base, model, args.json_requests, args.seed),
                             time.perf_counter() - t0)
    say(f"## reliability: {args.requests} tool-call requests, {args.json_requests} JSON-schema replies "
        "(embedded model, random strict schemas, both APIs, streamed and not)")
    say(f"{'':12}{'calls':>7}{'bad calls':>11}{'missing':>9}{'errors':>8}{'JSON bad':>10}{'seconds':>9}")
    for name, (tools, js, seconds) in results.items():
        say(f"{name:12}{tools.calls:>7}{tools.bad_calls:>11}{tools.missing_calls:>9}{tools.errors + js.errors:>8}"
            f"{f'{js.bad_outputs}/{js.outputs}':>10}{seconds:>9.0f}")
    for name, (tools, js, _) in results.items():
        for example in tools.examples + js.examples:
            say(f"  {name}: {example}")


# ---- overhead ------------------------------------------------------------------------------
def overhead(args, say) -> None:
    from _harness import Stats, alternate
    from k31jax.chat import apply_chat_template
    from k31jax.generate import (Engine, OutputGrammar, Request, SamplingParams, Scheduler, ToolChoice,
                                 ToolSchema, load_model)

    lm = load_model()
    tok = lm.tokenizer
    engine = Engine(lm.model, tok, max_len=2048, prefill_chunk=128)
    sched = Scheduler(engine, max_batch=8, prefill_chunk=128)
    sched.warmup()
    rng = random.Random(args.seed)
    batch = []
    for i in range(8):
        tools = random_tools(rng)
        specs = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in tools]
        prompt = apply_chat_template(tok, [{"role": "user", "content": f"Call a tool ({i})."}], specs,
                                     thinking=False, tool_choice="required")
        grammar = OutputGrammar(tuple(ToolSchema(n, json.dumps(s), True) for n, s in tools), "required")
        batch.append((prompt, grammar, ToolChoice("required", tuple(n for n, _ in tools))))

    def side(constrained: bool):
        def run() -> dict[str, float]:
            sched.step_seconds.clear()
            handles = [sched.submit(Request(p, SamplingParams(temperature=1.0, seed=k), 192, parse=True,
                                            markup="ids", grammar=g if constrained else None), tool_choice=tc)
                       for k, (p, g, tc) in enumerate(batch)]
            sched._run_until_idle()
            for h in handles:
                h.result()
            full = [s for s, rows in sched.step_seconds if rows == 8]
            return {"step_ms": 1e3 * statistics.median(full), "full_steps": len(full)}
        return run

    sched.grammar_seconds.clear()
    stats = alternate({"grammar": side(True), "no grammar": side(False)}, args.repeats)
    g, plain = stats["grammar"]["step_ms"], stats["no grammar"]["step_ms"]
    mask_us = Stats.of([1e6 * s for s in sched.grammar_seconds])
    say("## overhead: decode step at batch 8 (8 tool-choice-required rows, strict random schemas)")
    say(f"median step over the steps that ran all 8 rows, ms; {args.repeats} rounds alternating after one warm-up")
    say(f"grammar     {g}  ({stats['grammar']['full_steps'].median:.0f} full steps per round)")
    say(f"no grammar  {plain}")
    say(f"grammar / no grammar: {g.median / plain.median:.3f} (target <= 1.10)")
    say(f"one row's mask on the host: {mask_us} us (filled while the forward pass runs)")


def main(argv=None) -> None:
    from _harness import Session, add_record_arguments, record

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--json-requests", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-reliability", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    add_record_arguments(ap)
    args = ap.parse_args(argv)
    sess = Session()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    if not args.skip_overhead:
        overhead(args, say)
    if not args.skip_reliability:
        reliability(args, say)
    sess.finish()
    print(f"# {sess.header()}")
    if args.record:
        record("grammar", lines, sess, force=args.force)


if __name__ == "__main__":
    main()
