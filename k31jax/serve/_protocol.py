"""What both APIs share: request validation, API errors, and the prompt → ``Request`` step.

Validation is written out here (not pydantic models) so that every error names the field and
what was expected in the API's own words, and unknown fields are ignored, as both APIs do.

Images (OpenAI ``image_url`` parts, Anthropic ``image`` blocks) are read while the prompt is
rendered (`RequestImages`): data: URLs and base64 always; local paths and file:// URLs only
below the server's ``image_dir`` (a client must not read the server's other files); remote
URLs never. The processed images travel with the ``Request``; a model without a vision tower
answers 400.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..chat import (ChatTemplateError, MediaPartError, ParsedMessage, apply_chat_template, document_messages,
                    resolve_reasoning_effort)
from ..generate import OutputGrammar, Request, SamplingParams, ToolChoice, ToolSchema
from ..vision import ImagePrompts


class APIError(Exception):
    """An error answered in the API's schema. ``kind``: invalid_request | authentication |
    not_found | request_too_large | rate_limit | server_error | overloaded."""

    STATUS = {"invalid_request": 400, "authentication": 401, "not_found": 404,
              "request_too_large": 413, "rate_limit": 429, "server_error": 500, "overloaded": 503}

    def __init__(self, kind: str, message: str, *, param: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param
        self.status = self.STATUS[kind]
        self.headers = dict(headers or {})


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError("invalid_request", message, param=param)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object"}


def get(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None, *,
        required: bool = False, where: str = "") -> Any:
    """``body[name]`` checked against ``kind`` (int accepted for float; bool never for int/float);
    ``None`` / absent gives ``default`` (or a 400 when ``required``)."""
    path = f"{where}{name}"
    value = body.get(name)
    if value is None:
        if required:
            raise invalid(f"missing required field '{path}'", path)
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = any(isinstance(value, k) for k in kinds)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    if not ok and float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        want = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise invalid(f"field '{path}' must be {want}, got {type(value).__name__} {json.dumps(value)[:60]}",
                      path)
    return value


def in_range(name: str, value: float | None, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if value is None:
        return
    if (value <= lo if lo_open else value < lo) or value > hi:
        bracket = "(" if lo_open else "["
        raise invalid(f"field '{name}' = {value} is out of range: expected {bracket}{lo}, {hi}]", name)


def stop_list(value: Any, name: str, max_items: int) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid(f"field '{name}' must be a string or an array of strings", name)
    if len(items) > max_items:
        raise invalid(f"field '{name}' has {len(items)} entries; at most {max_items} are supported", name)
    if any(not s for s in items):
        raise invalid(f"field '{name}' must not contain empty strings", name)
    return tuple(items)


@dataclasses.dataclass
class GenSpec:
    """One generation, API-independent."""

    request: Request
    tool_choice: ToolChoice | None
    max_tool_calls: int | None  # calls returned at most: 0 (tool_choice none), 1 (no parallel calls), None
    logprobs: bool
    top_logprobs: int

    def calls(self, parsed: ParsedMessage | None) -> list:
        """The tool calls a client gets of a parsed reply."""
        calls = [] if parsed is None else parsed.tool_calls
        return calls if self.max_tool_calls is None else calls[:self.max_tool_calls]

    def keeps_call(self, index: int) -> bool:
        """Whether the streamed call `index` (0-based) reaches the client."""
        return self.max_tool_calls is None or index < self.max_tool_calls


def max_tool_calls(forced: ToolChoice | None, parallel: bool) -> int | None:
    if forced is not None and forced.mode == "none":
        return 0
    return None if parallel else 1


# The API effort levels on K3's low / high / max (chat_format.md §4 accepts those three only);
# None: thinking off. OpenAI's `medium`, its most common value, asks for more than `low`.
OPENAI_EFFORTS = {"none": None, "minimal": None, "low": "low", "medium": "high", "high": "high",
                  "xhigh": "max", "max": "max"}
ANTHROPIC_EFFORTS = {"low": "low", "medium": "high", "high": "high", "max": "max"}
# Anthropic `thinking.budget_tokens` -> effort when `output_config.effort` is absent: below
# 4096 tokens `low` (K3 at low effort has been seen reasoning for 3-7k tokens), below 16384
# `high`, else `max`. The budget itself stays a hard cap on the reasoning.
BUDGET_EFFORTS = ((4096, "low"), (16384, "high"))


def effort_settings(value: Any, param: str, levels: Mapping[str, str | None] = OPENAI_EFFORTS
                    ) -> tuple[bool, str | None]:
    """(thinking, effort) from an API effort value (absent: thinking on at the default effort)."""
    if value is not None and not isinstance(value, str):
        raise invalid(f"field '{param}' must be a string", param)
    if value is not None and value not in levels:
        raise invalid(f"field '{param}' = {value!r} is not supported: use one of {', '.join(levels)}", param)
    effort = None if value is None else levels[value]
    if value is not None and effort is None:
        return False, None
    return resolve_reasoning_effort(effort)


def budget_effort(budget_tokens: int) -> str:
    """The effort an Anthropic thinking budget asks for (``BUDGET_EFFORTS``)."""
    return next((effort for below, effort in BUDGET_EFFORTS if budget_tokens < below), "max")


def refuse_unsupported(body: Mapping[str, Any], fields: Sequence[tuple[str, Any, str]], where: str = "") -> None:
    """A 400 for a field that would change what the client gets but that this server does not
    implement; `fields`: (name, a predicate accepting the values it may have here, why not)."""
    for name, accepted, why in fields:
        value = body.get(name)
        if value is not None and not accepted(value):
            raise invalid(f"field '{where}{name}' = {json.dumps(value)[:80]} is not supported: {why}",
                          f"{where}{name}")


def tool_choice_spec(choice: Any, tools: Sequence[Mapping[str, Any]] | None, param: str) -> tuple[Any, ToolChoice | None]:
    """(the value for the chat template, the engine's forced choice) from an OpenAI-form choice."""
    names = tuple(t.get("function", {}).get("name") for t in tools or ())
    if choice is None or choice == "auto":
        return None, None
    if choice == "none":
        return "none", ToolChoice("none", names) if tools else None
    if choice == "required":
        if not tools:
            raise invalid(f"'{param}' is 'required' but no tools were given", param)
        return "required", ToolChoice("required", names)
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), Mapping) else None
        if not isinstance(name, str) or not name:
            raise invalid(f"'{param}' must name a function: {{\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", param)
        if name not in names:
            raise invalid(f"'{param}' names function {name!r}, which is not among the tools {list(names)}",
                          param)
        return choice, ToolChoice("named", names, name)
    raise invalid(f"'{param}' must be 'auto', 'none', 'required' or a named function", param)


def _local_path(part: Mapping[str, Any]) -> str | None:
    """The file an image part names (a path or a file:// URL), or None (data: / remote URLs,
    base64 blocks: `image_part_bytes` reads or refuses those itself)."""
    ref = part.get("image_url") if part.get("type") == "image_url" else None
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if not isinstance(url, str) or not url or url.startswith("data:"):
        return None
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        return urllib.parse.unquote(parsed.path)
    return url if not parsed.scheme or len(parsed.scheme) == 1 else None


class RequestImages(ImagePrompts):
    """The image parts of one API request (a `media_prompt`); files only below `image_dir`."""

    def __init__(self, image_dir: str | None = None):
        super().__init__(base_dir=image_dir)
        self.image_dir = None if image_dir is None else Path(image_dir).resolve()

    def __call__(self, part: Mapping[str, Any]) -> str:
        path = _local_path(part)
        if path is not None:
            if self.image_dir is None:
                raise MediaPartError("this server reads no local image files (start it with --image-dir DIR to "
                                     "allow files below DIR); send the image as a data: URL")
            if not (self.image_dir / path).resolve().is_relative_to(self.image_dir):
                raise MediaPartError(f"{path} is outside the server's image directory")
        return super().__call__(part)


@dataclasses.dataclass
class Prompt:
    """A rendered chat prompt: its ids, and where the scheduler should also store its state
    (``Request.snapshot_at``): the conversation's end when notes for this turn follow it (the
    tool-choice message), and the start of each document's message of this turn (where a
    compacted history first differs)."""

    ids: list[int]
    marks: tuple[int, ...] = ()


class _Recorded:
    """A media prompt that keeps the blocks it returns, to render the same conversation again."""

    def __init__(self, inner):
        self.inner, self.blocks = inner, []

    def __call__(self, part: Mapping[str, Any]) -> str:
        block = self.inner(part)
        self.blocks.append(block)
        return block


def render_prompt(tokenizer, messages, tools, *, thinking: bool, effort: str | None,
                  tool_choice: Any, images: ImagePrompts | None = None,
                  response_format: Mapping[str, Any] | None = None) -> Prompt:
    """The prompt; `images` (a `RequestImages`) reads the image parts, which then render as
    media blocks and are kept in `images.images`.

    The tool-choice message (``required`` / ``none``) follows the conversation and the next turn
    does not repeat it, so this turn's prompt is no prefix of the next one: a mark at the
    conversation's end lets the scheduler store a snapshot there for the next turn to resume
    from. The documents after the last assistant message (tool results, user messages with a
    part marked by a ``document_id``) are marked where their message starts: a compaction that
    replaces one (`k31jax.chat.compact_history`) keeps the history before it.
    """
    recorded = _Recorded(images) if images is not None else None
    kw = dict(thinking=thinking, thinking_effort=effort if thinking else None, response_format=response_format)

    def head_length(upto: int) -> int | None:
        """Tokens of `messages[:upto]` rendered without a generation prompt, when they begin the prompt."""
        blocks = iter(recorded.blocks if recorded is not None else ())
        head = apply_chat_template(tokenizer, messages[:upto], tools or None, add_generation_prompt=False,
                                   media_prompt=(lambda part: next(blocks)) if images is not None else None, **kw)
        return len(head) if ids[:len(head)] == head else None

    try:
        ids = apply_chat_template(tokenizer, messages, tools or None, tool_choice=tool_choice,
                                  media_prompt=recorded, **kw)
        last_assistant = max((k for k, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
        starts = [k for k in document_messages(messages) if k > last_assistant]
        ends = [len(messages)] if tool_choice in ("required", "none") else []
        marks = tuple(n for n in (head_length(k) for k in [*starts, *ends]) if n is not None)
    except (ChatTemplateError, ValueError) as e:  # (a bad document mark is a ValueError)
        raise invalid(str(e), "messages") from None
    except (TypeError, AttributeError, KeyError) as e:
        raise invalid(f"messages could not be rendered: {e}", "messages") from None
    return Prompt(ids, marks)


def sampling(temperature, top_p, top_k, seed, param_prefix: str = "") -> SamplingParams:
    temperature = 1.0 if temperature is None else float(temperature)
    top_p = 1.0 if top_p is None else float(top_p)
    if top_p == 0.0:  # the most likely token only
        temperature, top_p = 0.0, 1.0
    try:
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k or 0,
                              seed=0 if seed is None else int(seed))
    except ValueError as e:
        raise invalid(f"{param_prefix}{e}") from None


def check_context(n_prompt: int, max_tokens: int | None, max_len: int, param: str,
                  default: int | None = None) -> int:
    """The max_tokens to use (absent: `default`, at most the rest of the context); a 400 naming
    the limit when the prompt (plus max_tokens) does not fit the context."""
    if n_prompt >= max_len:
        raise invalid(f"the prompt has {n_prompt} tokens; this server's context length is {max_len} "
                      f"tokens (prompt + {param} must fit)", "messages")
    if max_tokens is None:
        return max_len - n_prompt if default is None else min(default, max_len - n_prompt)
    if n_prompt + max_tokens > max_len:
        raise invalid(f"the prompt has {n_prompt} tokens and {param} is {max_tokens}: together they "
                      f"exceed this server's context length of {max_len} tokens", param)
    return max_tokens


def function_tools(tools: Any, param: str) -> list[dict[str, Any]] | None:
    """OpenAI ``tools`` validated (``type: function`` with a named function)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid(f"field '{param}' must be an array", param)
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"{param}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                          f"{param}[{i}]")
        get(fn, "strict", bool, where=f"{param}[{i}].function.")
        get(fn, "parameters", dict, where=f"{param}[{i}].function.")
    return tools


def json_schema_format(value: Any, param: str) -> dict[str, Any] | None:
    """The content's JSON schema of an OpenAI-style ``response_format`` (``text``: None;
    ``json_object``: any object; ``json_schema``: its ``json_schema.schema``, any object when
    it has none)."""
    if value is None:
        return None
    kind = get(value, "type", str, required=True, where=f"{param}.") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = get(value, "json_schema", dict, required=True, where=f"{param}.")
        get(spec, "name", str, where=f"{param}.json_schema.")
        get(spec, "strict", bool, where=f"{param}.json_schema.")
        return get(spec, "schema", dict, {"type": "object"}, where=f"{param}.json_schema.")
    raise invalid(f"field '{param}' must be {{\"type\": \"text\" | \"json_object\" | \"json_schema\"}}", param)


def output_grammar(tools: Sequence[Mapping[str, Any]] | None, forced: ToolChoice | None, parallel: bool,
                   content_schema: Mapping[str, Any] | None) -> OutputGrammar | None:
    """What constrained decoding holds the reply to (`k31jax.generate.OutputGrammar`): the
    declared tools (OpenAI form; ``function.strict`` ones by their parameters' schema), the
    tool choice, parallel calls, the content's JSON schema; None with neither tools nor schema."""
    if not tools and content_schema is None:
        return None
    schemas = tuple(ToolSchema(t["function"]["name"], json.dumps(t["function"].get("parameters") or {}),
                               bool(t["function"].get("strict"))) for t in tools or ())
    mode = "auto" if forced is None else forced.mode
    try:
        return OutputGrammar(schemas, mode, forced.name if forced is not None else None, parallel,
                             None if content_schema is None else json.dumps(content_schema))
    except ValueError as e:
        raise invalid(str(e), "tool_choice") from None
