"""OpenAI Chat Completions and Completions: request → ``GenSpec``, results → response objects.

Reasoning travels as ``reasoning_content`` (message and stream delta) and is accepted back in
requests; tool calls carry server-minted ``call_<24 hex>`` ids. Extension fields (ignored by
OpenAI clients unless set via ``extra_body``): ``top_k``, ``thinking_budget`` (a hard cap on
reasoning tokens), and for ``/v1/completions`` ``heal_prompt`` (token healing: the prompt's last
token is backed off and the first generated one must start with its bytes, which the returned
text leaves out; `k31jax.generate.heal_prompt`). User content may hold ``image_url`` parts
(``_protocol.RequestImages``).

``reasoning_effort`` maps onto K3's efforts (``_protocol.OPENAI_EFFORTS``: none / minimal turn
thinking off, low → low, medium / high → high, xhigh → max). Without ``max_tokens`` a chat
completion generates the server's default limit at most. ``parallel_tool_calls: false`` returns
the first call only. ``response_format`` (``json_object``, ``json_schema``) and
``tools[].function.strict`` are held by constrained decoding (``_protocol.output_grammar``).
Fields this server cannot honour (logit biases, penalties, the legacy functions API, audio,
``echo`` / ``suffix`` / ``best_of``) are refused with a 400 naming the field
(``CHAT_UNSUPPORTED``, ``COMPLETION_UNSUPPORTED``), never ignored.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from typing import Any

from ..chat import ParsedMessage
from ..generate import Request, heal_prompt
from ._protocol import (GenSpec, RequestImages, check_context, effort_settings, function_tools, get, in_range,
                        invalid, json_schema_format, max_tool_calls, output_grammar, refuse_unsupported,
                        render_prompt, sampling, stop_list, tool_choice_spec)

FINISH = {"stop": "stop", "length": "length"}


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = get(body, "messages", list, required=True)
    if not messages:
        raise invalid("field 'messages' must contain at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise invalid(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise invalid(f"messages[{i}].role must be one of system, developer, user, assistant, tool; "
                          f"got {role!r}", f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise invalid(f"messages[{i}].content must be a string or an array of parts",
                          f"messages[{i}].content")
        msg = dict(m)
        if role == "developer":
            msg["role"] = "system"
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise invalid(f"messages[{i}] (tool) needs a string 'tool_call_id'", f"messages[{i}].tool_call_id")
        out.append(msg)
    return out


_NO_PENALTY = "repetition penalties are not implemented (leave it 0; top_p / top_k / temperature are)"
# Fields that change what the client gets, refused rather than ignored; (name, accepted, why).
CHAT_UNSUPPORTED = (
    ("logit_bias", lambda v: v == {}, "logit biases are not applied"),
    ("frequency_penalty", lambda v: v == 0, _NO_PENALTY),
    ("presence_penalty", lambda v: v == 0, _NO_PENALTY),
    ("functions", lambda v: False, "the legacy functions API is not supported: use tools"),
    ("function_call", lambda v: False, "the legacy functions API is not supported: use tool_choice"),
    ("modalities", lambda v: v == ["text"], "this server returns text only"),
    ("audio", lambda v: False, "this server returns text only"),
    ("web_search_options", lambda v: False, "this server has no web search"),
)
COMPLETION_UNSUPPORTED = (
    ("best_of", lambda v: v == 1, "one completion is generated per request (best_of 1)"),
    ("echo", lambda v: v is False, "the prompt is not echoed back"),
    ("suffix", lambda v: v == "", "insertion (a suffix after the completion) is not supported"),
    ("logit_bias", lambda v: v == {}, "logit biases are not applied"),
    ("frequency_penalty", lambda v: v == 0, _NO_PENALTY),
    ("presence_penalty", lambda v: v == 0, _NO_PENALTY),
)


def chat_spec(body: Mapping[str, Any], tokenizer, max_len: int, *, image_dir: str | None = None,
              default_max_tokens: int | None = None, grammar: bool = True) -> GenSpec:
    """A chat completion request; local image files are read only below `image_dir`; without
    max_tokens it generates `default_max_tokens` at most (None: the rest of the context);
    `grammar`: hold the reply to its tools and ``response_format`` by constrained decoding."""
    _n_is_one(body)
    refuse_unsupported(body, CHAT_UNSUPPORTED)
    messages = _messages(body)
    tools = function_tools(body.get("tools"), "tools")
    thinking, effort = effort_settings(body.get("reasoning_effort"), "reasoning_effort")
    template_choice, forced = tool_choice_spec(body.get("tool_choice"), tools, "tool_choice")
    parallel = get(body, "parallel_tool_calls", bool, True)
    response_format = get(body, "response_format", dict)
    content_schema = json_schema_format(response_format, "response_format")
    temperature = get(body, "temperature", float)
    in_range("temperature", temperature, 0, 2)
    top_p = get(body, "top_p", float)
    in_range("top_p", top_p, 0, 1)
    top_k = get(body, "top_k", int)
    in_range("top_k", top_k, 0, 1 << 30)
    seed = get(body, "seed", int)
    max_tokens = get(body, "max_completion_tokens", int, get(body, "max_tokens", int))
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    in_range(param, max_tokens, 1, 1 << 30)
    logprobs = bool(get(body, "logprobs", bool, False))
    top_logprobs = get(body, "top_logprobs", int, 0)
    in_range("top_logprobs", top_logprobs, 0, 20)
    if top_logprobs and not logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    budget = get(body, "thinking_budget", int)
    in_range("thinking_budget", budget, 0, 1 << 30)
    stop = stop_list(body.get("stop"), "stop", 4)
    get(body, "stream", bool)
    stream_options = get(body, "stream_options", dict, {})
    get(stream_options, "include_usage", bool, where="stream_options.")
    images = RequestImages(image_dir)
    prompt = render_prompt(tokenizer, messages, tools, thinking=thinking, effort=effort,
                           tool_choice=template_choice, images=images,
                           response_format=response_format if content_schema is not None else None)
    max_tokens = check_context(len(prompt.ids), max_tokens, max_len, param, default_max_tokens)
    req = Request(prompt.ids, sampling(temperature, top_p, top_k, seed), max_tokens, None, stop,
                  budget if thinking else None, parse=True, chat_format="k3", markup="ids",
                  images=tuple(images.images), snapshot_at=prompt.marks,
                  grammar=output_grammar(tools, forced, parallel, content_schema) if grammar else None)
    return GenSpec(req, forced, max_tool_calls(forced, parallel), logprobs, top_logprobs)


def completion_spec(body: Mapping[str, Any], tokenizer, max_len: int) -> GenSpec:
    _n_is_one(body)
    refuse_unsupported(body, COMPLETION_UNSUPPORTED)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
        if tokenizer.bos_id is not None:
            ids = [tokenizer.bos_id] + ids
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise invalid(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})",
                          "prompt")
    elif prompt is None:
        raise invalid("missing required field 'prompt'", "prompt")
    else:
        raise invalid("field 'prompt' must be a string, a one-string array or an array of token ids", "prompt")
    temperature = get(body, "temperature", float)
    in_range("temperature", temperature, 0, 2)
    top_p = get(body, "top_p", float)
    in_range("top_p", top_p, 0, 1)
    max_tokens = get(body, "max_tokens", int, 16)
    in_range("max_tokens", max_tokens, 1, 1 << 30)
    logprobs = get(body, "logprobs", int)
    in_range("logprobs", logprobs, 0, 5)
    get(body, "stream", bool)
    stop = stop_list(body.get("stop"), "stop", 4)
    healed = b""
    if get(body, "heal_prompt", bool, False):
        ids, healed = heal_prompt(tokenizer, ids)
    max_tokens = check_context(len(ids), max_tokens, max_len, "max_tokens")
    req = Request(ids, sampling(temperature, top_p, get(body, "top_k", int), get(body, "seed", int)),
                  max_tokens, None, stop, healed_prefix=healed)
    return GenSpec(req, None, None, logprobs is not None, logprobs or 0)


def _n_is_one(body) -> None:
    n = get(body, "n", int, 1)
    if n != 1:
        raise invalid(f"field 'n' = {n}: this server returns one choice per request (n=1)", "n")


# ---- responses ---------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def finish_reason(reason: str, calls) -> str:
    """`length` when max_tokens ended the turn (a call it cut may be incomplete), else
    `tool_calls` when the reply has calls, else `stop`."""
    if calls and reason != "length":
        return "tool_calls"
    return FINISH.get(reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def logprob_entry(tokenizer, token: int, lp, top: int) -> dict[str, Any]:
    def one(t: int, v: float) -> dict[str, Any]:
        return {"token": tokenizer.decode([t]), "logprob": v, "bytes": list(tokenizer.token_bytes(t))}
    entry = one(token, lp.logprob)
    entry["top_logprobs"] = [one(t, v) for t, v in lp.top[:top]]
    return entry


def chat_message(parsed: ParsedMessage, calls) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning_content is not None:
        msg["reasoning_content"] = parsed.reasoning_content
    if calls:
        msg["tool_calls"] = [c.to_openai() for c in calls]
    return msg


def chat_response(rid: str, model: str, created: int, message: dict[str, Any], finish: str,
                  usage_: dict[str, Any], logprobs: list | None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": {"content": logprobs} if logprobs is not None else None}],
            "usage": usage_}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any] | None,
               finish: str | None = None, logprobs: list | None = None,
               usage_: dict[str, Any] | None = None) -> str:
    obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": model, "system_fingerprint": None}
    obj["choices"] = [] if delta is None else [{
        "index": 0, "delta": delta, "finish_reason": finish,
        "logprobs": {"content": logprobs} if logprobs is not None else None}]
    if usage_ is not None:
        obj["usage"] = usage_
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def completion_response(rid: str, model: str, created: int, text: str, finish: str,
                        usage_: dict[str, Any], logprobs: dict | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}],
            "usage": usage_}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None,
                     usage_: dict[str, Any] | None = None) -> str:
    obj = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
    if usage_ is not None:
        obj["usage"] = usage_
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def now() -> int:
    return int(time.time())
