"""Forced tool choice for the K3 output grammar (chat_format.md §3 "Forced tool choice").

``tool_choice`` = required / a named function is honoured by constraining decoding, not by
hoping: a per-row host state machine (like the thinking budget) says, before each step, which
id must come next (``force``), which ids alone may come next (``allowed``: the tool-name trie)
and which may not (``banned``: the stop ids, so the turn cannot end before its call).

- **Waiting** (thinking): the model reasons freely. When it closes the think channel (or opens
  the response / tools channel itself), the rest of the way into a call is forced: the
  response channel is opened and closed empty, then ``<|open|>tools<|sep|>`` and the call
  header. If the token budget runs low first, the whole chain is forced from the think channel.
  With thinking off the prompt already opened the response channel: forcing starts at once.
- **Call header**: named → the whole ``<|open|>call tool="NAME" index="1"<|sep|>``;
  required → ``<|open|>call tool="``, then the name restricted to the declared names (a trie of
  their token ids, each encoded as the renderer encodes an attribute value), then the rest.
- **Arguments**: free, stop ids banned, until the model closes the call; if the budget is about
  to run out, ``<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>``
  is forced so the call always completes (``cut``: its arguments may then be incomplete).
- **After the call**: one forced call ends the turn: the tools channel and the message are
  closed at once (otherwise the model writes on to ``max_new_tokens`` after its call).
  ``min_new_tokens`` is the room the way in, the longest header and the tail take: with less,
  no call can complete.
- ``tool_choice="none"``: once the response channel closes, the message is closed and ended
  (the tools channel is never opened); a server also drops any call from the parse.

Under a grammar (``Request.grammar``, ``_grammar``) no forcer runs: the scheduler gives the
grammar the tool choice, and the grammar's closing tiers keep the room the call needs. This
state machine serves rows without a grammar (``k31jax serve --no-grammar``, requests without one).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from ..chat import Segment, close_tag, escape_attr, open_tag

TOOL_CHOICE_MODES = ("none", "required", "named")


def _ends_with(ids: Sequence[int], seq: Sequence[int]) -> bool:
    return len(ids) >= len(seq) > 0 and list(ids[len(ids) - len(seq):]) == list(seq)


def _begun(ids: Sequence[int], seq: Sequence[int]) -> int:
    """How many ids of `seq` the end of `ids` has already written (the longest suffix of `ids`
    that is a proper prefix of `seq`): a marker the model (or its grammar) has begun."""
    for k in range(min(len(seq) - 1, len(ids)), 0, -1):
        if list(ids[len(ids) - k:]) == list(seq[:k]):
            return k
    return 0


class ToolChoiceForcer:
    """Per-row state: call ``constraint()`` before a step, ``push(id)`` after it."""

    def __init__(self, tokenizer, mode: str, *, tool_names: Sequence[str] = (), name: str | None = None,
                 prompt_ids: Sequence[int] = (), max_new_tokens: int, args_room: int = 0):
        if mode not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool choice mode {mode!r}: expected one of {TOOL_CHOICE_MODES}")
        if mode == "named" and not name:
            raise ValueError("a named tool choice needs the function name")
        if mode == "required" and not tool_names:
            raise ValueError("tool_choice 'required' needs at least one declared tool")
        enc = lambda segs: list(tokenizer.encode_segments(segs))  # noqa: E731
        self.mode, self.max_new = mode, max_new_tokens
        self.args_room = args_room  # a grammar's shortest arguments (`_grammar.reply_room`), for `min_new_tokens`
        self.close_think, self.open_response = enc(close_tag("think")), enc(open_tag("response"))
        self.close_response, self.open_tools = enc(close_tag("response")), enc(open_tag("tools"))
        self.close_call = enc(close_tag("call"))
        end = [Segment("<|end_of_msg|>", True)]
        self.end_message = enc(close_tag("message") + end)
        self.tail = self.close_call + enc(close_tag("tools")) + self.end_message
        self.stop_ids = sorted(tokenizer.stop_ids)
        header = open_tag("call", [("tool", "\0"), ("index", "1")])
        cut = next(i for i, s in enumerate(header) if s.text == "\0")
        self.header_head, self.header_rest = enc(header[:cut]), enc(header[cut + 1:])
        if mode == "named":
            self.header_head = self.header_head + enc([Segment(escape_attr(name), False)]) + self.header_rest
        self.trie = self._trie(tokenizer, tool_names) if mode == "required" else None
        self.generated: list[int] = []
        self.queue: collections.deque[int] = collections.deque()
        self.phase = "wait"
        self._after_queue = "wait"
        self._node = None
        self.cut = False  # the budget closed the call inside its arguments
        opens_response = _ends_with(prompt_ids, self.open_response)
        way_in = (self.close_response + self.open_tools if opens_response else
                  self.close_think + self.open_response + self.close_response + self.open_tools)
        longest_name = max((len(tokenizer.encode_segments([Segment(escape_attr(n), False)])) for n in tool_names),
                           default=0)
        self.min_new_tokens = 0 if mode == "none" else len(way_in) + len(self.header_head) + len(self.tail) + (
            0 if mode == "named" else longest_name + len(self.header_rest)) + args_room
        if mode != "none" and opens_response:
            self._enter_tools(self.close_response + self.open_tools)
        self._check_budget()

    @staticmethod
    def _trie(tokenizer, names):
        root: dict = {}
        for n in names:
            node = root
            for t in tokenizer.encode_segments([Segment(escape_attr(n), False)]):
                node = node.setdefault(t, {})
            node[None] = True  # a complete name
        return root

    # ---- transitions --------------------------------------------------------------------
    def _enter_tools(self, prefix: list[int]) -> None:
        self.queue.extend(prefix + self.header_head)
        self._after_queue = "call" if self.mode == "named" else "name"
        self.phase = "forcing"

    def _check_budget(self) -> None:
        """Reserve room for the call: force the way in (or the tail) when the budget is short."""
        remaining = self.max_new - len(self.generated) - len(self.queue)
        if self.mode == "none" or self.queue:
            return
        if self.phase == "wait":
            chain = self.close_think + self.open_response + self.close_response + self.open_tools
            need = len(chain) + len(self.header_head) + len(self.header_rest) + len(self.tail) + 8 + self.args_room
            if remaining <= need:  # (the rest of a marker the model has begun, not a second one)
                self._enter_tools(chain[_begun(self.generated, chain):])
        elif self.phase == "call" and remaining <= len(self.tail):
            self.queue.extend(self.tail[_begun(self.generated, self.tail):])
            self._after_queue = "free"
            self.phase = "forcing"
            self.cut = True

    def constraint(self) -> tuple[int, list[int] | None, list[int]]:
        """(id to force or -1, allowed next ids or None, banned next ids)."""
        if self.queue:
            return self.queue[0], None, []
        if self.phase == "name":
            allowed = [t for t in self._node if t is not None]
            if None in self._node:
                allowed.append(self.header_rest[0])
            return -1, allowed, []
        if self.mode != "none" and self.phase in ("wait", "call"):
            return -1, None, self.stop_ids
        return -1, None, []

    def push(self, token: int) -> None:
        self.generated.append(token)
        ids = self.generated
        if self.queue:
            if token == self.queue[0]:
                self.queue.popleft()
            else:  # another constraint (the thinking budget) won this step: re-plan
                self.queue.clear()
            if not self.queue:
                self.phase = self._after_queue
                if self.phase == "name":
                    self._node = self.trie
        elif self.phase == "wait" and self.mode == "none":
            if _ends_with(ids, self.close_response):
                self.queue.extend(self.end_message)
                self.phase, self._after_queue = "forcing", "free"
            elif _ends_with(ids, self.open_tools):
                self.queue.extend(self.tail[len(self.close_call):])  # close tools at once, empty
                self.phase, self._after_queue = "forcing", "free"
        elif self.phase == "wait":
            if _ends_with(ids, self.close_think):
                self._enter_tools(self.open_response + self.close_response + self.open_tools)
            elif _ends_with(ids, self.open_response):
                self._enter_tools(self.close_response + self.open_tools)
            elif _ends_with(ids, self.close_response):
                self._enter_tools(self.open_tools)
            elif _ends_with(ids, self.open_tools):
                self._enter_tools([])
        elif self.phase == "name":
            if token in self._node:
                self._node = self._node[token]
            else:  # the closing quote of a complete name
                self.queue.extend(self.header_rest[1:])
                self._after_queue = "call"
                self.phase = "forcing" if self.queue else "call"
        elif self.phase == "call" and _ends_with(ids, self.close_call):
            self.queue.extend(self.tail[len(self.close_call):])  # the one call is made: end the turn
            self.phase, self._after_queue = "forcing", "free"
        self._check_budget()
