"""`k31jax serve` as a real process on 127.0.0.1, driven by the official `openai` and
`anthropic` clients (one server for the module, with its own compile cache so that it starts
cold; stopped by its own pid), then a second start on that cache."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from helpers.processes import cli_env, free_port
from k31jax.chat import ByteTokenizer, apply_chat_template

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

KEY, MODEL, MAX_LEN = "test-key", "k31jax-tiny", 1024
SERVE_ARGS = ("--config", "tiny", "--max-len", str(MAX_LEN), "--max-batch", "8", "--prefill-chunk", "8",
              "--api-key", KEY, "--max-body-mb", "0.25")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _start(cache: str, log, *extra: str):
    """A server process on a free port, its compile cache in `cache`; stderr to the file `log`
    (an unread pipe fills up with compiler warnings and blocks the server)."""
    port = free_port()
    cmd = [sys.executable, "-m", "k31jax.cli", "serve", *SERVE_ARGS, "--port", str(port), *extra]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                env=cli_env(K31JAX_COMPILE_CACHE=cache))
    return proc, f"http://127.0.0.1:{port}"


def _first_health(proc, base: str, log) -> httpx.Response:
    """The first answer of /health (the server listens before it has compiled anything)."""
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{base}/health", timeout=1)
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    pytest.fail(f"server never answered /health: {log.read_text()[-3000:]}")


def _stop(proc) -> None:
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The module's server, just listening: (base url, its first /health answer, its stderr log,
    its compile cache)."""
    folder = tmp_path_factory.mktemp("serve")
    log, cache = folder / "stderr.log", str(folder / "xla")
    proc, base = _start(cache, log)
    first = _first_health(proc, base, log)
    yield base, first, log, cache
    _stop(proc)


@pytest.fixture(scope="module")
def server(started):
    """The module's server once its warm-up is done (every program compiled)."""
    base, _, log, _ = started
    deadline = time.time() + 900  # slow on a shared 2-core machine
    while time.time() < deadline:
        health = httpx.get(f"{base}/health", timeout=5).json()
        if health["ready"]:
            return base
        assert health["status"] == "warming_up", health
        time.sleep(0.5)
    pytest.fail(f"the warm-up did not finish: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def anth(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


def _user(text):
    return [{"role": "user", "content": text}]


def test_listens_at_once_and_answers_while_warming_up(started):
    """/health answers from the start (503, what is left); a request sent meanwhile waits for the
    programs it needs and is answered, not refused."""
    base, first, _, _ = started
    assert first.status_code == 503 and first.json()["status"] == "warming_up", first.text
    assert first.json()["warmup"]["left"] and first.json()["ready"] is False
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=600)
    r = client.chat.completions.create(model=MODEL, messages=_user("hi"), max_tokens=3)
    assert r.usage.completion_tokens <= 3 and r.choices[0].finish_reason in ("length", "stop")


def test_models_health_metrics_and_api_key(server, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    (model,) = httpx.get(f"{server}/v1/models", headers={"x-api-key": KEY}).json()["data"]
    assert model["context_length"] == MAX_LEN and model["default_max_tokens"] == 1024
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=_user("hi"), max_tokens=2)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=_user("hi"))
    r = httpx.post(f"{server}/v1/chat/completions", headers={"x-api-key": KEY},
                   json={"model": MODEL, "messages": _user("hi"), "max_tokens": 2})
    assert r.status_code == 200
    health = httpx.get(f"{server}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["warmup"]["left"] == []
    metrics = httpx.get(f"{server}/metrics").text
    for name in ("k31jax_queue_depth", "k31jax_running_requests", "k31jax_tokens_per_second",
                 "k31jax_time_to_first_token_seconds_count", "k31jax_prefix_cache_hit_rate",
                 "k31jax_prefix_cache_bytes", "k31jax_grammar_seconds_per_token_count"):
        assert name in metrics
    assert 'k31jax_endpoint_time_to_first_token_seconds_count{endpoint="/v1/chat/completions"}' in metrics


def test_chat_stream_matches_non_stream_with_usage_and_logprobs(oai):
    kw = dict(model=MODEL, messages=_user("Count to three."), max_tokens=12, temperature=0)
    full = oai.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    lps = full.choices[0].logprobs.content
    assert len(lps) == 12 and all(len(t.top_logprobs) == 3 for t in lps)
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5 for t in lps)  # greedy = top-1
    reasoning, usage = "", None
    for chunk in oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
    assert reasoning == msg.reasoning_content
    assert usage.completion_tokens == 12 and usage.prompt_tokens == full.usage.prompt_tokens


def test_tool_round_trip_with_and_without_reasoning(oai):
    msgs = _user("Weather in Oslo?")
    first = oai.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        extra_body={"thinking_budget": 8})
    choice = first.choices[0]
    # one forced call: the random model would ramble inside it to max_tokens; the grammar closes
    # it within its budget (benchmarks/grammar.py measures how reliably, on the embedded model)
    assert choice.finish_reason == "tool_calls" and first.usage.completion_tokens <= 200
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments), dict)
    assistant = choice.message.model_dump(exclude_none=True)
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": -3}'}
    second = oai.chat.completions.create(model=MODEL, messages=msgs + [assistant, result], tools=TOOLS,
                                         max_tokens=8)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens  # session reuse
    assistant.pop("reasoning_content")  # most clients drop it: rendered with an empty think block
    third = oai.chat.completions.create(model=MODEL, messages=msgs + [assistant, result], tools=TOOLS,
                                        max_tokens=8)
    assert third.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("choice", ["required", "none", "auto"])
def test_tool_choice(oai, choice):
    r = oai.chat.completions.create(model=MODEL, messages=_user("hi"), tools=TOOLS, tool_choice=choice,
                                    max_tokens=120, reasoning_effort="none")
    calls = r.choices[0].message.tool_calls
    if choice == "required":
        assert calls and calls[0].function.name == "get_weather"
    if choice == "none":
        assert not calls and r.choices[0].finish_reason != "tool_calls"


def test_stop_sequences_both_apis(oai, anth):
    kw = dict(model=MODEL, messages=_user("Say something."), max_tokens=30, reasoning_effort="none")
    text = oai.chat.completions.create(**kw).choices[0].message.content
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].isprintable()
                and text[i:i + 2].strip() and "<" not in text[i:i + 2])
    cut = oai.chat.completions.create(**kw, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index(stop)]
    m = anth.messages.create(model=MODEL, max_tokens=30, messages=_user("Say something."),
                             thinking={"type": "disabled"}, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert "".join(b.text for b in m.content if b.type == "text") == text[:text.index(stop)]


def test_anthropic_messages_stream_and_count(anth):
    kw = dict(model=MODEL, max_tokens=16, messages=_user("hello"), system="Be brief.",
              output_config={"effort": "low"})
    whole = anth.messages.create(**kw)
    assert whole.content[0].type == "thinking" and whole.stop_reason == "max_tokens"
    with anth.messages.stream(**kw) as st:
        kinds = [e.type for e in st]
        final = st.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].thinking == whole.content[0].thinking
    count = anth.messages.count_tokens(model=MODEL, messages=_user("hello"), system="Be brief.",
                                       output_config={"effort": "low"})
    assert count.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    tool = anth.messages.create(model=MODEL, max_tokens=150, messages=_user("weather?"),
                                thinking={"type": "disabled"}, tool_choice={"type": "any"},
                                tools=[{"name": "get_weather", "input_schema": {"type": "object"}}])
    assert tool.stop_reason == "tool_use" and tool.content[-1].name == "get_weather"  # closed by the grammar


def test_raw_completions(oai):
    r = oai.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 5


def test_raw_completion_with_token_healing(oai):
    """`heal_prompt` (extension field): the prompt's last token ("n", a byte here) is backed
    off, the first generated token is forced to start with it, and the text leaves it out."""
    plain = oai.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, temperature=0)
    r = oai.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, temperature=0, logprobs=1,
                               extra_body={"heal_prompt": True})
    tokens = r.choices[0].logprobs.tokens
    assert tokens[0] == "n" and r.choices[0].text == "".join(tokens)[1:]
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens - 1


def test_errors_in_each_schema(server, oai):
    h = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    url = f"{server}/v1/chat/completions"
    r = httpx.post(url, headers=h, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, headers=h, json={"model": MODEL})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(url, headers=h, json={"model": MODEL, "messages": _user("x"), "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="out of range"):
        oai.chat.completions.create(model=MODEL, messages=_user("x"), temperature=3)
    with pytest.raises(openai.BadRequestError, match="1024"):
        oai.chat.completions.create(model=MODEL, messages=_user("x" * 1100), max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        oai.chat.completions.create(model=MODEL, messages=_user("x"), reasoning_effort="bogus")
    assert oai.chat.completions.create(model=MODEL, messages=_user("x"), max_tokens=2,
                                       reasoning_effort="medium").usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="response_format") as refused:
        oai.chat.completions.create(model=MODEL, messages=_user("x"), response_format={"type": "xml"})
    assert refused.value.body["param"] == "response_format" and refused.value.status_code == 400
    bad_schema = {"type": "object", "properties": {}, "required": ["city"]}
    with pytest.raises(openai.BadRequestError, match="required \\['city'\\] are not among its properties"):
        oai.chat.completions.create(model=MODEL, messages=_user("x"), max_tokens=2, tools=[
            {"type": "function", "function": {"name": "f", "parameters": bad_schema, "strict": True}}])
    with pytest.raises(openai.BadRequestError, match="too small for the forced tool call"):
        oai.chat.completions.create(model=MODEL, messages=_user("x"), tools=TOOLS, tool_choice="required",
                                    max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=_user("x"), max_tokens=2)
    r = httpx.post(url, headers=h, json={"model": MODEL, "messages": _user("x" * 300_000)})
    assert r.status_code == 413
    ok = oai.chat.completions.create(model=MODEL, messages=_user("x"), max_tokens=2,
                                     extra_body={"some_unknown_field": 1})
    assert ok.usage.completion_tokens == 2
    r = httpx.post(f"{server}/v1/messages", headers=h, json={"model": MODEL, "messages": _user("x")})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/messages", headers=h, json={"model": "claude", "max_tokens": 2,
                                                             "messages": _user("x")})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_sixteen_concurrent_requests_are_batch_invariant(oai):
    def ask(i):
        r = oai.chat.completions.create(model=MODEL, messages=_user(f"request number {i}"), max_tokens=10 + i,
                                        temperature=0, reasoning_effort="none")
        return r.choices[0]

    alone = ask(5).message.content
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(16)))
    assert all(r.finish_reason in ("length", "stop") for r in results)
    assert results[5].message.content == alone


def test_streamed_forced_call_one_entry_per_index(oai):
    """Read by the openai client's own accumulation and by a plain `delta.tool_calls[0]` reader."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state, plain, entries = ChatCompletionStreamState(), "", 0
    for chunk in oai.chat.completions.create(model=MODEL, messages=_user("Weather in Oslo?"), tools=TOOLS,
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                             max_tokens=120, reasoning_effort="none", stream=True):
        state.handle_chunk(chunk)
        calls = chunk.choices[0].delta.tool_calls if chunk.choices else None
        if calls:
            assert [c.index for c in calls] == [0]
            entries += 1
            plain += calls[0].function.arguments or ""
    # (the accumulated snapshot: `get_final_completion` refuses a `length` finish, as the random
    # model's call always is)
    (call,) = state.current_completion_snapshot.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == plain and entries >= 1


def test_forced_tool_turn_then_its_result_resumes_the_history_with_thinking_on_or_off(anth):
    """The forced turn's prompt ends in the tool-choice note, which the tool-result turn drops:
    that turn resumes the stored history (system, tools, the user's message) all the same, with
    thinking disabled as with it enabled."""
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    question = _user("What is the weather in Bergen?")
    for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 8}):
        first = anth.messages.create(model=MODEL, max_tokens=150, tools=tools, messages=question,
                                     tool_choice={"type": "any"}, thinking=thinking)
        (use,) = [b for b in first.content if b.type == "tool_use"]
        turns = question + [{"role": "assistant", "content": first.content},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                          "content": "-3"}]}]
        second = anth.messages.create(model=MODEL, max_tokens=4, tools=tools, messages=turns, thinking=thinking)
        on = thinking["type"] == "enabled"
        history = apply_chat_template(ByteTokenizer(), question, [{"type": "function", "function": {
            "name": "get_weather", "parameters": tools[0]["input_schema"]}}], thinking=on,
            thinking_effort="low" if on else None, add_generation_prompt=False)
        assert second.usage.cache_read_input_tokens >= len(history), thinking


def test_responses_api_with_tools_reasoning_and_previous_response_id(oai):
    """`client.responses.create`, streamed and not: a forced call (its arguments held to the
    strict schema), its output sent back with `previous_response_id` (the stored conversation,
    its reasoning included, resumed from the prefix cache), and the same conversation sent as
    explicit items (reasoning item, function_call, function_call_output) renders the same prompt."""
    tools = [{"type": "function", "name": "get_weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                             "additionalProperties": False}}]
    # (a byte tokenizer: the call's markup alone is ~90 tokens, and for a required call the
    # grammar closes what is open in a reply's last ~185 tokens: its arguments, and the markup
    # beyond the 64 kept for it; the reasoning gets the 8 of its budget first)
    first = oai.responses.create(model=MODEL, input="Weather in Oslo?", tools=tools, tool_choice="required",
                                 max_output_tokens=200, extra_body={"thinking_budget": 8})
    kinds = [item.type for item in first.output]
    assert first.status == "completed" and kinds[0] == "reasoning" and kinds[-1] == "function_call", kinds
    call = first.output[-1]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}  # strict by default in this API
    reasoning = first.output[0].content[0].text
    assert first.usage.output_tokens > 0 and first.usage.output_tokens_details.reasoning_tokens > 0
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": -3}'}
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=tools,
                                  max_output_tokens=6)
    assert second.previous_response_id == first.id
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": tools[0]["parameters"],
                                                    "strict": True}}]
    history = apply_chat_template(ByteTokenizer(), [{"role": "user", "content": "Weather in Oslo?"}], chat_tools,
                                  thinking=True, thinking_effort="max", add_generation_prompt=False)
    # resumed from the conversation's end, stored before the tool-choice note that this turn drops
    assert second.usage.input_tokens_details.cached_tokens >= len(history)
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "reasoning", "id": first.output[0].id, "summary": [],
              "content": [{"type": "reasoning_text", "text": reasoning}]},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             result]
    stateless = oai.responses.create(model=MODEL, input=items, tools=tools, max_output_tokens=6, store=False)
    assert stateless.usage.input_tokens == second.usage.input_tokens  # one conversation, one prompt
    events = list(oai.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=tools,
                                       max_output_tokens=6, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] in (
        "response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in second.output]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    message = [i for i in final.output if i.type == "message"]
    assert not message or message[0].content[0].text == text
    with pytest.raises(openai.NotFoundError, match="not stored"):
        oai.responses.create(model=MODEL, previous_response_id="resp_nope", input="x", max_output_tokens=2)
    assert oai.responses.retrieve(first.id).id == first.id


def test_compaction_keeps_every_call_and_the_cached_history_before_it(server, oai):
    """`POST /v1/responses/{id}/compact`: the tool result becomes a stub, the call stays, and
    the next turn resumes the history up to the replaced result (stored there while the turn
    that brought it was prefilled)."""
    tools = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}]
    kw = dict(model=MODEL, tools=tools, reasoning={"effort": "none"})
    first = oai.responses.create(input="Weather in Oslo?", tool_choice="required", max_output_tokens=120, **kw)
    call = first.output[-1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"hourly": [-3] * 50})}
    second = oai.responses.create(previous_response_id=first.id, input=[result], max_output_tokens=4, **kw)
    r = httpx.post(f"{server}/v1/responses/{second.id}/compact", json={"keep_last": 0},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    compacted = r.json()
    info = compacted["compaction"]
    assert info["documents"] == [call.call_id] and info["tokens_after"] < info["tokens_before"] - 100
    question = {"role": "user", "content": "And tomorrow?"}
    third = oai.responses.create(previous_response_id=compacted["id"], input=[question], max_output_tokens=4, **kw)
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": tools[0]["parameters"],
                                                    "strict": True}}]
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                   "name": call.name, "arguments": call.arguments}}]}]
    before_result = len(apply_chat_template(ByteTokenizer(), history, chat_tools, thinking=False,
                                            add_generation_prompt=False))
    assert third.usage.input_tokens_details.cached_tokens == before_result
    whole = oai.responses.create(previous_response_id=second.id, input=[question], max_output_tokens=4, **kw)
    assert whole.usage.input_tokens - third.usage.input_tokens == info["tokens_before"] - info["tokens_after"]
    stored = oai.responses.retrieve(compacted["id"])
    assert stored.previous_response_id == second.id
    bad = httpx.post(f"{server}/v1/responses/{second.id}/compact", json={"documents": ["call_x"]},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"


def test_compacting_a_marked_document_resumes_the_history_before_its_message(server, oai):
    """Reference text a user marked (`input_text` with a `document_id`) is compacted like a tool
    result: the next turn resumes exactly the history before the message that brought it (the
    state stored where that message began while its turn was prefilled)."""
    kw = dict(model=MODEL, reasoning={"effort": "none"}, max_output_tokens=4)
    system = {"role": "system", "content": "You review specifications and answer in one word."}
    spec = {"type": "input_text", "text": "SPEC " + "every rule must hold; " * 30, "document_id": "spec"}
    first = oai.responses.create(input=[system, {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Review this:"}, spec]}], **kw)
    r = httpx.post(f"{server}/v1/responses/{first.id}/compact", json={"documents": ["spec"]},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    info = r.json()["compaction"]
    assert info["documents"] == ["spec"] and info["tokens_after"] < info["tokens_before"] - 400
    nxt = oai.responses.create(previous_response_id=r.json()["id"], input="Verdict?", **kw)
    head = apply_chat_template(ByteTokenizer(), [system], thinking=False, add_generation_prompt=False)
    assert nxt.usage.input_tokens_details.cached_tokens == len(head)
    bad = httpx.post(f"{server}/v1/responses/{first.id}/compact", json={"keep_last": 0, "document_stub": "{x}"},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "document_stub"


def test_access_log_then_a_quiet_restart_on_the_warm_compile_cache(server, started, tmp_path):
    """One access-log line per request (default on); a second server on the same compile cache
    with --quiet answers, and logs no requests."""
    _, _, log, cache = started
    line = re.compile(r"k31jax serve: 127\.0\.0\.1 POST /v1/chat/completions 200 \d+\.\d{3}s "
                      r"tokens prompt=\d+ cached=\d+ completion=\d+$")
    assert sum(bool(line.match(ln)) for ln in log.read_text().splitlines()) >= 5
    assert " POST /v1/chat/completions 400 " in log.read_text()  # refused requests are logged too
    assert os.listdir(cache)  # the persistent compile cache was written
    quiet_log = tmp_path / "quiet.log"
    proc, base = _start(cache, quiet_log, "--quiet")
    try:
        _first_health(proc, base, quiet_log)
        r = httpx.post(f"{base}/v1/chat/completions", headers={"x-api-key": KEY}, timeout=600,
                       json={"model": MODEL, "messages": _user("hi"), "max_tokens": 2})
        assert r.status_code == 200
    finally:
        _stop(proc)
    text = quiet_log.read_text()
    assert "listening on" in text and "POST /v1/chat/completions" not in text
