"""Grammar-constrained output for K3 turns: the output structure, tool-call arguments and JSON
content, as a per-row token bitmask from llguidance.

``OutputGrammar`` says what a request's reply must look like (its tools with their argument
schemas, the tool choice, whether calls may come in parallel, a JSON schema for the content).
``k3_lark`` writes it as one Lark grammar over the K3 output (chat_format.md §3):

    [REASONING <|close|>think<|sep|> <|open|>response<|sep|>] CONTENT <|close|>response<|sep|>
    [<|open|>tools<|sep|> CALL… <|close|>tools<|sep|>] <|close|>message<|sep|> <|end_of_msg|>

(the bracketed head only when the prompt opened the think channel). Markers are special ids,
never text, so a reply cannot forge or lose one. A CALL is
``<|open|>call tool="NAME" index="i"<|sep|>`` (a declared name, i = 1, 2, … in order) and its
typed ``argument`` blocks:

- **strict** tools (OpenAI ``function.strict``, Anthropic ``strict``): one block per property
  of the schema, in the schema's order, the required ones always; each block's ``type`` one the
  property admits, its value raw text for ``string`` (an ``enum`` / ``const`` of strings: one of
  them) and JSON valid against the property's schema for the other types (nested objects,
  arrays, enums, numbers, required keys: llguidance's JSON schema support). A call's arguments
  then always parse and validate. A raw string's ``pattern``, ``format`` and lengths are not
  constrained (the value is raw text, not JSON).
- other tools: any keys, each block's value raw text (``string``) or JSON of its declared type,
  so the call always parses.

``response_format`` puts JSON in the content channel: ``{"type": "object"}`` for
``json_object``, the given schema for ``json_schema``. Under a ``required`` or ``named`` tool
choice the tools channel must come, one call only when calls may not come in parallel, and the
content is empty (the reply is the call, as a forced call's is in the OpenAI API).

Why llguidance (not xgrammar, the other well-kept choice): its Python wheel has no
dependencies (xgrammar 0.2.9 requires torch, transformers and triton), it takes Lark with
special tokens and inline JSON schemas (``%json``) in one grammar, which is what a K3 turn is,
and it fills a batch's bitmasks on its own threads with the GIL released
(``fill_next_token_bitmask_par``); its mask for the embedded model's 2,304-id vocabulary takes
microseconds (benchmarks/grammar.py).

``GrammarCompiler`` (one per tokenizer) compiles a grammar once (its template matcher is kept
by its Lark text) and gives each row a copy (``RowGrammar``); the scheduler fills every
grammar row's bitmask while the device runs the step's forward pass.

**Closing.** A grammar says what may come, not when to stop: a model that rambles inside a raw
string argument would reach ``max_new_tokens`` with its call open, and the call would be cut.
So in a row's last ``closing_reserve(max_new_tokens, room)`` tokens (``CLOSING_MARGIN`` plus the
longest call or JSON content closing can still write, every declared property at its shortest
value: ``reply_room(every=True)``; all of them when the budget is that short) the mask is
narrowed to the ids that close what is open (``closing_ids``), in tiers, the first that leaves
something: ``<|close|>``, ``<|sep|>`` and ``<|end_of_msg|>`` (a channel, block or message);
inside a JSON value, where no marker may come, text made only of ``}`` and ``]``, or of ``"``,
``}`` and ``]`` starting with a quote (the quotes first inside a string, which may hold brackets
too); text made only of ``,`` and blanks (after a number, when a required key is still to come:
the grammar then forces the key). Where the grammar requires something else (a required
argument, a JSON value, a declared name) the model chooses within the grammar as before, and
forced stretches (a marker's name) follow from the grammar alone. The reply then ends
well-formed, its arguments complete.

The same closing keeps a forced tool choice's room: the grammar holds the choice (a required or
named call cannot be left out, the tools channel cannot be opened under "none"), and from the
reasoning closing takes the way into the call (close the reasoning, open and close the
response, open the tools channel, the header) within ``CLOSING_MARGIN``. So a grammar row needs
no tool-choice forcer beside it (``_forcing`` serves rows without one).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..chat import escape_attr, k3_last_channel
from ._logits import bitmask_words, pack_mask

MAX_CALLS = 16  # calls one reply may make (index="1" … "16")
# JSON values are written as the renderer writes them (`json.dumps` defaults, chat_format.md
# §2.3), which is what the model saw; flexible whitespace would also let a model pad a value
# with blanks until its budget runs out.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CLOSING_MARGIN = 64  # closing tokens beyond the shortest reply's (the way out of the reasoning, the tail)
ARGUMENT_TYPES = ("string", "number", "boolean", "null", "object", "array")
_JSON_TYPES = {"integer": "number", **{t: t for t in ARGUMENT_TYPES}}


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile; the message names the tool or field."""


@dataclasses.dataclass(frozen=True)
class ToolSchema:
    """One declared tool: its name, its parameters' JSON schema (as JSON text) and strictness."""

    name: str
    parameters: str = "{}"
    strict: bool = False


@dataclasses.dataclass(frozen=True)
class OutputGrammar:
    """What a K3 reply may be (module docstring).

    tools           the declared tools.
    tool_choice     "auto" (calls optional), "required" (at least one), "named" (calls to
                    `name` only, at least one) or "none" (no tools channel).
    name            the forced tool of "named".
    parallel        several calls in one reply (else one at most).
    content_schema  JSON schema (as JSON text) of the content channel, or None (free text).
    """

    tools: tuple[ToolSchema, ...] = ()
    tool_choice: str = "auto"
    name: str | None = None
    parallel: bool = True
    content_schema: str | None = None

    def __post_init__(self):
        if self.tool_choice not in ("auto", "required", "named", "none"):
            raise ValueError(f"tool_choice {self.tool_choice!r}: expected auto, required, named or none")
        if self.tool_choice == "named" and self.name not in {t.name for t in self.tools}:
            raise ValueError(f"tool_choice names {self.name!r}, which is not a declared tool")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs at least one declared tool")


# ---- the Lark grammar -------------------------------------------------------------------
def _lit(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def _marker(name: str, closing: bool = False) -> str:
    return f'{"<|close|>" if closing else "<|open|>"} {_lit(name)} <|sep|>'


def _types_of(schema: Any) -> list[str]:
    """The `argument` block types a property's value may have (``ARGUMENT_TYPES`` order)."""
    if not isinstance(schema, Mapping):
        return list(ARGUMENT_TYPES) if schema is True else []
    kinds: set[str] = set()
    if "type" in schema:
        declared = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        kinds = {_JSON_TYPES[t] for t in declared if t in _JSON_TYPES}
    elif "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        kinds = {_value_type(v) for v in values}
    elif any(k in schema for k in ("anyOf", "oneOf")):
        for branch in schema.get("anyOf", schema.get("oneOf")):
            kinds |= set(_types_of(branch))
    elif "properties" in schema:
        kinds = {"object"}
    elif "items" in schema:
        kinds = {"array"}
    else:  # no constraint on the type
        kinds = set(ARGUMENT_TYPES)
    return [t for t in ARGUMENT_TYPES if t in kinds]


def _value_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "string")


def _strings_of(schema: Any) -> list[str] | None:
    """The strings a property's ``string`` value must be one of, or None (any text)."""
    if not isinstance(schema, Mapping):
        return None
    if "const" in schema:
        return [schema["const"]] if isinstance(schema["const"], str) else []
    if "enum" in schema:
        return [v for v in schema["enum"] if isinstance(v, str)]
    branches = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(branches, list):
        out: list[str] = []
        for b in branches:
            if "string" in _types_of(b):
                sub = _strings_of(b)
                if sub is None:
                    return None
                out += sub
        return out
    return None


def _typed_schema(schema: Any, kind: str, defs: Mapping[str, Any]) -> dict:
    """`schema` narrowed to values of block type `kind`, with the root's definitions."""
    base = dict(schema) if isinstance(schema, Mapping) else {}
    json_types = ["integer", "number"] if kind == "number" else [kind]
    if isinstance(base.get("type"), list):
        base["type"] = [t for t in base["type"] if t in json_types] or json_types
        if len(base["type"]) == 1:
            base["type"] = base["type"][0]
    elif "type" not in base:
        if "enum" in base or "const" in base:
            values = [base.pop("const")] if "const" in base else base.pop("enum")
            base["enum"] = [v for v in values if _value_type(v) == kind]
        elif any(k in base for k in ("anyOf", "oneOf")):
            key = "anyOf" if "anyOf" in base else "oneOf"
            base[key] = [b for b in base[key] if kind in _types_of(b)]
        else:
            base["type"] = kind
    base.update({k: v for k, v in defs.items() if k not in base})
    return base


class _Lark:
    """Accumulates the rules of one grammar."""

    def __init__(self):
        self.rules: list[str] = []
        self._json: dict[str, str] = {}
        self.has_free_arguments = False

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def json(self, schema: Mapping[str, Any]) -> str:
        """A rule for one JSON value valid against `schema` (shared between equal schemas)."""
        # (keys in their given order: llguidance takes an object's properties in the order listed)
        text = json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)
        if text not in self._json:
            self._json[text] = self.rule(f"json_{len(self._json)}", f"%json {text}")
        return self._json[text]

    def text(self) -> str:
        return "\n".join(self.rules) + "\n"


def _argument(g: _Lark, key: str, kind: str, value: str) -> str:
    head = _lit(f'argument key="{escape_attr(key)}" type="{kind}"')
    return f'<|open|> {head} <|sep|> {value} {_marker("argument", True)}'


def _strict_arguments(g: _Lark, rule: str, tool: ToolSchema) -> str:
    schema = json.loads(tool.parameters)
    if not isinstance(schema, Mapping):
        raise GrammarError(f"tool {tool.name!r}: parameters must be a JSON schema object")
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    missing = sorted(required - set(props))
    if missing:
        raise GrammarError(f"tool {tool.name!r}: required {missing} are not among its properties")
    parts = []
    for i, (key, sub) in enumerate(props.items()):
        alternatives = []
        for kind in _types_of(sub):
            if kind == "string":
                strings = _strings_of(sub)
                value = "TEXT?" if strings is None else "(" + " | ".join(_lit(s) for s in strings) + ")"
                if strings == []:
                    continue
            else:
                value = g.json(_typed_schema(sub, kind, defs))
            alternatives.append(_argument(g, key, kind, value))
        if not alternatives:
            raise GrammarError(f"tool {tool.name!r}: property {key!r} admits no value")
        block = g.rule(f"{rule}_{i}", " | ".join(alternatives))
        parts.append(block if key in required else f"{block}?")
    return g.rule(rule, " ".join(parts) if parts else '""')


def _free_arguments(g: _Lark) -> str:
    """Any keys; each value raw text (``string``) or JSON of its block type."""
    if not g.has_free_arguments:
        g.has_free_arguments = True
        blocks = [f'{_lit("string")} "\\"" <|sep|> TEXT? {_marker("argument", True)}']
        for kind in ARGUMENT_TYPES[1:]:
            value = g.json({"type": kind})
            blocks.append(f'{_lit(kind)} "\\"" <|sep|> {value} {_marker("argument", True)}')
        g.rule("free_arg", f'<|open|> "argument key=\\"" ATTR "\\" type=\\"" ({" | ".join(blocks)})')
        g.rule("free_args", "free_arg*")
    return "free_args"


def k3_lark(grammar: OutputGrammar, thinking: bool) -> str:
    """The Lark grammar of a K3 reply (module docstring); `thinking`: the prompt opened the
    think channel, so the reply starts with reasoning."""
    g = _Lark()
    head = f'TEXT? {_marker("think", True)} {_marker("response")} ' if thinking else ""
    if grammar.content_schema is None:  # a forced call's reply is the call: no text beside it
        content = "" if grammar.tool_choice in ("required", "named") else "TEXT?"
    else:
        try:
            content = g.json(json.loads(grammar.content_schema))
        except json.JSONDecodeError as e:
            raise GrammarError(f"response_format schema is not JSON: {e}") from None
    tools = "" if grammar.tool_choice == "none" or not grammar.tools else "tools"
    if tools:
        callable_tools = [t for t in grammar.tools if grammar.tool_choice != "named" or t.name == grammar.name]
        args = {}
        for i, t in enumerate(callable_tools):
            args[t.name] = _strict_arguments(g, f"args_{i}", t) if t.strict else _free_arguments(g)
        calls = MAX_CALLS if grammar.parallel else 1
        for k in range(1, calls + 1):
            heads = [f'{_lit(f"call tool=\"{escape_attr(name)}\" index=\"{k}\"")} <|sep|> {rule}'
                     for name, rule in args.items()]
            g.rule(f"call_{k}", f'<|open|> ({" | ".join(heads)}) {_marker("call", True)}')
            g.rule(f"calls_{k}", f"call_{k} calls_{k + 1}?" if k < calls else f"call_{k}")
        g.rule("tools", f'{_marker("tools")} calls_1 {_marker("tools", True)}')
        if grammar.tool_choice == "auto":
            tools = "tools?"
    end = f'{_marker("message", True)} <|end_of_msg|>'
    g.rules.insert(0, f'start: {head}{content} {_marker("response", True)} {tools} {end}')
    g.rules += [r"TEXT: /(.|\n)+/", r'ATTR: /([^"&]|&quot;|&amp;)*/']
    return g.text()


def prompt_thinking(tokenizer, prompt: Sequence[int]) -> bool:
    """Whether a K3 prompt's reply starts in the think channel (True) or the response channel
    (False); a ``ValueError`` for a prompt that ends in no generation prompt."""
    last = k3_last_channel(tokenizer.decode_segments(prompt))
    if last not in ("open_think", "open_response"):
        raise ValueError("a grammar-constrained reply needs a K3 chat prompt that ends in the assistant's "
                         "generation prompt (<|open|>think<|sep|> or <|open|>response<|sep|>)")
    return last == "open_think"


# ---- matching ---------------------------------------------------------------------------
def closing_reserve(max_new_tokens: int, room: int = 0) -> int:
    """How many last tokens of a row are spent closing: ``CLOSING_MARGIN`` + `room` (the
    longest reply closing can still write, ``reply_room(every=True)``); all of them when that
    is more (a budget that barely holds it is spent on a short reply)."""
    return min(CLOSING_MARGIN + room, max_new_tokens)


def _minimal_value(schema: Any, defs: Mapping[str, Any], every: bool = False) -> tuple[str, Any]:
    """(block type, value) of the shortest value a property's schema admits, as the grammar
    would write it (its first admissible type; a bound where one applies); `every`: with every
    declared property of an object, not only the required ones."""
    if isinstance(schema, Mapping) and "$ref" in schema:
        ref = schema["$ref"].split("/")[-1]
        schema = {**defs.get("$defs", {}), **defs.get("definitions", {})}.get(ref, {})
    kinds = _types_of(schema) or ["null"]
    kind = kinds[0]
    schema = schema if isinstance(schema, Mapping) else {}
    if kind == "string":
        strings = _strings_of(schema)
        return kind, min(strings, key=len) if strings else ""
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else [v for v in schema["enum"] if _value_type(v) == kind]
        return kind, min(values, key=lambda v: len(json.dumps(v)))
    if kind == "number":
        if "minimum" in schema:
            return kind, schema["minimum"]
        return kind, schema["exclusiveMinimum"] + 1 if "exclusiveMinimum" in schema else 0
    if kind == "boolean":
        return kind, False
    if kind == "array":
        return kind, [_minimal_value(schema.get("items", {}), defs, every)[1] for _ in range(schema.get("minItems", 0))]
    if kind == "object":
        props = schema.get("properties") or {}
        keys = list(props) if every else schema.get("required") or ()
        return kind, {k: _minimal_value(props.get(k, {}), defs, every)[1] for k in keys}
    return kind, None


def reply_room(tokenizer, grammar: OutputGrammar, every: bool = False) -> int:
    """Tokens of the grammar's shortest content or call arguments (the longest of them over its
    tools): what a call needs at least. `every`: with every declared property at its shortest
    value, the longest reply closing can still write (closing ends each value at once, but where
    a property may begin, the model may pick an optional one)."""
    from ..chat import Segment, close_tag, open_tag

    room = 0
    if grammar.content_schema is not None:
        value = _minimal_value(json.loads(grammar.content_schema), {}, every)[1]
        room = len(tokenizer.encode_ordinary(json.dumps(value, ensure_ascii=False)))
    for tool in grammar.tools if grammar.tool_choice != "none" else ():
        if not tool.strict:
            continue
        schema = json.loads(tool.parameters)
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        props = schema.get("properties") or {}
        segments = []
        for key in list(props) if every else schema.get("required") or ():
            kind, value = _minimal_value(props.get(key, {}), defs, every)
            text = value if kind == "string" else json.dumps(value, ensure_ascii=False)
            segments += open_tag("argument", [("key", key), ("type", kind)]) + [Segment(text, False)]
            segments += close_tag("argument")
        room = max(room, len(tokenizer.encode_segments(segments)))
    if every and grammar.tool_choice in ("required", "named"):  # the markup CLOSING_MARGIN does not cover
        room += max(0, _forced_call_markup(tokenizer, grammar) - CLOSING_MARGIN)
    return room


def _forced_call_markup(tokenizer, grammar: OutputGrammar) -> int:
    """Tokens of the markup a required or named call adds to its arguments when closing starts
    in the reasoning: the way out of it into the tools channel, the longest call header, and the
    tail that ends the turn. ``CLOSING_MARGIN`` holds it for a tokenizer with the K3 specials;
    a byte-level one spends a token per character of it, and closing then starts earlier."""
    from ..chat import Segment, close_tag, escape_attr, open_tag

    way_in = close_tag("think") + open_tag("response") + close_tag("response") + open_tag("tools")
    tail = close_tag("call") + close_tag("tools") + close_tag("message") + [Segment("<|end_of_msg|>", True)]
    names = [grammar.name] if grammar.tool_choice == "named" else [t.name for t in grammar.tools]
    header = max(len(tokenizer.encode_segments(open_tag("call", [("tool", escape_attr(n)), ("index", "1")])))
                 for n in names)
    return len(tokenizer.encode_segments(way_in + tail)) + header


def closing_ids(tokenizer) -> dict[str, np.ndarray]:
    """The ids that close what a K3 reply has open (module docstring, "Closing"), ascending, by
    kind: "markers" (``<|close|>``, ``<|sep|>``, ``<|end_of_msg|>``), "quotes" (text of ``"``,
    ``}`` and ``]`` that starts with ``"``: ends a JSON string), "brackets" (text of ``}`` and
    ``]``), "separators" (text of ``,`` and blanks)."""
    names = ("<|close|>", "<|sep|>", "<|end_of_msg|>")
    tiers: dict[str, list[int]] = {"markers": sorted(tokenizer.special_id(n) for n in names
                                                     if n in tokenizer.special_tokens),
                                   "quotes": [], "brackets": [], "separators": []}
    for i in range(tokenizer.vocab_size):
        if tokenizer.is_special(i):
            continue
        try:
            text = tokenizer.token_bytes(i)
        except (ValueError, KeyError):
            continue
        if text and not text.strip(b'"}]'):
            tiers["quotes" if text.startswith(b'"') else "brackets"].append(i)
        elif text and not text.strip(b", "):
            tiers["separators"].append(i)
    return {kind: np.asarray(ids, np.int64) for kind, ids in tiers.items()}


class RowGrammar:
    """One row's matcher: ``fill`` its next-token bitmask, ``push`` each generated id."""

    def __init__(self, matcher, max_new_tokens: int, room: int = 0):
        self.matcher = matcher
        self.closing_from = max_new_tokens - closing_reserve(max_new_tokens, room)  # generated ids before closing
        self.generated = 0
        self.broken = False  # an id the grammar refused was forced in (the row runs on unconstrained)

    @property
    def closing(self) -> bool:
        return self.generated >= self.closing_from

    def push(self, token: int) -> None:
        self.generated += 1
        if not self.broken and not self.matcher.consume_token(int(token)):
            self.broken = True


class GrammarCompiler:
    """llguidance for one tokenizer: its token table (built once) and the compiled grammars,
    kept by their Lark text (``max_grammars`` at most, least recently used dropped)."""

    def __init__(self, tokenizer, max_grammars: int = 256):
        import llguidance

        self._llg = llguidance
        self.tokenizer = tokenizer
        self.words = bitmask_words(tokenizer.vocab_size)
        self.ll_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer)),
                                                   n_vocab=tokenizer.vocab_size)
        self.executor = llguidance.LLExecutor()
        self.closing_tiers = {}
        for kind, ids in closing_ids(tokenizer).items():
            tier = np.zeros((1, tokenizer.vocab_size), bool)
            tier[0, ids] = True
            self.closing_tiers[kind] = pack_mask(tier)[0]
        # A letter no JSON literal starts with: where the grammar allows it, the row is inside
        # a string (JSON or raw text), and a quote ends it sooner than brackets, which a string
        # may also hold.
        letter = tokenizer.encode_ordinary("x")
        self._inside_probe = letter[0] if len(letter) == 1 else None
        # Lark text -> (template matcher, reply_room, reply_room(every=True))
        self._templates: collections.OrderedDict[str, tuple[Any, int, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.max_grammars = max_grammars

    def compile(self, grammar: OutputGrammar, prompt: Sequence[int]) -> str:
        """The Lark text of `grammar` after `prompt`, compiled and kept; a ``GrammarError``
        naming what llguidance refused."""
        lark = k3_lark(grammar, prompt_thinking(self.tokenizer, prompt))
        with self._lock:
            if lark in self._templates:
                self._templates.move_to_end(lark)
                return lark
        matcher = self._llg.LLMatcher(self.ll_tokenizer, self._llg.LLMatcher.grammar_from_lark(lark), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the tools' or response_format's schema cannot be compiled: {matcher.get_error()}")
        with self._lock:
            self._templates[lark] = matcher, reply_room(self.tokenizer, grammar), reply_room(
                self.tokenizer, grammar, every=True)
            while len(self._templates) > self.max_grammars:
                self._templates.popitem(last=False)
        return lark

    def row(self, grammar: OutputGrammar, prompt: Sequence[int], max_new_tokens: int) -> RowGrammar:
        """A fresh matcher for one row of `max_new_tokens` at most (compiling the grammar if
        it is not kept)."""
        lark = self.compile(grammar, prompt)
        with self._lock:
            template = self._templates.get(lark)
        if template is None:  # dropped by another thread's compile meanwhile
            self.compile(grammar, prompt)
            return self.row(grammar, prompt, max_new_tokens)
        matcher, _, closing_room = template
        return RowGrammar(matcher.deep_copy(), max_new_tokens, closing_room)

    def room(self, grammar: OutputGrammar, prompt: Sequence[int]) -> int:
        """``reply_room`` of a grammar (compiling it if it is not kept)."""
        lark = self.compile(grammar, prompt)
        with self._lock:
            template = self._templates.get(lark)
        return reply_room(self.tokenizer, grammar) if template is None else template[1]

    def fill(self, rows: Sequence[tuple[int, RowGrammar]], bitmask: np.ndarray) -> None:
        """Row i of `bitmask` (`[B, W]` int32, C-contiguous) := the next-token mask of each
        (i, grammar), on llguidance's threads, narrowed for a closing row to the first closing
        tier that leaves an id; the other rows are left as they are."""
        live = [(g.matcher, i) for i, g in rows if not g.broken]
        if not live:
            return
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, live, bitmask)
        for i, g in rows:
            if g.closing and not g.broken:
                probe = self._inside_probe
                inside = probe is not None and (bitmask[i, probe >> 5] >> (probe & 31)) & 1
                order = ("markers", "quotes", "brackets", "separators") if inside else (
                    "markers", "brackets", "quotes", "separators")
                for kind in order:
                    narrowed = bitmask[i] & self.closing_tiers[kind]
                    if narrowed.any():
                        bitmask[i] = narrowed
                        break


class _TokenTable:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer: each id's bytes (a special
    id's name, which llguidance marks as special so text cannot produce it), the special ids,
    eos, and a text encoder."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.end_of_msg_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_tokens.values())
        self.tokens = [self._bytes(i) for i in range(tokenizer.vocab_size)]

    def _bytes(self, i: int) -> bytes:
        try:
            return self._tokenizer.token_bytes(i)
        except (ValueError, KeyError):  # an id with no bytes (reserved between ranks and specials)
            return b""

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode_ordinary(text)
