"""Compaction of an agent's history: static documents replaced by short stubs, every tool call kept.

A long agent session is mostly static documents the model has already used: tool output (files
read, pages fetched, search results) and reference text the user pasted in. ``compact_history``
replaces chosen documents with a one-line stub and leaves everything else as it is: the calls
(their names and arguments, the record of what the agent did), the reasoning, the user and
assistant messages around the documents, and the order.

Documents: every tool result (named by its ``tool_call_id``), and every text part of a user
message that the client marked with a ``document_id`` (this library's extension of the chat
format: ``{"type": "text", "text": "...", "document_id": "spec"}``). A compacted part loses its
mark, so compacting again leaves its stub as it is.

Why stubs and not a rewrite: the history up to the first replaced document renders to the
same tokens as before, so a server that stored the session's state there (at a turn end, or
where the turn that brought the document began) resumes the compacted history from it and
prefills only the rest; a rewritten history would be prefilled from its first token.
Compacting the oldest documents first keeps that shared head as long as it can be.

Which documents: named by id (``documents``), all but the last ``keep_last``, or the oldest
first until the rendered history fits ``max_tokens``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from k31jax.chat._render import apply_chat_template

DEFAULT_STUB = "[tool result compacted: {tokens} tokens from {name}; call it again if it is needed]"
DEFAULT_DOCUMENT_STUB = "[document {name} compacted: {tokens} tokens; send it again if it is needed]"


@dataclasses.dataclass(frozen=True)
class _Document:
    message: int
    part: int | None  # the content part of a user document; None: the whole tool result
    id: str


def _call_names(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    names = {}
    for m in messages:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            names[call.get("id")] = fn.get("name", "a tool")
    return names


def _documents(messages: Sequence[Mapping[str, Any]]) -> list[_Document]:
    """Every document of the history in order; a ``ValueError`` for a bad or repeated mark."""
    found: list[_Document] = []
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            found.append(_Document(i, None, m.get("tool_call_id", "")))
        elif m.get("role") == "user" and isinstance(m.get("content"), list):
            for j, part in enumerate(m["content"]):
                if isinstance(part, Mapping) and "document_id" in part:
                    doc = part["document_id"]
                    if not isinstance(doc, str) or not doc or part.get("type") != "text":
                        raise ValueError(f"messages[{i}].content[{j}]: a document_id must be a non-empty string "
                                         f"on a text part (got {doc!r} on a {part.get('type')!r} part)")
                    found.append(_Document(i, j, doc))
    uses = collections.Counter(d.id for d in found)
    repeated = sorted({d.id for d in found if d.part is not None and uses[d.id] > 1})
    if repeated:
        raise ValueError(f"document ids {repeated} are used twice in this history (as documents or tool call ids)")
    return found


def document_messages(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The indices of the messages that hold a document (a tool result, or a user message with
    a marked part): where a server stores the state, for a later compaction to resume from."""
    return sorted({d.message for d in _documents(messages)})


def compact_history(messages: Sequence[Mapping[str, Any]], tokenizer, *, documents: Sequence[str] | None = None,
                    keep_last: int | None = None, max_tokens: int | None = None, stub: str = DEFAULT_STUB,
                    document_stub: str = DEFAULT_DOCUMENT_STUB) -> tuple[list[dict[str, Any]], list[str]]:
    """(the history with the chosen documents replaced, their ids in order): a tool result by
    `stub`, a user's marked document by `document_stub`. Each may use ``{name}`` (the tool, or
    the document id), ``{tokens}`` (the document's length) and ``{call_id}`` (the tool call id,
    or the document id). Exactly one of `documents`, `keep_last`, `max_tokens` chooses; the
    caller's list is never changed. A ``ValueError`` names an unknown id or an unreachable budget."""
    if sum(x is not None for x in (documents, keep_last, max_tokens)) != 1:
        raise ValueError("choose what to compact with exactly one of documents, keep_last, max_tokens")
    out = [dict(m) for m in messages]
    found = _documents(out)
    names = _call_names(out)

    def text_of(content) -> str:
        return content if isinstance(content, str) else "".join(
            p.get("text", "") for p in content or () if isinstance(p, Mapping))

    def replace(d: _Document) -> str:
        m = out[d.message]
        if d.part is None:
            m["content"] = stub.format(name=names.get(d.id, m.get("name", "a tool")), call_id=d.id,
                                       tokens=len(tokenizer.encode(text_of(m.get("content") or ""))))
        else:
            parts = list(m["content"])
            tokens = len(tokenizer.encode(parts[d.part].get("text") or ""))
            parts[d.part] = {"type": "text", "text": document_stub.format(name=d.id, call_id=d.id, tokens=tokens)}
            m["content"] = parts
        return d.id

    if documents is not None:
        by_id = {d.id: d for d in found}
        unknown = [d for d in documents if d not in by_id]
        if unknown:
            raise ValueError(f"documents {unknown} are neither tool results nor marked documents of this history "
                             f"(known: {sorted(by_id)})")
        chosen = sorted((by_id[d] for d in documents), key=lambda d: (d.message, d.part or 0))
        return out, [replace(d) for d in chosen]
    if keep_last is not None:
        if keep_last < 0:
            raise ValueError(f"keep_last={keep_last} (must be >= 0)")
        return out, [replace(d) for d in found[:max(len(found) - keep_last, 0)]]
    done = []
    for d in found:
        if len(apply_chat_template(tokenizer, out, add_generation_prompt=False)) <= max_tokens:
            return out, done
        done.append(replace(d))
    if len(apply_chat_template(tokenizer, out, add_generation_prompt=False)) > max_tokens:
        raise ValueError(f"the history does not fit max_tokens={max_tokens} even with every document compacted")
    return out, done
