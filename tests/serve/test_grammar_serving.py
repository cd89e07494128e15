"""Constrained decoding on the embedded default model: in-process, a greedy constrained reply
equals the plain one for as long as the grammar allows the model's choices and then ends
well-formed; through `k31jax serve` (a real process on 127.0.0.1, stopped by its pid), a
smaller run of benchmarks/grammar.py's reliability suite (random strict schemas, both APIs,
streamed and not): every call and every JSON reply validates."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from helpers.benchmarks import load_benchmark
from k31jax.chat import apply_chat_template
from k31jax.generate import (Engine, OutputGrammar, Request, SamplingParams, Scheduler, ToolChoice, ToolSchema,
                             load_model)
from k31jax.generate._grammar import closing_reserve, reply_room

pytest.importorskip("openai")
pytest.importorskip("anthropic")
bench = load_benchmark("grammar")

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer", "minimum": 1}},
          "required": ["path", "lines"], "additionalProperties": False}


@pytest.fixture(scope="module")
def scheduler():
    lm = load_model()
    engine = Engine(lm.model, lm.tokenizer, max_len=512, prefill_chunk=64)
    sched = Scheduler(engine, max_batch=2, prefill_chunk=64)
    sched.warmup()
    return sched


def test_greedy_constrained_equals_plain_while_the_grammar_allows_it(scheduler):
    tok = scheduler.tokenizer
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": SCHEMA}}]
    prompt = apply_chat_template(tok, [{"role": "user", "content": "import os\n\ndef main():"}], tools,
                                 thinking=False)
    grammar = OutputGrammar((ToolSchema("read_file", json.dumps(SCHEMA), True),), "auto")
    n = 160
    plain, constrained = (scheduler.submit(Request(prompt, SamplingParams(temperature=0.0), n, parse=True,
                                                   markup="ids", grammar=g)) for g in (None, grammar))
    scheduler._run_until_idle()
    plain, constrained = plain.result().completion, constrained.result().completion
    # before the closing tokens, the model's text is what the grammar allows
    free = n - closing_reserve(n, reply_room(tok, grammar, every=True))
    assert not any(tok.is_special(t) for t in plain.tokens[:free])  # the embedded model writes plain text
    assert constrained.tokens[:free] == plain.tokens[:free]
    assert plain.finish_reason == "length"
    assert constrained.finish_reason == "stop" and tok.decode(constrained.tokens).endswith(
        "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")  # closed, well-formed
    assert scheduler.stats["grammar_requests"] == 1 and scheduler.stats["grammar_broken"] == 0
    assert len(scheduler.grammar_seconds) > 0


@pytest.mark.parametrize("mode", ["required", "named"])
def test_the_grammar_alone_holds_a_forced_choice_on_a_tight_budget(scheduler, mode, monkeypatch):
    """tool_choice required / named with a grammar: no forcer runs beside it (only the room check
    at submit builds one). The reply starts in the reasoning, which this model never closes by
    itself, with a budget shorter than the grammar's closing reserve: closing takes the way into
    the call at once and writes valid arguments, the turn ended within the budget."""
    from k31jax.generate import _scheduler

    built = []
    real = _scheduler.ToolChoiceForcer
    monkeypatch.setattr(_scheduler, "ToolChoiceForcer", lambda *a, **kw: built.append(a) or real(*a, **kw))
    tok = scheduler.tokenizer
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": SCHEMA}}]
    prompt = apply_chat_template(tok, [{"role": "user", "content": "import os\n\ndef main():"}], tools,
                                 thinking=True, thinking_effort="max", tool_choice="required")
    grammar = OutputGrammar((ToolSchema("read_file", json.dumps(SCHEMA), True),), "auto")  # given the choice
    n = 90  # (the room check asks for 77 here; closing keeps 98)
    assert n < closing_reserve(10**6, reply_room(tok, dataclasses.replace(grammar, tool_choice=mode, name="read_file"),
                                                 every=True))
    h = scheduler.submit(Request(prompt, SamplingParams(temperature=0.0), n, parse=True, markup="ids",
                                 grammar=grammar), tool_choice=ToolChoice(mode, ("read_file",), "read_file"))
    scheduler._run_until_idle()
    done = h.result().completion
    assert len(built) == 1  # the room check's, none beside the grammar
    (call,) = done.parsed.tool_calls  # one forced call ends the turn
    assert call.name == "read_file" and bench.schema_error(SCHEMA, json.loads(call.arguments)) is None
    assert len(done.tokens) <= n and tok.decode(done.tokens).endswith("<|end_of_msg|>")
    assert done.finish_reason in ("stop", "tool_calls")


@pytest.fixture(scope="module")
def server():
    with bench.Server(("--max-len", "2048", "--prefill-chunk", "128", "--max-batch", "4")) as s:
        yield s


def test_every_strict_call_and_json_reply_validates(server):
    """benchmarks/grammar.py's suite, smaller: random strict schemas, tool_choice required /
    named / auto, OpenAI and Anthropic, streamed and not."""
    model = server.model()
    tools = bench.tool_suite(server.base, model, 12, seed=1)
    assert tools.errors == 0 and tools.bad_calls == 0 and tools.missing_calls == 0, tools.examples
    assert tools.calls >= 8  # every required / named choice made one
    replies = bench.json_suite(server.base, model, 4, seed=1)
    assert replies.errors == 0 and replies.bad_outputs == 0 and replies.outputs == 4, replies.examples
    metrics = httpx.get(f"{server.base}/metrics", timeout=10).text
    assert "k31jax_grammar_requests_total 16" in metrics
    assert 'k31jax_grammar_seconds_per_token{quantile="0.5"}' in metrics


def test_the_suite_counts_what_breaks_a_schema():
    """The suite's check can fail: a value against its schema."""
    assert bench.schema_error(SCHEMA, {"path": "a", "lines": 0}) is not None
    assert bench.schema_error(SCHEMA, {"path": "a"}) is not None
    assert bench.schema_error(SCHEMA, {"path": "a", "lines": 3}) is None
