"""ChatSession, the `generate` / `chat` CLI (piped stdin), and a tool-call round trip.

The random `tiny` never calls a tool, so the round trip runs on a scripted engine that
replays canned K3 outputs through the engine's real per-row controller (stop ids, UTF-8
decoding, streaming parser). Everything else runs the real engine; the CLI runs in-process
with the same shapes as `test_generate.py` (max_len 512, prefill_chunk 16), so it reuses
the compiled programs when both modules run in one session.
"""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

from conftest import randomize, tiny_config
from k31jax import K31ForCausalLM
from k31jax.chat import ByteTokenizer, MissingReasoningError
from k31jax.cli import main
from k31jax.generate import ChatSession, Engine, GenerationResult, SamplingParams
from k31jax.generate._cli import run_chat
from k31jax.generate._requests import RowController

SMALL = ["--max-len", "512", "--prefill-chunk", "16"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL_TURN = ('I should call the tool.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>'
             '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
             '<|open|>argument key="city" type="string"<|sep|>Oslo<|close|>argument<|sep|>'
             '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
ANSWER_TURN = ('Got it.<|close|>think<|sep|><|open|>response<|sep|>It is -3 C in Oslo.'
               '<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>')


class ScriptedEngine:
    """Replays canned outputs, one per turn, through `RowController` (what `Engine` runs)."""

    def __init__(self, tok, outputs):
        self.tokenizer, self.outputs, self.prompts = tok, list(outputs), []
        self.stop_ids, self.last_result = tok.stop_ids, None

    def stream(self, reqs, *args, **kwargs):
        req = reqs[0]
        self.prompts.append(self.tokenizer.decode(req.prompt))
        row = RowController(0, req, self.tokenizer, self.stop_ids, None)
        for t in self.tokenizer.encode(self.outputs.pop(0), allow_special=True):
            yield row.push(t)
            if row.done:
                break
        n = len(req.prompt)
        self.last_result = GenerationResult([row.completion(n)], 0.0, 0.0, 0.0, n, n, 0, 0)


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer(384)


@pytest.fixture(scope="module")
def engine(tok):
    model = randomize(K31ForCausalLM(tiny_config(), rngs=nnx.Rngs(0)), 1)
    return Engine(model, tok, max_len=512, prefill_chunk=16)


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    monkeypatch.setenv("K31JAX_COMPILE_CACHE", "0")


def test_tool_call_round_trip_in_the_repl(tok):
    eng = ScriptedEngine(tok, [CALL_TURN, ANSWER_TURN])
    session = ChatSession(eng, tools=TOOLS, effort="low")
    out = io.StringIO()
    stdin = io.StringIO('Weather in Oslo?\n{"temp_c": -3}\n/history\n/exit\n')
    assert run_chat(session, stdin, out, err=io.StringIO()) == 0
    text = out.getvalue()
    assert "[thinking] I should call the tool." in text
    call = json.loads(next(line for line in text.splitlines() if line.startswith('{"tool_call"')))
    assert call["tool_call"]["name"] == "get_weather"
    assert call["tool_call"]["arguments"] == {"city": "Oslo"}
    assert "[answer] It is -3 C in Oslo." in text
    assert [m["role"] for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    assert session.messages[2]["tool_call_id"] == call["tool_call"]["id"]
    # the second prompt carries the declaration, the first turn's reasoning and the result
    second = eng.prompts[1]
    assert second.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools')
    assert "<|open|>think<|sep|>I should call the tool.<|close|>think<|sep|>" in second
    assert ('<|open|>message role="tool" tool="get_weather" index="1"<|sep|>{"temp_c": -3}'
            '<|close|>message<|sep|><|end_of_msg|>') in second
    assert second.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert '"role": "tool"' in text  # /history


def test_session_api_tool_results_and_missing_reasoning(tok):
    eng = ScriptedEngine(tok, [CALL_TURN, ANSWER_TURN])
    session = ChatSession(eng, tools=TOOLS)
    events = list(session.stream("Weather in Oslo?"))
    assert any(type(e).__name__ == "ToolCallStart" for e in events)
    (call,) = session.pending_tool_calls()
    with pytest.raises(KeyError, match="no tool call"):
        session.add_tool_result("call_nope", "x")
    session.add_tool_result(call["id"], {"temp_c": -3})
    assert session.pending_tool_calls() == []
    turn = session.send()
    assert turn.message["content"] == "It is -3 C in Oslo." and turn.tool_calls == []
    del session.messages[1]["reasoning_content"]  # the documented pitfall
    with pytest.raises(MissingReasoningError, match="reasoning_content"):
        session.prompt_ids()


def test_chat_session_on_tiny_keeps_history(engine, tok):
    session = ChatSession(engine, effort="high", max_new_tokens=6, thinking_budget=2,
                          params=SamplingParams(temperature=0.7, seed=3))
    first = session.send("Hello")
    assert first.message["role"] == "assistant" and isinstance(first.message["reasoning_content"], str)
    second = session.send("And again?")
    prompt = tok.decode(session.prompt_ids())
    assert prompt.count('<|open|>message role="user"<|sep|>') == 2
    assert f'<|open|>think<|sep|>{first.message["reasoning_content"]}' in prompt
    for turn in (first, second):  # each turn's thinking is counted from zero
        assert turn.completion.thinking_tokens >= 2 and len(turn.completion.tokens) <= 6


def test_cli_generate_prints_text_banner_and_timing(capsys):
    assert main(["generate", "--prompt", "Hello, K3", "--max-new-tokens", "6", *SMALL]) == 0
    out, err = capsys.readouterr()
    assert "SEEDED RANDOM" in err and "'tiny'" in err
    assert "prefill" in err and "decode" in err and "tok/s" in err
    assert out.startswith("[thinking] ") and len(out.strip()) > len("[thinking]")
    assert main(["generate", "--prompt", "Hello, K3", "--max-new-tokens", "6", "--stream",
                 "--temperature", "0.8", "--top-p", "0.9", "--effort", "low", *SMALL]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("[thinking] ") and "finish: length" in err
    assert main(["generate", "--prompt", "Hello", "--raw", "--stop", "\x00", "--max-new-tokens", "5", *SMALL]) == 0
    out, err = capsys.readouterr()
    assert "[thinking]" not in out and "new tokens" in err


def test_cli_chat_with_piped_stdin(capsys, monkeypatch, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "now", "parameters": {"type": "object"}}]))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n/effort low\n/history\n/exit\n"))
    assert main(["chat", "--tools", str(tools), "--effort", "none", "--max-new-tokens", "4", *SMALL]) == 0
    out, err = capsys.readouterr()
    assert "SEEDED RANDOM" in err and "decode" in err
    assert "[thinking]" in out and "(effort: low)" in out
    history = json.loads(out[out.index("["  + "\n"):out.rindex("]") + 1])
    assert [m["role"] for m in history] == ["user", "assistant"]


def test_repl_reports_a_too_long_history_and_goes_on(engine):
    session = ChatSession(engine, max_new_tokens=4)
    out, err = io.StringIO(), io.StringIO()
    run_chat(session, io.StringIO("x" * 600 + "\n/history\n"), out, err=err)
    assert "exceeds the cache length" in err.getvalue()
    assert session.messages == [] and out.getvalue().strip().endswith("[]")


@pytest.mark.slow
def test_cli_chat_subprocess_with_piped_stdin():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "k31jax.cli", "chat", "--max-new-tokens", "4", *SMALL],
                          input="Hi\n/history\n", capture_output=True, text=True, cwd=root,
                          timeout=600, env={**__import__("os").environ, "K31JAX_COMPILE_CACHE": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "SEEDED RANDOM" in proc.stderr and '"role": "assistant"' in proc.stdout


def test_load_model_routes_orbax_and_safetensors_folders(tmp_path, monkeypatch):
    import k31jax
    import k31jax.ckpt
    from k31jax.generate import _loading

    sentinel = type("M", (), {"config": tiny_config(), "init_cache": None})()
    calls = []
    monkeypatch.setattr(k31jax.ckpt, "load_checkpoint", lambda p, **kw: calls.append(("orbax", kw)) or sentinel)
    monkeypatch.setattr(k31jax, "load_hf_weights", lambda p, **kw: calls.append(("hf", kw)) or sentinel)
    orbax = tmp_path / "orbax"
    orbax.mkdir()
    (orbax / "_CHECKPOINT_METADATA").write_text("{}")
    st = tmp_path / "st"
    st.mkdir()
    (st / "model-00001-of-00001.safetensors").write_bytes(b"")
    loaded = _loading.load_model(orbax, dtype="float32")
    assert loaded.model is sentinel and loaded.banner is None and isinstance(loaded.tokenizer, ByteTokenizer)
    _loading.load_model(st)
    assert calls == [("orbax", {"dtype": "float32"}), ("hf", {"dtype": None})]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _loading.load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="tiktoken.model"):
        _loading.load_tokenizer(orbax, 163840)
