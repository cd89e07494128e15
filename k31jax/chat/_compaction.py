"""Compaction of an agent's history: tool results replaced by short stubs, every tool call kept.

A long agent session is mostly tool output (files read, pages fetched, search results): static
documents the model has already used. ``compact_history`` replaces chosen tool results with a
one-line stub and leaves everything else as it is: the calls (their names and arguments, the
record of what the agent did), the reasoning, the user and assistant messages, and the order.

Why stubs and not a rewrite: the history up to the first replaced document renders to the
same tokens as before, so a server that stored the session's state there (at a turn end)
resumes the compacted history from it and prefills only the rest; a rewritten history would be
prefilled from its first token. Compacting the oldest results first keeps that shared head as
long as it can be.

Which results: named by ``tool_call_id`` (``documents``), all but the last ``keep_last``, or the
oldest first until the rendered history fits ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from k31jax.chat._render import apply_chat_template

DEFAULT_STUB = "[tool result compacted: {tokens} tokens from {name}; call it again if it is needed]"


def _call_names(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    names = {}
    for m in messages:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            names[call.get("id")] = fn.get("name", "a tool")
    return names


def compact_history(messages: Sequence[Mapping[str, Any]], tokenizer, *, documents: Sequence[str] | None = None,
                    keep_last: int | None = None, max_tokens: int | None = None,
                    stub: str = DEFAULT_STUB) -> tuple[list[dict[str, Any]], list[str]]:
    """(the history with the chosen tool results replaced by `stub`, their tool_call_ids in
    order). `stub` may use ``{name}`` (the tool), ``{tokens}`` (the result's length) and
    ``{call_id}``. Exactly one of `documents`, `keep_last`, `max_tokens` chooses; the caller's
    list is never changed. A ``ValueError`` names an unknown call id or an unreachable budget."""
    if sum(x is not None for x in (documents, keep_last, max_tokens)) != 1:
        raise ValueError("choose what to compact with exactly one of documents, keep_last, max_tokens")
    out = [dict(m) for m in messages]
    results = [i for i, m in enumerate(out) if m.get("role") == "tool"]
    names = _call_names(out)

    def replace(i: int) -> str:
        m = out[i]
        content = m.get("content") or ""
        text = content if isinstance(content, str) else "".join(
            p.get("text", "") for p in content if isinstance(p, Mapping))
        call_id = m.get("tool_call_id", "")
        m["content"] = stub.format(name=names.get(call_id, m.get("name", "a tool")), call_id=call_id,
                                   tokens=len(tokenizer.encode(text)))
        return call_id

    if documents is not None:
        by_id = {out[i].get("tool_call_id"): i for i in results}
        unknown = [d for d in documents if d not in by_id]
        if unknown:
            raise ValueError(f"documents {unknown} are no tool results of this history (known: {sorted(by_id)})")
        chosen = sorted(by_id[d] for d in documents)
        return out, [replace(i) for i in chosen]
    if keep_last is not None:
        if keep_last < 0:
            raise ValueError(f"keep_last={keep_last} (must be >= 0)")
        return out, [replace(i) for i in results[:max(len(results) - keep_last, 0)]]
    done = []
    for i in results:
        if len(apply_chat_template(tokenizer, out, add_generation_prompt=False)) <= max_tokens:
            return out, done
        done.append(replace(i))
    if len(apply_chat_template(tokenizer, out, add_generation_prompt=False)) > max_tokens:
        raise ValueError(f"the history does not fit max_tokens={max_tokens} even with every tool result compacted")
    return out, done
