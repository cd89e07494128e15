"""Engine: greedy == full-forward argmax, batching is exact, seeded sampling, thinking budget,
stop ids / strings, streaming, and compilation once per (batch, bucket).

One module-scoped engine over a randomized `tiny` with `prefill_chunk=16`: every prompt is
prefilled by the same [B, 16] program, so the module compiles one prefill, one first-token
sampler and one decode step per batch size (1 and 3).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.model import randomize, tiny_config
from k31jax import K31ForCausalLM
from k31jax.chat import ByteTokenizer, ThinkingBudget, apply_chat_template, collect_events
from k31jax.generate import Engine, Request, SamplingParams, plan_prefill

MAX_LEN = 512
CHUNK = 16


@pytest.fixture(scope="module")
def model():
    return randomize(K31ForCausalLM(tiny_config(), rngs=nnx.Rngs(0)), 1)


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer(384)


@pytest.fixture(scope="module")
def engine(model, tok):
    eng = Engine(model, tok, max_len=MAX_LEN, prefill_chunk=CHUNK)
    eng.first_result = eng.generate([_prompt(5)], 6, stop_ids=NO_STOP)  # compiles batch 1
    return eng


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


NO_STOP = frozenset()


def test_plan_prefill():
    assert plan_prefill(5, 16) == (16, 16)
    assert plan_prefill(17, 16) == (32, 16)
    assert plan_prefill(40, 16) == (48, 16)
    assert plan_prefill(40, 512) == (64, 64)
    assert plan_prefill(600, 512) == (1024, 512)


def test_greedy_equals_full_forward_argmax(engine, model):
    """20 greedy tokens == step-by-step argmax of the full forward pass (no cache); the prompt
    (21 tokens) is prefilled in two chunks."""
    prompt = _prompt(21)
    out = engine.generate([prompt], 20, stop_ids=NO_STOP).tokens[0]
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)  # causal: right padding is inert
    seq = list(prompt)
    buf = np.zeros((1, 48), np.int32)
    for _ in range(20):
        buf[0, :len(seq)] = seq
        seq.append(int(jnp.argmax(forward(state, jnp.asarray(buf))[0, len(seq) - 1])))
    assert out == seq[len(prompt):]


def test_batch_equals_each_prompt_alone(engine):
    prompts = [_prompt(5, 1), _prompt(17, 2), _prompt(40, 3)]
    alone = [engine.generate([p], 12, stop_ids=NO_STOP).tokens[0] for p in prompts]
    batch = engine.generate(prompts, 12, stop_ids=NO_STOP)
    assert batch.tokens == alone
    assert batch.padded_prompt_tokens == 3 * 48


def test_pipelining_changes_nothing(engine, model, tok):
    prompts = [_prompt(5, 1), _prompt(17, 2), _prompt(40, 3)]
    ref = engine.generate(prompts, 12, stop_ids=NO_STOP).tokens
    serial = Engine(model, tok, max_len=MAX_LEN, prefill_chunk=CHUNK, pipeline=False)
    assert serial.generate(prompts, 12, stop_ids=NO_STOP).tokens == ref


def test_layer_rows_engine_equals_the_scanned_one(engine, model, tok):
    """The per-layer-rows engine (the CPU default for wide layers) generates the scanned
    engine's tokens, greedy and sampled; the default picks rows only where they pay off."""
    rows = Engine(model, tok, max_len=MAX_LEN, prefill_chunk=CHUNK, layer_rows=True)
    def q_proj(eng):
        return jax.tree.leaves(eng.core.state["kda"]["q_proj"], is_leaf=lambda a: isinstance(a, tuple))[0]

    assert isinstance(q_proj(rows), tuple) and len(q_proj(rows)) == len(model.config.kda_layers)
    assert not isinstance(q_proj(engine), tuple)  # tiny: the scan pays off
    prompts = [_prompt(5, 1), _prompt(17, 2), _prompt(40, 3)]
    for params in (None, SamplingParams(**SAMPLED, seed=3)):
        assert (rows.generate(prompts, 12, params, stop_ids=NO_STOP).tokens
                == engine.generate(prompts, 12, params, stop_ids=NO_STOP).tokens)


def test_layer_rows_default_follows_the_layer_width():
    from k31jax.generate._core import _rows_pay_off
    from k31jax.nn import abstract_model

    def pays(cfg):
        return _rows_pay_off(nnx.state(abstract_model(cfg)), cfg.num_hidden_layers)

    assert not pays(tiny_config())
    wide = tiny_config(hidden_size=512, intermediate_size=1536, kda_num_heads=8, kda_head_dim=64)
    assert pays(wide) == (jax.default_backend() == "cpu")


SAMPLED = dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.2)


def test_same_seed_same_text_different_seed_differs(engine):
    prompt = _prompt(9, 4)
    a = engine.generate([prompt], 16, SamplingParams(**SAMPLED, seed=7), stop_ids=NO_STOP)
    b = engine.generate([prompt], 16, SamplingParams(**SAMPLED, seed=7), stop_ids=NO_STOP)
    c = engine.generate([prompt], 16, SamplingParams(**SAMPLED, seed=8), stop_ids=NO_STOP)
    assert a.texts == b.texts and a.tokens == b.tokens
    assert a.tokens != c.tokens
    greedy = engine.generate([prompt], 16, stop_ids=NO_STOP)
    assert a.tokens != greedy.tokens


def test_each_row_has_its_own_seed(engine):
    """Rows 0 and 2 share prompt and seed: same tokens, equal to the prompt run alone."""
    p, q = _prompt(9, 4), _prompt(12, 5)
    params = [SamplingParams(**SAMPLED, seed=s) for s in (7, 9, 7)]
    rows = engine.generate([p, q, p], 16, params, stop_ids=NO_STOP).tokens
    alone = engine.generate([p], 16, params[0], stop_ids=NO_STOP).tokens[0]
    assert rows[0] == rows[2] == alone
    assert rows[1] != rows[0]


def test_stop_ids_end_generation(engine):
    prompts = [_prompt(9, 6), _prompt(14, 7), _prompt(30, 8)]
    free = engine.generate(prompts, 16, stop_ids=NO_STOP).tokens
    stop = free[0][5]
    j = free[0].index(stop)
    res = engine.generate(prompts, 16, stop_ids={stop})
    c0 = res.completions[0]
    assert c0.tokens == free[0][:j + 1] and c0.finish_reason == "stop" and c0.stop == stop
    for row, ref in zip(res.completions[1:], free[1:]):  # other rows: unaffected
        k = ref.index(stop) + 1 if stop in ref else len(ref)
        assert row.tokens == ref[:k]
    assert engine.stop_ids == {257, 258}  # [EOS] and <|end_of_msg|>: both


def test_stop_strings_cut_the_text(engine, tok):
    prompt = _prompt(11, 9)
    free = engine.generate([prompt], 24, stop_ids=NO_STOP).completions[0]
    assert free.text == tok.decode(free.tokens)
    stop = free.text[len(free.text) // 2:][:3]
    res = engine.generate([prompt], 24, stop_ids=NO_STOP, stop=["\x00never", stop])
    c = res.completions[0]
    assert c.finish_reason == "stop" and c.stop == stop
    assert c.text == free.text[:free.text.index(stop)]
    assert c.tokens == free.tokens[:len(c.tokens)] and len(c.tokens) < len(free.tokens)
    deltas = list(engine.stream([prompt], 24, stop_ids=NO_STOP, stop=[stop]))
    assert "".join(d.text for d in deltas) == c.text  # hold-back never leaks a partial match
    assert deltas[-1].finish_reason == "stop"


def test_max_new_tokens_and_length_finish(engine):
    res = engine.generate([_prompt(4), _prompt(6), _prompt(2)], 8, stop_ids=NO_STOP)
    assert [len(t) for t in res.tokens] == [8, 8, 8]
    assert all(c.finish_reason == "length" for c in res.completions)
    reqs = [Request(_prompt(4), max_new_tokens=3, stop_ids=NO_STOP),
            Request(_prompt(6), max_new_tokens=9, stop_ids=NO_STOP),
            Request(_prompt(5), max_new_tokens=1, stop_ids=NO_STOP)]
    assert [len(t) for t in engine.generate(reqs).tokens] == [3, 9, 1]
    with pytest.raises(ValueError, match="max_len"):
        engine.generate([_prompt(4)], MAX_LEN)


def _chat_prompt(tok, text="What is 17 * 3?"):
    return apply_chat_template(tok, [{"role": "user", "content": text}], thinking_effort="low")


def _clean_prefix(tok, ids):
    """Longest n such that ids[:n] ends on a complete UTF-8 character and outside a marker
    (<|open|>/<|close|> ... <|sep|>), with no marker at all before it (so nothing ends the
    thinking phase early): where the budget may force at once."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")("replace")
    start = {tok.special_id("<|open|>"), tok.special_id("<|close|>")}
    best = 0
    for n, t in enumerate(ids, 1):
        if t in start:
            break
        dec.decode(tok.token_bytes(t))
        if not dec.getstate()[0]:
            best = n
    return best


def test_thinking_budget_forces_close_at_exactly_the_budget(engine, tok):
    prompt = _chat_prompt(tok)
    free = engine.generate([prompt], 24, stop_ids=NO_STOP).tokens[0]
    budget = min(_clean_prefix(tok, free[:12]), 12)
    assert budget >= 2, "tiny's free output has no clean thinking prefix; change the prompt"
    forced = ThinkingBudget.k3(tok, budget).forced
    res = engine.generate([prompt], budget + len(forced) + 4, thinking_budget=budget,
                          stop_ids=NO_STOP, parse=True)
    c = res.completions[0]
    assert c.tokens[:budget] == free[:budget]  # free sampling before the budget
    assert c.tokens[budget:budget + len(forced)] == list(forced)  # then the close sequence
    assert tok.decode(forced) == "<|close|>think<|sep|><|open|>response<|sep|>"
    assert c.forced_at == budget and c.thinking_tokens == budget
    assert c.parsed.reasoning_content == tok.decode(free[:budget])
    assert c.parsed.content is not None  # the response channel is open


def test_streaming_text_and_structured_events(engine, tok):
    prompt = _chat_prompt(tok, "Hi")
    deltas = list(engine.stream([prompt], 20, thinking_budget=6, stop_ids=NO_STOP, parse=True))
    c = engine.last_result.completions[0]
    assert [t for d in deltas for t in d.token_ids] == c.tokens
    assert "".join(d.text for d in deltas) == c.text
    folded = collect_events(e for d in deltas for e in d.events)
    assert folded.reasoning_content == c.parsed.reasoning_content
    assert folded.content == c.parsed.content
    assert deltas[-1].finish_reason == "length"


def test_compiles_once_per_batch_and_bucket(engine, tok):
    """After one warm run per batch size, new prompt lengths, step counts, sampling settings,
    stop strings and budgets reuse the compiled programs: nothing is traced again."""
    engine.generate([_prompt(3)], 4)
    engine.generate([_prompt(3)] * 3, 4)
    compiles, compiled = dict(engine.compile_counts), engine.compile_seconds
    for n, steps in ((1, 2), (7, 9), (16, 5), (23, 17), (45, 3)):
        engine.generate([_prompt(n, n)], steps, stop_ids=NO_STOP)
        engine.generate([_prompt(n, n)], steps, SamplingParams(**SAMPLED, seed=n), stop=["zz"])
    engine.generate([_prompt(5), _prompt(33), _prompt(2)], 6, SamplingParams(temperature=0.5))
    engine.generate([_chat_prompt(tok)], 12, thinking_budget=3, parse=True)
    assert dict(engine.compile_counts) == compiles
    assert engine.compile_seconds == compiled
    assert compiles == {"init_cache": 2, "prefill": 2, "first": 2, "decode": 2}  # 4 programs x batch sizes {1, 3}


def test_timings_exclude_compilation(engine):
    first = engine.first_result  # the fixture's run compiled the batch-1 programs
    assert first.compile_seconds > 0.5
    assert first.prefill_seconds < first.compile_seconds
    assert first.decode_steps == 5 and first.decode_tokens == 5 and first.decode_tok_s > 0
    again = engine.generate([_prompt(5)], 6, stop_ids=NO_STOP)
    assert again.compile_seconds == 0 and again.tokens == first.tokens
