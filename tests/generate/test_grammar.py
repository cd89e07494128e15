"""The K3 output grammar (`k31jax.generate._grammar`) against the chat template: replies the
renderer writes (chat_format.md §2.3) from random strict schemas and random values valid
against them (checked with `jsonschema`) are accepted token by token; replies that break a
schema, the tool choice or the structure are refused; the bitmask of `TokenRules` equals a
NumPy reference. Fast: the embedded model's tokenizer, no model."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from helpers.benchmarks import load_benchmark
from k31jax.chat import apply_chat_template
from k31jax.generate import GrammarError, OutputGrammar, TokenRules, ToolSchema, embedded_model_dir, load_tokenizer
from k31jax.generate._grammar import GrammarCompiler, _minimal_value, closing_ids, k3_lark, reply_room
from k31jax.generate._logits import pack_mask

bench = load_benchmark("grammar")

TOK = load_tokenizer(embedded_model_dir(), 2304)
USER = [{"role": "user", "content": "Do it."}]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOK)


def random_value(rng: random.Random, schema: dict):
    """A value valid against one of `benchmarks/grammar.py`'s random schemas."""
    kind = schema["type"]
    if isinstance(kind, list):
        kind = rng.choice(kind)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if kind == "string":
        return rng.choice(["", "Oslo", "a \"quoted\" {value}", "zwei Wörter", "line\nbreak"])
    if kind == "integer":
        return rng.randint(schema.get("minimum", -9), schema.get("maximum", 99))
    if kind == "number":
        return rng.choice([0, 1.5, 1e-3, 12345.25])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        n = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
        return [random_value(rng, schema["items"]) for _ in range(n)]
    keys = [k for k in schema["properties"] if k in schema["required"] or rng.random() < 0.5]
    return {k: random_value(rng, schema["properties"][k]) for k in keys}


def reply_ids(tools, calls, *, thinking: bool, content: str = "", reasoning: str = "Let me see."):
    """The renderer's tokens of an assistant reply (after its generation prompt) and that prompt."""
    specs = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in tools]
    prompt = apply_chat_template(TOK, USER, specs, thinking=thinking)
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning if thinking else None,
               "tool_calls": [{"id": f"call_{i}", "type": "function",
                               "function": {"name": n, "arguments": json.dumps(a)}} for i, (n, a) in enumerate(calls)]}
    full = apply_chat_template(TOK, USER + [message], specs, thinking=thinking, add_generation_prompt=False)
    assert full[:len(prompt)] == prompt
    return prompt, full[len(prompt):]


def accepts(compiler, grammar: OutputGrammar, prompt, ids) -> bool:
    row = compiler.row(grammar, prompt, max_new_tokens=10 * len(ids))
    bitmask = np.empty((1, compiler.words), np.int32)
    for t in ids:
        compiler.fill([(0, row)], bitmask)
        if not (bitmask[0, t >> 5] >> (t & 31)) & 1:
            return False
        row.push(t)
    return not row.broken and row.matcher.is_accepting()


def strict(tools) -> tuple[ToolSchema, ...]:
    return tuple(ToolSchema(n, json.dumps(s), True) for n, s in tools)


@pytest.mark.parametrize("seed", range(12))
def test_rendered_calls_with_random_valid_arguments_are_accepted(compiler, seed):
    rng = random.Random(seed)
    tools = bench.random_tools(rng)
    calls = []
    for _ in range(rng.randint(1, 3)):
        name, schema = rng.choice(tools)
        args = random_value(rng, schema)
        jsonschema.validate(args, schema)  # the generator's own check
        calls.append((name, args))
    thinking = seed % 2 == 0
    content = "" if seed % 3 else "Calling."
    prompt, ids = reply_ids(tools, calls, thinking=thinking, content=content)
    assert accepts(compiler, OutputGrammar(strict(tools), "required"), prompt, ids) == (not content)  # the call alone
    assert accepts(compiler, OutputGrammar(strict(tools), "auto"), prompt, ids)
    assert accepts(compiler, OutputGrammar(strict(tools), "auto", parallel=False), prompt, ids) == (len(calls) == 1)
    assert not accepts(compiler, OutputGrammar(strict(tools), "none"), prompt, ids)
    other = next((n for n, _ in tools if n != calls[0][0]), None)
    if other is not None:
        assert not accepts(compiler, OutputGrammar(strict(tools), "named", other), prompt, ids)


SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
    "days": {"type": "array", "items": {"type": "integer", "minimum": 1}, "maxItems": 2},
    "opts": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
             "additionalProperties": False}},
    "required": ["city", "opts"], "additionalProperties": False}
TOOLS = [("get_weather", SCHEMA)]


@pytest.mark.parametrize("args, ok", [
    ({"city": "Oslo", "opts": {"a": True}}, True),
    ({"city": "Oslo", "unit": "f", "days": [1, 2], "opts": {"a": False}}, True),
    ({"city": "Oslo"}, False),  # a required key missing
    ({"city": "Oslo", "unit": "k", "opts": {"a": True}}, False),  # not in the enum
    ({"city": "Oslo", "days": [0], "opts": {"a": True}}, False),  # below the minimum
    ({"city": "Oslo", "days": [1, 2, 3], "opts": {"a": True}}, False),  # too many items
    ({"city": "Oslo", "opts": {"a": 1}}, False),  # a nested type
    ({"city": "Oslo", "opts": {"a": True, "b": 1}}, False),  # a nested additional property
    ({"city": "Oslo", "opts": {"a": True}, "extra": 1}, False),  # an additional argument
    ({"opts": {"a": True}, "city": "Oslo"}, False),  # the schema's order
    ({"city": 3, "opts": {"a": True}}, False),  # a number where a string is declared
])
def test_strict_arguments_are_held_to_their_schema(compiler, args, ok):
    assert (jsonschema.Draft202012Validator(SCHEMA).is_valid(args) and list(args) == [
        k for k in SCHEMA["properties"] if k in args]) == ok  # the case is what it says
    prompt, ids = reply_ids(TOOLS, [("get_weather", args)], thinking=False)
    assert accepts(compiler, OutputGrammar(strict(TOOLS), "required"), prompt, ids) == ok


def test_loose_tools_take_any_well_formed_arguments_and_calls_are_declared(compiler):
    loose = (ToolSchema("get_weather", json.dumps(SCHEMA), False),)
    prompt, ids = reply_ids(TOOLS, [("get_weather", {"anything": [1, {"x": None}], "s": "t"})], thinking=True)
    assert accepts(compiler, OutputGrammar(loose, "auto"), prompt, ids)
    prompt, ids = reply_ids(TOOLS + [("other", {})], [("other", {})], thinking=True)
    assert not accepts(compiler, OutputGrammar(loose, "auto"), prompt, ids)  # an undeclared tool


def test_tool_choice_and_content(compiler):
    prompt, plain = reply_ids(TOOLS, [], thinking=True, content="Just text.")
    assert accepts(compiler, OutputGrammar(strict(TOOLS), "auto"), prompt, plain)
    assert accepts(compiler, OutputGrammar(strict(TOOLS), "none"), prompt, plain)
    assert not accepts(compiler, OutputGrammar(strict(TOOLS), "required"), prompt, plain)
    value = {"name": "x", "n": [1, 2]}
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "array"}},
              "required": ["name", "n"]}
    prompt, as_json = reply_ids([], [], thinking=False, content=json.dumps(value))
    assert accepts(compiler, OutputGrammar(content_schema=json.dumps(schema)), prompt, as_json)
    assert accepts(compiler, OutputGrammar(content_schema='{"type": "object"}'), prompt, as_json)
    prompt, not_json = reply_ids([], [], thinking=False, content="name: x")
    assert not accepts(compiler, OutputGrammar(content_schema=json.dumps(schema)), prompt, not_json)
    prompt, compact = reply_ids([], [], thinking=False, content=json.dumps(value, separators=(",", ":")))
    assert not accepts(compiler, OutputGrammar(content_schema=json.dumps(schema)), prompt, compact)  # §2.3 style


def test_bad_grammars_are_refused_with_what_is_wrong(compiler):
    prompt = apply_chat_template(TOK, USER, thinking=False)
    bad = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}
    with pytest.raises(GrammarError, match="tool 'f': required \\['b'\\] are not among its properties"):
        compiler.compile(OutputGrammar((ToolSchema("f", json.dumps(bad), True),), "required"), prompt)
    with pytest.raises(ValueError, match="not a declared tool"):
        OutputGrammar(strict(TOOLS), "named", "nope")
    with pytest.raises(ValueError, match="generation prompt"):
        compiler.compile(OutputGrammar(strict(TOOLS)), TOK.encode("def f():"))
    lark = k3_lark(OutputGrammar((ToolSchema('we"ird&', "{}", False),)), thinking=False)
    assert 'call tool=\\"we&quot;ird&amp;\\"' in lark  # names as the renderer escapes attributes


def test_closing_narrows_the_mask_to_what_closes(compiler):
    tiers = closing_ids(TOK)
    assert sorted(TOK.special_name(i) for i in tiers["markers"]) == ["<|close|>", "<|end_of_msg|>", "<|sep|>"]
    assert all(TOK.token_bytes(i).strip(b'"}]') == b"" and TOK.token_bytes(i)[:1] == b'"' for i in tiers["quotes"])
    assert all(TOK.token_bytes(i).strip(b"}]") == b"" for i in tiers["brackets"]) and len(tiers["brackets"]) >= 2
    assert all(TOK.token_bytes(i).strip(b", ") == b"" for i in tiers["separators"])
    assert TOK.encode(",")[0] in tiers["separators"].tolist()
    prompt, ids = reply_ids(TOOLS, [("get_weather", {"city": "Oslo", "opts": {"a": True}})], thinking=False)
    head = ids[:ids.index(TOK.encode("Oslo")[0]) + 1]  # inside the raw string argument
    row = compiler.row(OutputGrammar(strict(TOOLS), "required"), prompt, max_new_tokens=2 * len(head))
    for t in head:
        row.push(t)
    assert row.closing
    bitmask = np.empty((1, compiler.words), np.int32)
    compiler.fill([(0, row)], bitmask)
    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:TOK.vocab_size])
    assert allowed.tolist() == [TOK.special_id("<|close|>")]  # the string can only be closed


@pytest.mark.parametrize("seed", range(6))
def test_the_room_kept_for_closing_is_the_shortest_valid_call(compiler, seed):
    """`reply_room`: the tokens of the shortest arguments the grammar allows, which are valid
    against the schema and, rendered in a call, exactly that many tokens."""
    rng = random.Random(100 + seed)
    (name, schema), = bench.random_tools(rng)[:1]
    args = _minimal_value(schema, {})[1]
    jsonschema.validate(args, schema)
    prompt, ids = reply_ids([(name, schema)], [(name, args)], thinking=False)
    assert accepts(compiler, OutputGrammar(strict([(name, schema)]), "required"), prompt, ids)
    sep, close = TOK.special_id("<|sep|>"), TOK.special_id("<|close|>")
    header_end = [i for i, t in enumerate(ids) if t == sep][2]  # after <|open|>tools<|sep|><|open|>call ...<|sep|>
    call_end = max(i for i, t in enumerate(ids) if t == close and TOK.decode(ids[i:i + 3]).startswith("<|close|>call"))
    assert reply_room(TOK, OutputGrammar(strict([(name, schema)]), "required")) == call_end - header_end - 1


def test_closing_ends_a_json_string_with_a_quote_not_brackets(compiler):
    """Inside a JSON string brackets are text too: closing must pick the quote there."""
    prompt = apply_chat_template(TOK, USER, thinking=False)
    schema = {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}
    grammar = OutputGrammar(content_schema=json.dumps(schema))
    head = TOK.encode('{"k": "abc')
    row = compiler.row(grammar, prompt, max_new_tokens=len(head))  # closing from the first token
    for t in head:
        row.push(t)
    bitmask = np.empty((1, compiler.words), np.int32)
    compiler.fill([(0, row)], bitmask)
    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:TOK.vocab_size])
    assert allowed.size and all(TOK.token_bytes(int(i))[:1] == b'"' for i in allowed)


def test_bitmask_rules_equal_a_numpy_reference():
    rng = np.random.default_rng(0)
    b, v = 3, 77  # a vocabulary that is no multiple of 32
    mask = rng.random((b, v)) < 0.3
    logits = rng.standard_normal((b, v)).astype(np.float32)
    rules = TokenRules.forcing([-1] * b).with_bitmask(pack_mask(mask))
    assert pack_mask(mask).shape == (b, 3)
    np.testing.assert_array_equal(np.asarray(rules.apply(logits)), np.where(mask, logits, -np.inf))
