"""Continuous batching (`k31jax.generate.Scheduler`) in-process on the tiny model: serving
during the background warm-up, batch invariance, slot reuse, prefix reuse (and the history
snapshot of a forced turn), compaction, forced tool choice, the bounded queue, cancellation, no
recompilation after warm-up, and a follower (multi-host mode) stepping the same batch as its
leader."""

from __future__ import annotations

import queue
import threading

import jax
import numpy as np
import pytest

from k31jax.chat import ByteTokenizer, Segment, apply_chat_template, parse_k3_segments
from k31jax.chat._render import open_tag
from k31jax.generate import (Engine, QueueFullError, Request, SamplingParams, Scheduler, TokenEvent, ToolChoice,
                             heal_prompt, load_model)
from k31jax.generate._forcing import ToolChoiceForcer
from k31jax.generate._scheduler import plan_chunks

MAX_LEN, CHUNK = 320, 8


@pytest.fixture(scope="module")
def cold():
    """A scheduler whose warm-up has only just started, on two background threads."""
    lm = load_model(config="tiny")
    engine = Engine(lm.model, lm.tokenizer, max_len=MAX_LEN, prefill_chunk=CHUNK)
    sched = Scheduler(engine, max_batch=4, prefill_chunk=CHUNK, max_queue=16)
    return engine, sched, sched.start_warmup(workers=2)


@pytest.fixture(scope="module")
def setup(cold):
    engine, sched, warm = cold
    warm.join()
    assert warm.ready and warm.error is None
    return engine, sched, dict(sched.compile_counts)


def test_prefill_plans_with_the_widths_compiled_so_far():
    full = plan_chunks(list(range(1, 14)), 8, resumed=False)
    assert [t.shape[1] for t, _ in full] == [8, 8]  # 5 tokens left-padded to 8, then one chunk
    assert [t.shape[1] for t, _ in plan_chunks(list(range(1, 6)), 8, resumed=False)] == [8]
    assert [t.shape[1] for t, _ in plan_chunks(list(range(1, 4)), 8, resumed=False)] == [4]
    assert [t.shape[1] for t, _ in plan_chunks(list(range(1, 4)), 8, resumed=False, widths={8})] == [8]
    assert [t.shape[1] for t, _ in plan_chunks(list(range(1, 12)), 8, resumed=True)] == [8, 2, 1]
    assert plan_chunks(list(range(1, 12)), 8, resumed=True, widths={8, 1}) is None  # no width 2 yet
    assert [t.shape[1] for t, _ in plan_chunks(list(range(1, 17)), 8, resumed=True, widths={8})] == [8, 8]


def test_requests_during_the_warmup_are_served_and_exact(cold):
    """Submitted while the programs compile: each waits for what it needs, plans its prefill
    with the widths compiled so far (a resumed turn without them prefills from scratch), and
    makes the tokens the static engine makes."""
    engine, sched, warm = cold
    assert warm.left  # the warm-up is still going
    tok = engine.tokenizer
    first = tok.encode("the first prompt of the warm-up test")
    reqs = [Request(first, max_new_tokens=6, stop_ids=frozenset()),
            Request(tok.encode("a second, shorter one"), max_new_tokens=9, stop_ids=frozenset())]
    done = _run(sched, reqs)
    follow_up = first + done[0].completion.tokens + tok.encode(" and then?")
    done += _run(sched, [Request(follow_up, max_new_tokens=5, stop_ids=frozenset())])
    for fin, req in zip(done, reqs + [Request(follow_up, max_new_tokens=5, stop_ids=frozenset())]):
        assert fin.completion.tokens == engine.generate([req]).tokens[0]


def _run(sched, reqs, **kw):
    handles = [sched.submit(r, **kw) for r in reqs]
    sched._run_until_idle()
    return [h.result(timeout=0) for h in handles]


def _prompts(tok, n, seed=0):
    rng = np.random.default_rng(seed)
    return [tok.encode("".join(chr(97 + c) for c in rng.integers(0, 26, size=rng.integers(3, 70))))
            for _ in range(n)]


def test_alone_equals_busy_batch_and_static_engine(setup):
    engine, sched, _ = setup
    tok = engine.tokenizer
    prompts = _prompts(tok, 7)
    greedy = Request(prompts[0], max_new_tokens=24, stop_ids=frozenset())
    alone = _run(sched, [greedy])[0].completion.tokens
    assert alone == engine.generate([prompts[0]], 24, stop_ids=frozenset()).tokens[0]
    # busy: 6 other requests of mixed lengths and sampling settings, more than the slots
    others = [Request(p, SamplingParams(temperature=0.9, top_p=0.9, seed=i), max_new_tokens=5 + 7 * i)
              for i, p in enumerate(prompts[1:])]
    busy = _run(sched, others[:3] + [greedy] + others[3:])
    assert busy[3].completion.tokens == alone
    # a seeded sampled request is batch invariant too (its key folds its own step)
    sampled = Request(prompts[2], SamplingParams(temperature=1.0, seed=42), max_new_tokens=20,
                      stop_ids=frozenset())
    a = _run(sched, [sampled])[0].completion.tokens
    b = _run(sched, others[:2] + [sampled])[2].completion.tokens
    assert a == b


def test_prefix_reuse_equals_cold_prefill(setup):
    engine, sched, _ = setup
    tok = engine.tokenizer
    history = [{"role": "user", "content": "tell me about the sea"}]
    first = apply_chat_template(tok, history, thinking=False)
    _run(sched, [Request(first, max_new_tokens=4)])
    history += [{"role": "assistant", "content": "waves"}, {"role": "user", "content": "and rivers?"}]
    second = apply_chat_template(tok, history, thinking=False)
    assert second[:len(first)] == first
    warm = _run(sched, [Request(second, max_new_tokens=16, stop_ids=frozenset())])[0]
    assert warm.cached_tokens == len(first)
    cold = engine.generate([second], 16, stop_ids=frozenset()).tokens[0]
    assert warm.completion.tokens == cold


def test_a_forced_turn_stores_its_history_for_the_next_turn(setup):
    """`Request.snapshot_at`: the tool-choice note follows the conversation and the next turn
    drops it, so the prompt's own snapshot is no prefix of the next prompt; the history's is."""
    engine, sched, _ = setup
    tok = engine.tokenizer
    history = [{"role": "user", "content": "what is the weather in Oslo today?"}]
    head = apply_chat_template(tok, history, thinking=False, add_generation_prompt=False)
    forced = apply_chat_template(tok, history, thinking=False, tool_choice="required")
    assert forced[:len(head)] == head
    _run(sched, [Request(forced, max_new_tokens=4, snapshot_at=len(head))])
    history += [{"role": "assistant", "content": "sunny"}, {"role": "user", "content": "and tomorrow?"}]
    nxt = apply_chat_template(tok, history, thinking=False)
    warm = _run(sched, [Request(nxt, max_new_tokens=12, stop_ids=frozenset())])[0]
    assert warm.cached_tokens == len(head)
    assert warm.completion.tokens == engine.generate([nxt], 12, stop_ids=frozenset()).tokens[0]


def test_prompts_sharing_a_head_resume_from_its_branch_point(setup):
    """Many clients, one system prompt: the second prompt that leaves a stored one stores the
    state where it leaves it (a branch point, while it prefills); the third resumes from there,
    and its tokens are the static engine's."""
    engine, sched, _ = setup
    tok = engine.tokenizer
    system = "You are a careful assistant. Answer in one line. " * 3
    prompts = [apply_chat_template(tok, [{"role": "system", "content": system},
                                         {"role": "user", "content": q}], thinking=False)
               for q in ("tides?", "rivers and lakes?", "why is the sea salty?")]
    head = next(i for i in range(len(prompts[0])) if prompts[0][i] != prompts[1][i])
    assert head > 60 and prompts[2][:head] == prompts[0][:head]
    sched.prefix.clear()
    sched.min_branch, before = 32, sched.min_branch
    try:
        first, second = (_run(sched, [Request(p, max_new_tokens=2)])[0] for p in prompts[:2])
        assert first.cached_tokens == second.cached_tokens == 0  # nothing shared was stored yet
        third = _run(sched, [Request(prompts[2], max_new_tokens=12, stop_ids=frozenset())])[0]
    finally:
        sched.min_branch = before
    assert third.cached_tokens == head
    assert third.completion.tokens == engine.generate([prompts[2]], 12, stop_ids=frozenset()).tokens[0]


def test_compaction_keeps_results(setup):
    engine, sched, _ = setup
    prompts = _prompts(engine.tokenizer, 12, seed=3)
    reqs = [Request(p, max_new_tokens=100, stop_ids=frozenset()) for p in prompts]
    before = sched.stats["compactions"]
    got = [f.completion.tokens for f in _run(sched, reqs)]
    assert sched.stats["compactions"] > before  # 3 waves of 100 steps overflow 320 positions
    for p, g in zip(prompts, got):
        assert g == engine.generate([p], 100, stop_ids=frozenset()).tokens[0]


def test_forced_tool_choice(setup):
    engine, sched, _ = setup
    tok = engine.tokenizer
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("get_weather", "get_time", "get")]
    names = tuple(t["function"]["name"] for t in tools)
    msgs = [{"role": "user", "content": "hi"}]
    for choice, expect in ((ToolChoice("named", names, "get_time"), {"get_time"}),
                           (ToolChoice("required", names), set(names))):
        prompt = apply_chat_template(tok, msgs, None, thinking=False, tool_choice="required")
        fin = _run(sched, [Request(prompt, max_new_tokens=80, parse=True, markup="ids")], tool_choice=choice)[0]
        calls = fin.completion.parsed.tool_calls
        assert len(calls) >= 1 and calls[0].name in expect
        # the ids parse to the same call (structure came from sampled special ids)
        again = parse_k3_segments(tok.decode_segments(fin.completion.tokens), thinking=False)
        assert again.tool_calls[0].name == calls[0].name
    prompt = apply_chat_template(tok, msgs, None, thinking=False, tool_choice="none")
    fin = _run(sched, [Request(prompt, max_new_tokens=40, parse=True, markup="ids")],
               tool_choice=ToolChoice("none", names))[0]
    assert fin.completion.parsed.tool_calls == []


def _close(name):
    return [Segment("<|close|>", True), Segment(name, False), Segment("<|sep|>", True)]


def test_a_forced_call_ends_the_turn_once_the_model_closes_it():
    """The forcer alone, on the byte tokenizer, against a model that writes its arguments, closes
    the call and would then write on: the message is closed and ended right after the call (it
    used to run free to max_new_tokens)."""
    tok = ByteTokenizer()
    prompt = apply_chat_template(tok, [{"role": "user", "content": "hi"}], None, thinking=False)
    args = (open_tag("argument", [("key", "city"), ("type", "string")]) + [Segment("Oslo", False)]
            + _close("argument") + _close("call"))
    model = iter(tok.encode_segments(args) + tok.encode("and then some more text") * 20)
    forcer = ToolChoiceForcer(tok, "named", tool_names=("get_weather",), name="get_weather", prompt_ids=prompt,
                              max_new_tokens=400)
    out = []
    while not out or out[-1] not in tok.stop_ids:
        force, allowed, banned = forcer.constraint()
        token = force if force >= 0 else allowed[0] if allowed else next(model)
        assert token not in banned
        forcer.push(token)
        out.append(token)
    way_in = _close("response") + open_tag("tools") + open_tag("call", [("tool", "get_weather"), ("index", "1")])
    end = _close("tools") + _close("message") + [Segment("<|end_of_msg|>", True)]
    assert out == tok.encode_segments(way_in + args + end) and not forcer.cut


def test_a_forced_call_needs_room_and_a_cut_one_reports_length(setup):
    """A limit below the forced call's markup is refused; a limit the model's arguments run into
    closes the call there (the tiny random model never closes it itself) and reports `length`."""
    engine, sched, _ = setup
    tok = engine.tokenizer
    names = ("get_weather", "get_time")
    prompt = apply_chat_template(tok, [{"role": "user", "content": "hi"}], None, thinking=False)
    named = ToolChoice("named", names, "get_time")
    with pytest.raises(ValueError, match="max_tokens 5 is too small for the forced tool call"):
        sched.submit(Request(prompt, max_new_tokens=5, parse=True, markup="ids"), tool_choice=named)
    room = ToolChoiceForcer(tok, "named", tool_names=names, name="get_time", prompt_ids=prompt,
                            max_new_tokens=1).min_new_tokens
    for choice, limit in ((named, room), (ToolChoice("required", names), 120)):
        fin = _run(sched, [Request(prompt, max_new_tokens=limit, parse=True, markup="ids")], tool_choice=choice)[0]
        c = fin.completion
        assert len(c.parsed.tool_calls) == 1 and c.parsed.tool_calls[0].name in names
        assert c.finish_reason == "length" and len(c.tokens) == limit
        tail = tok.encode_segments(_close("call") + _close("tools") + _close("message")
                                   + [Segment("<|end_of_msg|>", True)])
        assert c.tokens[-len(tail):] == tail  # the call closed, and the message ended, within the limit


def test_token_healing_equals_the_static_engine(setup):
    """A healed request's first token is constrained in the scheduler as in `Engine`, amid a
    busy batch (byte vocabulary: the backed-off byte itself)."""
    engine, sched, _ = setup
    tok = engine.tokenizer
    ids = [tok.bos_id] + tok.encode("print(x")
    prompt, tail = heal_prompt(tok, ids)
    healed = Request(prompt, max_new_tokens=16, stop_ids=frozenset(), healed_prefix=tail)
    busy = _run(sched, [Request(p, max_new_tokens=9) for p in _prompts(tok, 2, seed=3)] + [healed])
    static = engine.generate([healed]).completions[0]
    assert busy[2].completion.tokens == static.tokens and static.tokens[0] == ids[-1]
    assert busy[2].completion.text == static.text == tok.decode(static.tokens)[1:]


def test_queue_bound_cancel_and_no_recompilation(setup):
    engine, sched, compiled = setup
    prompt = engine.tokenizer.encode("queue")
    handles = [sched.submit(Request(prompt, max_new_tokens=3)) for _ in range(16)]
    with pytest.raises(QueueFullError):
        sched.submit(Request(prompt, max_new_tokens=3))
    for h in handles[1:]:
        h.cancel()
    sched._run_until_idle()
    assert len(handles[0].result(timeout=0).completion.tokens) == 3
    assert sched.queue_depth == 0 and sched.running == 0
    with pytest.raises(ValueError, match="context length 320"):
        sched.submit(Request(prompt * 70, max_new_tokens=3))
    assert dict(sched.compile_counts) == compiled


class _Pipe:
    """`ProcessSync` within one process: the leader's plans reach one follower in order."""

    def __init__(self, leader: bool, plans: queue.Queue):
        self.leader, self.plans = leader, plans

    def exchange(self, plan):
        if self.leader:
            self.plans.put(plan)
            return plan
        return self.plans.get(timeout=120)


def test_follower_steps_the_same_batch_as_its_leader(setup):
    """Multi-host serving's contract, in one process: the follower gets only the leader's plans
    (new requests, cancellations), yet makes the same decisions, so it runs the same programs on
    the same inputs: equal caches, counters and prefix-cache contents at the end."""
    engine, sched, compiled = setup
    plans: queue.Queue = queue.Queue()
    leader = Scheduler(engine, max_batch=4, prefill_chunk=CHUNK, max_queue=16, sync=_Pipe(True, plans))
    follower = Scheduler(engine, max_batch=4, prefill_chunk=CHUNK, max_queue=16, sync=_Pipe(False, plans))
    leader.core = follower.core = sched.core  # share the warm programs (one engine)
    with pytest.raises(RuntimeError, match="follow"):
        leader.follow()
    thread = threading.Thread(target=follower.follow, daemon=True)
    thread.start()
    leader.start()
    tok = engine.tokenizer
    prompts = _prompts(tok, 6, seed=5)
    first = leader.submit(Request(prompts[0], max_new_tokens=12, stop_ids=frozenset())).result(timeout=300)
    # (its snapshots are stored: the last request below resumes from one)
    cut = leader.submit(Request(prompts[1], max_new_tokens=200, stop_ids=frozenset()))
    handles = [leader.submit(Request(p, SamplingParams(temperature=0.8, seed=i), max_new_tokens=6 + 9 * i))
               for i, p in enumerate(prompts[2:])]
    handles.append(leader.submit(Request(prompts[0] + first.completion.tokens + prompts[5],
                                         max_new_tokens=8, stop_ids=frozenset())))
    events = cut.events(timeout=300)
    assert isinstance(next(events), TokenEvent)
    cut.cancel()  # mid-generation, as a client that went away
    results = [h.result(timeout=300) for h in handles]
    leader.stop()
    thread.join(60)
    assert not thread.is_alive()  # the leader's stop plan ended the follower's loop
    assert results[-1].cached_tokens > len(prompts[0])  # resumed from the turn-end snapshot
    assert leader.stats["cancelled"] == 1 and leader.stats["requests"] == 7
    assert follower.stats == leader.stats
    assert follower.pos == leader.pos and follower.prefix.hits == leader.prefix.hits
    assert follower.prefix.sequences() == leader.prefix.sequences()
    for a, b in zip(jax.tree.leaves(leader.cache), jax.tree.leaves(follower.cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert dict(sched.compile_counts) == compiled
