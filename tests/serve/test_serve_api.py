"""`k31jax serve` as a real process on 127.0.0.1, driven by the official `openai` and
`anthropic` clients (one server for the module, with its own compile cache so that it starts
cold; stopped by its own pid), then a second start on that cache."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from helpers.processes import cli_env
from k31jax.chat import ByteTokenizer, apply_chat_template

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

KEY, MODEL, MAX_LEN = "test-key", "k31jax-tiny", 1024
SERVE_ARGS = ("--config", "tiny", "--max-len", str(MAX_LEN), "--max-batch", "8", "--prefill-chunk", "8",
              "--api-key", KEY, "--max-body-mb", "0.25")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cache: str, log, *extra: str):
    """A server process on a free port, its compile cache in `cache`; stderr to the file `log`
    (an unread pipe fills up with compiler warnings and blocks the server)."""
    port = _free_port()
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
                 "k31jax_time_to_first_token_seconds_count", "k31jax_prefix_cache_hit_rate"):
        assert name in metrics


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
    # one forced call; the random model never closes it, so max_tokens does: `length`, all tokens counted
    assert choice.finish_reason == "length" and first.usage.completion_tokens == 200
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    json.loads(call.function.arguments)
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
    assert tool.stop_reason == "max_tokens" and tool.content[-1].name == "get_weather"  # (the call was cut)


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
        oai.chat.completions.create(model=MODEL, messages=_user("x"), response_format={"type": "json_object"})
    assert refused.value.body["param"] == "response_format" and refused.value.status_code == 400
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
