"""The serving layer without a model: request mapping (effort levels, refused fields, the default
output limit, the history mark for session reuse) and the app on a scripted scheduler (streamed
tool-call deltas read by the official `openai` client, /health during warm-up, /v1/models, the
access log). Fast: a byte tokenizer, no compiles."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from k31jax.chat import (ByteTokenizer, ContentDelta, ParsedMessage, ToolCall, ToolCallArgsDelta, ToolCallEnd,
                         ToolCallStart, apply_chat_template)
from k31jax.generate import Completion, Finished, StreamDelta, TokenEvent
from k31jax.serve import ACCESS_LOG, APIError, ServeSettings, create_app, error_body
from k31jax.serve import _anthropic as anth
from k31jax.serve import _openai as oai

TOK = ByteTokenizer()
MAX_LEN = 2048
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
EFFORT = "Now the system is invoked with `thinking_effort={}`."


def _text(spec) -> str:
    return TOK.decode(list(spec.request.prompt))


def _chat(**body):
    return oai.chat_spec({"model": "m", "messages": USER, **body}, TOK, MAX_LEN, default_max_tokens=64)


def _messages(**body):
    return anth.messages_spec({"model": "m", "messages": USER, "max_tokens": 8, **body}, TOK, MAX_LEN)


def _refused(make, field: str) -> APIError:
    with pytest.raises(APIError) as e:
        make()
    assert e.value.status == 400 and e.value.param == field, e.value.message
    return e.value


# ---- effort -------------------------------------------------------------------------------
@pytest.mark.parametrize("level, k3", [("low", "low"), ("medium", "high"), ("high", "high"), ("xhigh", "max"),
                                       ("max", "max"), (None, "max")])
def test_openai_effort_levels_map_onto_k3(level, k3):
    text = _text(_chat(reasoning_effort=level))
    assert EFFORT.format(k3) in text and text.endswith("<|open|>think<|sep|>")


@pytest.mark.parametrize("level", ["none", "minimal"])
def test_openai_effort_none_and_minimal_turn_thinking_off(level):
    text = _text(_chat(reasoning_effort=level))
    assert "thinking_effort" not in text and text.endswith("<|open|>response<|sep|>")


def test_an_unknown_effort_is_a_400_naming_the_levels():
    err = _refused(lambda: _chat(reasoning_effort="bogus"), "reasoning_effort")
    assert "medium" in err.message and "xhigh" in err.message


@pytest.mark.parametrize("config, k3", [({"output_config": {"effort": "medium"}}, "high"),
                                        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
                                        ({"thinking": {"type": "enabled", "budget_tokens": 8000}}, "high"),
                                        ({"thinking": {"type": "enabled", "budget_tokens": 20000}}, "max"),
                                        ({"thinking": {"type": "enabled", "budget_tokens": 1024},
                                          "output_config": {"effort": "max"}}, "max"),  # explicit effort wins
                                        ({"thinking": {"type": "adaptive"}}, "max")])
def test_anthropic_effort_and_thinking_budget_map_onto_k3(config, k3):
    spec = _messages(**config)
    assert EFFORT.format(k3) in _text(spec)
    assert spec.request.thinking_budget == config.get("thinking", {}).get("budget_tokens")


def test_anthropic_thinking_disabled_and_unknown_type():
    assert _text(_messages(thinking={"type": "disabled"})).endswith("<|open|>response<|sep|>")
    _refused(lambda: _messages(thinking={"type": "on"}), "thinking.type")


# ---- fields that are refused, not ignored --------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "xml"}),
    ("logit_bias", {"65": 5}), ("frequency_penalty", 0.5), ("presence_penalty", -1),
    ("functions", [{"name": "f"}]), ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy"}),
])
def test_chat_fields_that_change_the_reply_are_refused(field, value):
    err = _refused(lambda: _chat(**{field: value}), field)
    body = error_body("/v1/chat/completions", err)  # the OpenAI error object
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == field


def test_chat_fields_at_their_neutral_values_are_accepted():
    spec = _chat(response_format={"type": "text"}, logit_bias={}, frequency_penalty=0, presence_penalty=0,
                 modalities=["text"], user="u", metadata={"a": "b"}, store=False)
    assert spec.request.max_new_tokens == 64


@pytest.mark.parametrize("field, value", [("echo", True), ("best_of", 3), ("suffix", "end"), ("logit_bias", {"1": 1})])
def test_completion_fields_that_change_the_reply_are_refused(field, value):
    _refused(lambda: oai.completion_spec({"model": "m", "prompt": "x", field: value}, TOK, MAX_LEN), field)


@pytest.mark.parametrize("body, field", [({"output_format": {"type": "json_schema"}}, "output_format.schema"),
                                         ({"output_config": {"format": {"type": "xml"}}},
                                          "output_config.format.type"),
                                         ({"tools": [{"name": "f", "strict": "yes"}]}, "tools.0.strict"),
                                         ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
                                         ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                                          "tools.0.type")])
def test_anthropic_fields_that_change_the_reply_are_refused(body, field):
    err = _refused(lambda: _messages(**body), field)
    assert error_body("/v1/messages", err)["error"]["type"] == "invalid_request_error"


# ---- what constrained decoding holds the reply to ----------------------------------------
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
STRICT = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, "strict": True}}]


@pytest.mark.parametrize("response_format, schema", [
    ({"type": "json_object"}, {"type": "object"}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}, SCHEMA),
])
def test_response_format_becomes_the_content_grammar_and_tells_the_model(response_format, schema):
    spec = _chat(response_format=response_format)
    assert json.loads(spec.request.grammar.content_schema) == schema
    assert spec.request.grammar.tools == () and spec.request.grammar.tool_choice == "auto"
    assert f"response_format={response_format['type']}" in _text(spec)  # the chat template's note (§2.2)
    assert _chat().request.grammar is None and _chat(response_format={"type": "text"}).request.grammar is None


def test_tools_become_the_call_grammar_strict_ones_by_their_schema():
    spec = _chat(tools=STRICT, tool_choice="required", parallel_tool_calls=False)
    g = spec.request.grammar
    assert g.tool_choice == "required" and not g.parallel and g.content_schema is None
    (tool,) = g.tools
    assert tool.name == "get_weather" and tool.strict and json.loads(tool.parameters) == SCHEMA
    assert not _chat(tools=TOOLS).request.grammar.tools[0].strict
    named = _chat(tools=STRICT, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.request.grammar.tool_choice == "named" and named.request.grammar.name == "get_weather"
    assert _chat(tools=STRICT).request.grammar.tool_choice == "auto"
    assert _chat(tools=STRICT, tool_choice="none").request.grammar.tool_choice == "none"
    off = oai.chat_spec({"model": "m", "messages": USER, "tools": STRICT}, TOK, MAX_LEN, grammar=False)
    assert off.request.grammar is None  # `k31jax serve --no-grammar`


def test_anthropic_strict_tools_and_structured_output():
    tools = [{"name": "get_weather", "input_schema": SCHEMA, "strict": True}]
    g = _messages(tools=tools, tool_choice={"type": "any"}).request.grammar
    assert g.tool_choice == "required" and g.tools[0].strict and json.loads(g.tools[0].parameters) == SCHEMA
    for body in ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
                 {"output_format": {"type": "json_schema", "schema": SCHEMA}}):
        spec = _messages(**body)
        assert json.loads(spec.request.grammar.content_schema) == SCHEMA
        assert "response_format=json_schema" in _text(spec)
        count = anth.count_tokens({"model": "m", "messages": USER, "max_tokens": 8, **body}, TOK)
        assert count == len(spec.request.prompt)


# ---- output limit, parallel calls, the history mark ---------------------------------------
def test_default_max_tokens_applies_without_max_tokens_and_fits_the_context():
    assert _chat().request.max_new_tokens == 64
    assert _chat(max_tokens=100).request.max_new_tokens == 100
    frame = len(_chat(messages=[{"role": "user", "content": ""}]).request.prompt)
    spec = _chat(messages=[{"role": "user", "content": "x" * (MAX_LEN - frame - 30)}])
    assert spec.request.max_new_tokens == MAX_LEN - len(spec.request.prompt) == 30


def test_parallel_tool_calls_false_keeps_the_first_call():
    calls = [ToolCall("call_a", "get_weather", "{}"), ToolCall("call_b", "get_weather", "{}")]
    parsed = ParsedMessage(None, "", calls)
    assert _chat(tools=TOOLS).calls(parsed) == calls
    assert _chat(tools=TOOLS, parallel_tool_calls=False).calls(parsed) == calls[:1]
    assert _chat(tools=TOOLS, tool_choice="none").calls(parsed) == []
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    assert _messages(tools=tools, tool_choice={"type": "auto", "disable_parallel_tool_use": True}).calls(parsed) == \
        calls[:1]


@pytest.mark.parametrize("thinking", [True, False])
def test_a_forced_turn_marks_where_its_history_ends(thinking):
    """The tool-choice note follows the conversation, so the next turn (which drops it) does not
    extend this prompt: `snapshot_at` marks the conversation's end, for the scheduler to store."""
    effort = None if thinking else "none"
    spec = _chat(tools=TOOLS, tool_choice="required", reasoning_effort=effort)
    history = apply_chat_template(TOK, USER, TOOLS, thinking=thinking, thinking_effort="max" if thinking else None,
                                  add_generation_prompt=False)
    assert spec.request.snapshot_at == (len(history),)
    assert list(spec.request.prompt[:len(history)]) == history
    assert _chat(tools=TOOLS, reasoning_effort=effort).request.snapshot_at == ()  # its prompt is the prefix


def test_new_tool_results_are_marked_where_they_start():
    """Where a compaction may later replace them: the next turn resumes the history before them."""
    calls = [{"id": f"call_{c}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
             for c in "ab"]
    msgs = USER + [{"role": "assistant", "content": "", "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "call_a", "content": "1"},
                   {"role": "tool", "tool_call_id": "call_b", "content": "2"}]
    starts = tuple(len(apply_chat_template(TOK, msgs[:k], TOOLS, thinking=True, thinking_effort="max",
                                           add_generation_prompt=False)) for k in (2, 3))
    assert _chat(messages=msgs, tools=TOOLS).request.snapshot_at == starts
    assert _chat(messages=msgs + [{"role": "user", "content": "so?"}], tools=TOOLS).request.snapshot_at == starts


def test_documents_marked_in_a_user_message_are_marked_where_it_starts():
    """A user message holding a part with a `document_id` (chat, or a Responses `input_text`
    part) is marked where it starts, in the turn that brings it; a bad mark is a 400."""
    from k31jax.serve import _responses as rsp

    spec = [{"type": "text", "text": "Read this:"}, {"type": "text", "text": "SPEC " * 40, "document_id": "spec"}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": spec}]
    start = len(apply_chat_template(TOK, msgs[:1], thinking=True, thinking_effort="max", add_generation_prompt=False))
    assert _chat(messages=msgs).request.snapshot_at == (start,)
    later = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "so?"}]
    assert _chat(messages=later).request.snapshot_at == ()  # only this turn's documents are marked
    items = [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Read this:"}, {"type": "input_text", "text": "SPEC", "document_id": "spec"}]}]
    assert rsp.input_messages(items) == [{"role": "user", "content": [
        {"type": "text", "text": "Read this:"}, {"type": "text", "text": "SPEC", "document_id": "spec"}]}]
    bad = [{"role": "user", "content": [{"type": "text", "text": "x", "document_id": 3}]}]
    assert "non-empty string" in _refused(lambda: _chat(messages=bad), "messages").message


# ---- the app on a scripted scheduler --------------------------------------------------------
class ScriptedScheduler:
    """What `create_app` uses of a `Scheduler`; each request gets `steps` (lists of parser
    events, one list per generated token) and then a finished completion."""

    def __init__(self, steps, parsed, warmup=None):
        self.tokenizer, self.max_len, self.queue_depth, self.running = TOK, MAX_LEN, 0, 0
        self.steps, self.parsed, self.warmup_status = steps, parsed, warmup

    def submit(self, request, *, tool_choice=None, logprobs=False, sink):
        for i, events in enumerate(self.steps):
            sink(TokenEvent(StreamDelta(0, (65,), "", tuple(events)), None))
        sink(Finished(Completion(0, len(request.prompt), [65] * len(self.steps), "", "stop", stop=258,
                                 parsed=self.parsed), 0, 0.01, 0.02))
        return SimpleNamespace(cancel=lambda: None)


CALL_STEPS = [[ContentDelta("")], [ToolCallStart(0, "call_1", "get_weather"), ToolCallArgsDelta(0, '{"ci')],
              [ToolCallArgsDelta(0, 'ty": "Os')], [ToolCallArgsDelta(0, 'lo"}'), ToolCallEnd(0)]]
CALL = ParsedMessage(None, "", [ToolCall("call_1", "get_weather", '{"city": "Oslo"}')])


def _client(scheduler, **settings) -> TestClient:
    return TestClient(create_app(scheduler, ServeSettings(model_name="m", **settings)))


def test_streamed_tool_call_one_entry_per_index_with_the_openai_client():
    openai = pytest.importorskip("openai")
    from openai.lib.streaming.chat import ChatCompletionStreamState

    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=_client(
        ScriptedScheduler(CALL_STEPS, CALL)), max_retries=0)
    state, plain = ChatCompletionStreamState(), ""
    for chunk in client.chat.completions.create(model="m", messages=USER, tools=TOOLS, stream=True):
        state.handle_chunk(chunk)
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and delta.tool_calls:
            assert len({c.index for c in delta.tool_calls}) == len(delta.tool_calls)  # one entry per index
            plain += delta.tool_calls[0].function.arguments or ""  # the plain reader
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    (call,) = final.message.tool_calls
    assert call.id == "call_1" and call.function.name == "get_weather"
    assert call.function.arguments == plain == '{"city": "Oslo"}'


def test_health_while_warming_up_then_ready_and_models_metadata():
    warm = SimpleNamespace(done=["prefill 8"], left=["decode", "prefill 4"], seconds=3.0, error=None, ready=False)
    client = _client(ScriptedScheduler([], CALL, warm), default_max_tokens=77)
    r = client.get("/health")
    assert r.status_code == 503
    assert r.json()["status"] == "warming_up" and r.json()["warmup"]["left"] == ["decode", "prefill 4"]
    warm.done, warm.left, warm.ready = warm.done + warm.left, [], True
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["ready"] and r.json()["warmup"]["compiled"] == 3
    (model,) = client.get("/v1/models").json()["data"]
    assert model["context_length"] == MAX_LEN and model["default_max_tokens"] == 77


def test_access_log_one_line_per_request_with_tokens_and_off_when_quiet(caplog):
    body = {"model": "m", "messages": USER, "max_tokens": 5}
    with caplog.at_level(logging.INFO, logger=ACCESS_LOG.name):
        _client(ScriptedScheduler(CALL_STEPS, CALL)).post("/v1/chat/completions", json=body)
        _client(ScriptedScheduler(CALL_STEPS, CALL)).post("/v1/chat/completions", json={**body, "stream": True})
        _client(ScriptedScheduler(CALL_STEPS, CALL)).get("/v1/nothing")
        _client(ScriptedScheduler(CALL_STEPS, CALL), access_log=False).post("/v1/chat/completions", json=body)
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOG.name]
    assert len(lines) == 3, lines
    n = len(_chat().request.prompt)
    for line in lines[:2]:
        assert " POST /v1/chat/completions 200 " in line and f"prompt={n} cached=0 completion=4" in line
    assert " GET /v1/nothing 404 " in lines[2] and "tokens" not in lines[2]


# ---- the Responses API's input -------------------------------------------------------------
def test_responses_input_items_become_the_chat_history():
    from k31jax.serve import _responses as rsp

    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                               {"type": "input_text", "text": "in Oslo?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "short"}],
              "content": [{"type": "reasoning_text", "text": "I should call the tool."}]},
             {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_a", "output": "-3"},
             {"type": "function_call_output", "call_id": "call_b", "output": "5"},
             {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Done."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "It is cold."}]},
             {"role": "user", "content": "Thanks"}]
    assert rsp.input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "-3"},
        {"role": "tool", "tool_call_id": "call_b", "content": "5"},
        {"role": "assistant", "content": "It is cold.", "reasoning_content": "Done."},
        {"role": "user", "content": "Thanks"}]
    assert rsp.input_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, field", [
    ({"input": []}, "input"), ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
])
def test_responses_requests_that_are_refused(body, field):
    from k31jax.serve import _responses as rsp

    with pytest.raises(APIError) as e:
        rsp.responses_spec({"model": "m", **body}, TOK, MAX_LEN, rsp.ResponseStore())
    assert e.value.param == field, e.value.message


def test_responses_tools_are_strict_unless_they_say_otherwise():
    from k31jax.serve import _responses as rsp

    tools = [{"type": "function", "name": "a", "parameters": SCHEMA},
             {"type": "function", "name": "b", "parameters": SCHEMA, "strict": False}]
    spec, conversation = rsp.responses_spec({"model": "m", "input": "hi", "tools": tools, "instructions": "Be brief.",
                                             "text": {"format": {"type": "json_schema", "name": "x",
                                                                 "schema": SCHEMA}}},
                                            TOK, MAX_LEN, rsp.ResponseStore())
    assert [(t.name, t.strict) for t in spec.request.grammar.tools] == [("a", True), ("b", False)]
    assert json.loads(spec.request.grammar.content_schema) == SCHEMA
    assert conversation == [{"role": "user", "content": "hi"}]  # instructions are this request's only
    assert "Be brief." in _text(spec)
