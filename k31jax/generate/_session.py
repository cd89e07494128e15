"""A multi-turn K3 chat over an `Engine`: history in OpenAI form, tools, tool results.

Each turn renders the whole history with the K3 chat format (``apply_chat_template``: tool
declarations, thinking effort, tool choice), generates with the streaming parser attached,
and appends the parsed assistant message (``reasoning_content``, ``content``, ``tool_calls``
with minted ids) back to the history unchanged, as the format requires. Tool results are
added with ``add_tool_result(call_id, content)`` and the next ``send()`` (no user text)
lets the model continue.

    session = ChatSession(engine, tools=tools, effort="low")
    for event in session.stream("Weather in Oslo?"):   # ReasoningDelta, ContentDelta, ToolCall*
        ...
    for call in session.pending_tool_calls():
        session.add_tool_result(call["id"], run_tool(call))
    turn = session.send()                               # the answer after the tool results

Images: user content may be a list of parts with OpenAI ``image_url`` / Anthropic ``image``
parts (``add_user``); with a vision model on the engine, each turn renders them as media blocks
and sends the processed images with the request (every turn re-reads the history's images).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..chat import IMAGE_PART_TYPES, ParsedMessage, ParseEvent, apply_chat_template
from ._engine import Engine, GenerationResult
from ._requests import Completion, Request
from ._sampling import SamplingParams


@dataclasses.dataclass
class TurnResult:
    """One assistant turn: the message appended to the history and how it was made."""

    message: dict[str, Any]
    parsed: ParsedMessage
    completion: Completion
    result: GenerationResult

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls") or [])


class ChatSession:
    """Conversation state + generation settings for `engine` (which needs a tokenizer).

    effort            ``"low" | "high" | "max"`` (default ``"max"``) or None for no effort
                      message; ignored when ``thinking`` is False.
    thinking_budget   hard cap on each turn's thinking tokens (earlier turns never count).
    """

    def __init__(self, engine: Engine, *, system: str | None = None, tools: Any = None,
                 effort: str | None = "max", thinking: bool = True, tool_choice: Any = None,
                 params: SamplingParams = SamplingParams(), max_new_tokens: int = 512,
                 thinking_budget: int | None = None, stop: Sequence[str] = ()):
        if engine.tokenizer is None:
            raise ValueError("ChatSession needs an Engine built with a tokenizer")
        self.engine = engine
        self.tools = tools
        self.effort = effort
        self.thinking = thinking
        self.tool_choice = tool_choice
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.thinking_budget = thinking_budget
        self.stop = tuple(stop)
        self.messages: list[dict[str, Any]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.last: TurnResult | None = None

    # ---- history ------------------------------------------------------------------------
    def add_user(self, content: str | list[dict[str, Any]]) -> None:
        """A user message: text, or a list of content parts (text and image parts)."""
        self.messages.append({"role": "user", "content": content})

    def add_tool_result(self, tool_call_id: str, content: Any, *, name: str | None = None) -> None:
        """Answer one tool call of the last assistant message (content: str or JSON-able)."""
        call = next((c for c in self._last_calls() if c["id"] == tool_call_id), None)
        if call is None:
            known = [c["id"] for c in self._last_calls()]
            raise KeyError(f"no tool call {tool_call_id!r} in the last assistant message "
                           f"(its calls: {known})")
        if not isinstance(content, str):
            content = json.dumps(content, ensure_ascii=False)
        self.messages.append({"role": "tool", "tool_call_id": tool_call_id,
                              "name": name or call["function"]["name"], "content": content})

    def pending_tool_calls(self) -> list[dict[str, Any]]:
        """Calls of the last assistant message that have no result yet."""
        answered = {m.get("tool_call_id") for m in self._since_last_assistant() if m["role"] == "tool"}
        return [c for c in self._last_calls() if c["id"] not in answered]

    def _last_assistant_index(self) -> int | None:
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i]["role"] == "assistant":
                return i
        return None

    def _last_calls(self) -> list[dict[str, Any]]:
        i = self._last_assistant_index()
        return [] if i is None else list(self.messages[i].get("tool_calls") or [])

    def _since_last_assistant(self) -> list[Mapping[str, Any]]:
        i = self._last_assistant_index()
        return [] if i is None else self.messages[i + 1:]

    def _has_images(self) -> bool:
        return any(isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES
                   for m in self.messages if isinstance(m.get("content"), list) for part in m["content"])

    def prompt_and_images(self) -> tuple[list[int], tuple]:
        """The rendered prompt of the next assistant turn and its processed images (in prompt
        order; empty without image parts). Image parts need an engine with a vision model."""
        media = self.engine.image_prompts() if self._has_images() else None
        ids = apply_chat_template(self.engine.tokenizer, self.messages, self.tools,
                                  thinking=self.thinking,
                                  thinking_effort=self.effort if self.thinking else None,
                                  tool_choice=self.tool_choice, media_prompt=media)
        return ids, tuple(media.images) if media is not None else ()

    def prompt_ids(self) -> list[int]:
        """The rendered prompt of the next assistant turn."""
        return self.prompt_and_images()[0]

    # ---- turns --------------------------------------------------------------------------
    def stream(self, content: str | None = None, **overrides) -> Iterator[ParseEvent]:
        """Add a user message (if given), generate the assistant turn and yield its parser
        events; the parsed message is appended to the history when the iterator ends.

        overrides: ``params``, ``max_new_tokens``, ``thinking_budget``, ``stop`` for this turn.
        """
        if content is not None:
            self.add_user(content)
        elif not self.messages or self.messages[-1]["role"] == "assistant":
            raise ValueError("nothing to answer: pass user content or add tool results first")
        prompt, images = self.prompt_and_images()
        req = Request(
            prompt, overrides.get("params", self.params),
            overrides.get("max_new_tokens", self.max_new_tokens), None,
            tuple(overrides.get("stop", self.stop)),
            overrides.get("thinking_budget", self.thinking_budget) if self.thinking else None,
            parse=True, chat_format="k3", images=images)
        for delta in self.engine.stream([req]):
            yield from delta.events
        result = self.engine.last_result
        completion = result.completions[0]
        parsed = completion.parsed
        message = parsed.to_openai()
        if message["content"] is None:
            message["content"] = ""  # cut while thinking (finish_reason "length"): no content
        self.messages.append(message)
        self.last = TurnResult(message, parsed, completion, result)

    def send(self, content: str | None = None, **overrides) -> TurnResult:
        """`stream` to the end; returns the turn."""
        for _ in self.stream(content, **overrides):
            pass
        return self.last
