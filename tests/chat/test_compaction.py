"""`compact_history`: tool results become stubs, every call and message stays, and the history
renders to the same tokens up to the first replaced result (what lets a server resume it)."""

from __future__ import annotations

import copy

import pytest

from k31jax.chat import ByteTokenizer, apply_chat_template, compact_history, document_messages

TOK = ByteTokenizer()


def _history(n_results: int = 3) -> list[dict]:
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Summarise the repo."}]
    for i in range(n_results):
        msgs.append({"role": "assistant", "content": "", "reasoning_content": f"read file {i}",
                     "tool_calls": [{"id": f"call_{i}", "type": "function",
                                     "function": {"name": "read_file", "arguments": f'{{"path": "f{i}.py"}}'}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"# file {i}\n" + "x = 1\n" * 40})
    msgs.append({"role": "assistant", "content": "Done.", "reasoning_content": "enough"})
    return msgs


def _tokens(msgs):
    return apply_chat_template(TOK, msgs, add_generation_prompt=False)


def test_keep_last_replaces_the_older_results_and_keeps_every_call():
    history = _history()
    before = copy.deepcopy(history)
    out, done = compact_history(history, TOK, keep_last=1)
    assert history == before  # the caller's list is not changed
    assert done == ["call_0", "call_1"]
    tools = [m for m in out if m["role"] == "tool"]
    assert tools[0]["content"] == "[tool result compacted: 249 tokens from read_file; call it again if it is needed]"
    assert tools[2]["content"] == history[7]["content"]
    assert [m.get("tool_calls") for m in out] == [m.get("tool_calls") for m in history]  # the record of calls
    assert [m.get("reasoning_content") for m in out] == [m.get("reasoning_content") for m in history]
    first_tool = _tokens(history[:3])  # the history up to the first replaced result
    assert _tokens(out)[:len(first_tool)] == _tokens(history)[:len(first_tool)]
    assert len(_tokens(out)) < len(_tokens(history))


def test_documents_by_call_id_and_a_token_budget_oldest_first():
    history = _history()
    out, done = compact_history(history, TOK, documents=["call_2", "call_0"], stub="<{call_id}: {name}>")
    assert done == ["call_0", "call_2"] and out[3]["content"] == "<call_0: read_file>"
    assert out[5]["content"] == history[5]["content"]
    full = len(_tokens(history))
    budget = full - 100  # one result less is enough (a result: 249 tokens, its stub: 82)
    out, done = compact_history(history, TOK, max_tokens=budget)
    assert done == ["call_0"] and len(_tokens(out)) <= budget
    assert compact_history(history, TOK, max_tokens=full) == (history, [])


@pytest.mark.parametrize("kw, match", [({"documents": ["call_9"]}, "call_9"), ({"max_tokens": 10}, "does not fit"),
                                       ({}, "exactly one"), ({"keep_last": 1, "max_tokens": 5}, "exactly one"),
                                       ({"keep_last": -1}, "keep_last")])
def test_bad_choices_say_what_is_wrong(kw, match):
    with pytest.raises(ValueError, match=match):
        compact_history(_history(), TOK, **kw)


def _with_documents() -> list[dict]:
    """A user pastes a spec (a marked document) beside a question; a tool result follows."""
    msgs = [{"role": "system", "content": "You are an agent."},
            {"role": "user", "content": [{"type": "text", "text": "Implement this spec:\n"},
                                         {"type": "text", "text": "SPEC " + "must hold; " * 60, "document_id": "spec"},
                                         {"type": "text", "text": "\nStart with the parser."}]}]
    msgs.append({"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
                 "function": {"name": "read_file", "arguments": '{"path": "p.py"}'}}]})
    msgs.append({"role": "tool", "tool_call_id": "call_0", "content": "def parse():\n" + "    pass\n" * 30})
    msgs.append({"role": "assistant", "content": "Read it."})
    return msgs


def test_user_documents_marked_by_id_are_compacted_like_tool_results():
    history = _with_documents()
    before = copy.deepcopy(history)
    assert document_messages(history) == [1, 3]  # where a server stores the state
    out, done = compact_history(history, TOK, documents=["spec"])
    assert history == before and done == ["spec"]
    parts = out[1]["content"]
    assert parts[0] == history[1]["content"][0] and parts[2] == history[1]["content"][2]  # the question stays
    tokens = len(TOK.encode(history[1]["content"][1]["text"]))
    assert parts[1] == {"type": "text", "text": f"[document spec compacted: {tokens} tokens; send it again if it "
                                                "is needed]"}  # the mark goes: compacting again leaves it
    assert out[3] == history[3] and out[2] == history[2]
    head = _tokens(history[:1])  # the history before the document's message renders as before
    assert _tokens(out)[:len(head)] == _tokens(history)[:len(head)] and len(_tokens(out)) < len(_tokens(history))
    # keep_last and a budget count both kinds, oldest first
    out, done = compact_history(history, TOK, keep_last=1, document_stub="<{name}: {tokens}>")
    assert done == ["spec"] and out[1]["content"][1]["text"] == f"<spec: {tokens}>" and out[3] == history[3]
    assert compact_history(history, TOK, keep_last=0)[1] == ["spec", "call_0"]
    again, done = compact_history(compact_history(history, TOK, keep_last=0)[0], TOK, keep_last=0)
    assert done == ["call_0"]  # the compacted document is no document any more


@pytest.mark.parametrize("part, match", [
    ({"type": "text", "text": "x", "document_id": ""}, "non-empty string"),
    ({"type": "text", "text": "x", "document_id": 7}, "non-empty string"),
    ({"type": "image_url", "image_url": {"url": "data:,"}, "document_id": "img"}, "on a 'image_url' part"),
    ({"type": "text", "text": "x", "document_id": "call_0"}, r"\['call_0'\] are used twice"),
])
def test_bad_document_marks_name_the_part(part, match):
    history = _with_documents()
    history.append({"role": "user", "content": [part]})
    with pytest.raises(ValueError, match=match):
        compact_history(history, TOK, keep_last=0)
