"""Speculative decoding: prompt-lookup drafts, the acceptance rule against a float64 NumPy
reference and a chi-square test, the cache rollback against step-by-step decoding, and greedy
output identical token for token to plain decoding (embedded model with n-gram drafts; tiny
configs with KDA, MLA and DSA layers, batch 1 and 8 with different kept lengths per row;
thinking budget and stop strings; the continuous scheduler)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from helpers.model import kimi_linear_tiny_config, randomize, tiny_config
from k31jax import K31ForCausalLM
from k31jax.chat import ByteTokenizer
from k31jax.generate import (DraftRow, Drafter, Engine, NgramDrafter, Request, SamplingParams, Scheduler,
                             Speculation, TokenRules, accept_drafts, load_model)
from k31jax.generate._drafts import Speculator
from k31jax.generate._sampling import make_sampler_state, sampler_arrays
from k31jax.serve._metrics import render_metrics

NO_STOP = frozenset()


class _OracleRow(DraftRow):
    """Drafts the known continuation, one token changed in about half the drafts, so kept
    lengths vary from row to row and step to step."""

    def __init__(self, truth, rng):
        self.truth, self.rng, self.n = truth, rng, 0

    def extend(self, tokens):
        self.n += len(tokens)

    def propose(self, limit):
        draft = list(self.truth[self.n:self.n + limit])
        if draft and self.rng.random() < 0.5:
            draft[self.rng.integers(len(draft))] ^= 1
        return draft


class Oracle(Drafter):
    def __init__(self, prompts, outputs, seed=0):
        self.truths = {tuple(p): list(o) for p, o in zip(prompts, outputs)}
        self.rng = np.random.default_rng(seed)

    def row(self, prompt):
        return _OracleRow(self.truths[tuple(prompt)], self.rng)


# ---- drafts -------------------------------------------------------------------------------
def test_ngram_drafts_the_continuation_of_the_latest_longest_match():
    row = NgramDrafter(min_ngram=2, max_ngram=3).row([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 1, 2, 3])
    # [2, 3] last occurred before 5; [1, 2, 3] (longer) occurred before 4: the longer one wins
    assert row.propose(3) == [4, 9, 2]
    row.extend([4, 8])  # ... 1 2 3 4 8: [3, 4, 8] never occurred; [4, 8] neither
    assert row.propose(4) == []
    row.extend([2, 3])  # suffix [8, 2, 3] no; [2, 3] latest before: position after "1 2 3" -> 4
    assert row.propose(2) == [4, 8]
    assert row.propose(0) == []
    assert NgramDrafter(3, 4).row([1, 2]).propose(5) == []
    # a loop of period 3 ([7, 8, 9] last seen 3 tokens back): the draft repeats it past the row's end
    assert NgramDrafter(3, 3).row([5, 7, 8, 9, 7, 8, 9]).propose(7) == [7, 8, 9, 7, 8, 9, 7]
    assert NgramDrafter(2, 2).row([4, 4, 4]).propose(3) == [4, 4, 4]  # period 1
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(0, 3)


def test_speculator_adapts_lengths_and_picks_few_widths():
    spec = Speculator(Speculation(max_draft=8, timed=False))
    spec.add("a", [1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3])
    assert spec.widths() == [2, 3, 5, 9]
    drafts = spec.drafts({"a": 100})
    assert drafts == {"a": [4, 5, 6, 7]}  # starts at max_draft // 2
    assert spec.width(drafts) == 5 and spec.width({"a": [1, 2, 3]}) == 5 and spec.width({}) == 0
    spec.verified(drafts, {"a": 4})  # all kept: doubles
    assert spec.drafts({"a": 100}) == {"a": [4, 5, 6, 7, 8, 9, 1, 2]}
    assert spec.drafts({"a": 3}) == {"a": [4, 5, 6]}  # the loop's limit
    spec.verified({"a": [4, 5, 6, 7, 8, 9, 1, 2]}, {"a": 1})  # rejected after one: 2
    assert spec.drafts({"a": 100}) == {"a": [4, 5]}
    assert (spec.stats.drafted, spec.stats.accepted, spec.stats.verified_rows) == (12, 5, 2)


def test_a_verify_step_runs_where_its_cost_and_expected_tokens_beat_plain_steps():
    spec = Speculator(Speculation(max_draft=4))
    drafts, two = {"a": [1, 2, 3, 4]}, {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
    assert spec.width(drafts, 2) == 0  # no plain step timed yet at batch 2: one first
    spec.timed(2, 0, 0.010)  # plain: 2 tokens per 10 ms
    assert spec.width(drafts, 2) == 5  # the width not timed yet: once, to time it
    spec.timed(2, 5, 0.040)  # expected 2 + 1.0 * 4 = 6 tokens per 40 ms: slower than plain
    assert [spec.width(drafts, 2) for _ in range(16)] == [0] * 15 + [5]  # re-timed after 16 refusals
    assert [spec.width(drafts, 2) for _ in range(32)] == [0] * 31 + [5]  # then after twice as many
    assert spec.width(two, 2) == 5  # 10 tokens per 40 ms: faster
    assert [spec.width(drafts, 2) for _ in range(16)] == [0] * 15 + [5]  # worth it again: back to 16
    spec.verified(drafts, {"a": 0})  # none kept: acceptance 0.7 * 1 + 0.3 * 0 = 0.7
    assert spec.acceptance == pytest.approx(0.7)
    assert spec.width(two, 2) == 0  # 2 + 0.7 * 8 = 7.6 tokens per 40 ms: slower
    spec.timed(2, 5, 0.020)  # the step now costs 0.7 * 40 + 0.3 * 20 = 34 ms: 7.6 / 34 > 2 / 10
    assert spec.width(two, 2) == 5
    # a static batch is done when its slowest row is: a verify step must advance each of them
    assert spec.width(two, 2, left={"a": 30, "c": 28}) == 0  # "c", within a draft, drafts nothing
    assert spec.width(two, 2, left={"a": 30, "c": 3}) == 5  # "a" alone: 1 + 0.7 * 4 = 3.8 steps' worth for 3.4
    assert spec.width(drafts, 1) == 0  # another batch size has its own figures
    later = Speculator(Speculation(max_draft=4), spec.timings)  # an Engine's next call
    assert later.width(two, 2) == 5 and later.width(drafts, 1) == 0
    assert Speculator(Speculation(max_draft=4)).width(drafts, 2) == 0
    assert Speculator(Speculation(max_draft=4, timed=False)).width(drafts, 2) == 5
    with pytest.raises(ValueError, match="drafter"):
        Speculation("medusa")


# ---- acceptance against a reference -----------------------------------------------------
def _sampler(params, vocab, batch_prompts=None):
    arrays = sampler_arrays(params, batch_prompts or [[0]] * len(params), vocab)
    s = make_sampler_state(**arrays)
    return s.__class__(**{**s.__dict__, "step": jnp.zeros((len(params),), jnp.int32)})


def _reference_probs(logits, temperature, top_k):
    """float64: the distribution a sampling row draws from (temperature, then top-k)."""
    z = np.asarray(logits, np.float64) / temperature
    if top_k:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


def test_greedy_acceptance_is_the_longest_matching_prefix():
    rng = np.random.default_rng(0)
    b, w, v = 5, 5, 11
    logits = rng.standard_normal((b, w, v)).astype(np.float32)
    best = logits.argmax(-1)
    drafts = best[:, :w - 1].copy()
    drafts[1, 2] = (drafts[1, 2] + 1) % v  # row 1 keeps 2
    drafts[2, 0] = (drafts[2, 0] + 1) % v  # row 2 keeps 0
    lengths = np.array([4, 4, 4, 2, 0], np.int32)  # row 3 drafted 2, row 4 nothing
    s = _sampler([SamplingParams()] * b, v)
    out = accept_drafts(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(lengths), s,
                        TokenRules.forcing([-1, -1, -1, -1, 7]))
    kept = np.asarray(out.kept)
    np.testing.assert_array_equal(kept, [5, 3, 1, 3, 1])
    tokens = np.asarray(out.tokens)
    for i in range(4):
        np.testing.assert_array_equal(tokens[i, :kept[i]], best[i, :kept[i]])
        assert (tokens[i, kept[i]:] == -1).all()
    assert tokens[4, 0] == 7  # a forced row (drafts nothing) takes its forced id
    np.testing.assert_array_equal(np.asarray(out.sampler.step), kept)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 4)])
def test_sampled_acceptance_keeps_the_target_distribution(temperature, top_k):
    """Chi-square: over 40,000 seeds, the first emitted token is distributed as the target's
    p_0, and the second (given that the first was the draft) as p_1; float64 reference."""
    rng = np.random.default_rng(1)
    v, w, n = 6, 3, 40_000
    logits = rng.standard_normal((w, v)).astype(np.float32) * 1.5
    draft = [int(np.argsort(logits[0])[-2]), int(np.argsort(logits[1])[-1])]  # a likely, not the likeliest, first
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=i) for i in range(n)]
    s = _sampler(params, v)
    out = accept_drafts(jnp.broadcast_to(jnp.asarray(logits), (n, w, v)), jnp.asarray([draft] * n, jnp.int32),
                        jnp.full((n,), 2, jnp.int32), s, TokenRules.forcing(np.full(n, -1)))
    tokens, kept = np.asarray(out.tokens), np.asarray(out.kept)
    p0 = _reference_probs(logits[0], temperature, top_k)
    p1 = _reference_probs(logits[1], temperature, top_k)
    first = np.bincount(tokens[:, 0], minlength=v)
    assert 0.0 < (kept > 1).mean() < 1.0  # both branches of the rule ran
    support = p0 > 0
    assert first[~support].sum() == 0
    assert stats.chisquare(first[support], p0[support] * n).pvalue > 1e-3
    followed = tokens[tokens[:, 0] == draft[0], 1]
    second = np.bincount(followed, minlength=v)
    support = p1 > 0
    assert second[~support].sum() == 0
    assert stats.chisquare(second[support], p1[support] * len(followed)).pvalue > 1e-3


# ---- cache rollback ---------------------------------------------------------------------
@pytest.mark.parametrize("make", [tiny_config, kimi_linear_tiny_config], ids=["k31_dsa", "kimi_linear"])
def test_rollback_equals_feeding_only_the_kept_tokens(make):
    """A trail call over 5 tokens rolled back to 1, 3 and 5 kept tokens continues exactly as a
    cache fed those tokens one decode step at a time (KDA state and conv window, MLA and
    indexer rows, valid keys)."""
    graphdef, state = nnx.split(randomize(K31ForCausalLM(make(), rngs=nnx.Rngs(0)), 1))
    run = jax.jit(lambda tokens, cache, trail=False: nnx.merge(graphdef, state)(tokens, cache, trail=trail),
                  static_argnames="trail")
    init = nnx.merge(graphdef, state).init_cache
    model = lambda tokens, cache, trail=False: run(tokens, cache, trail=trail)  # noqa: E731
    rng = np.random.default_rng(0)
    b, t, length = 3, 5, 48
    prompt = jnp.asarray(rng.integers(0, 256, (b, 20)))
    fed = jnp.asarray(rng.integers(0, 256, (b, t)))
    cache = model(prompt, init(b, length)).cache
    verify = model(fed, cache, trail=True)
    kept = np.array([1, 3, 5])
    rolled = verify.cache.rollback(jnp.asarray(kept), t)
    assert rolled.kda_trail is None
    step_logits = []
    stepped = cache
    for j in range(t):
        out = model(fed[:, j:j + 1], stepped)
        stepped = out.cache
        step_logits.append(out.logits[:, 0])
        for i in np.flatnonzero(kept == j + 1):
            np.testing.assert_allclose(rolled.kda_state[:, i], stepped.kda_state[:, i], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(rolled.kda_conv[:, i], stepped.kda_conv[:, i], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(verify.logits, jnp.stack(step_logits, 1), rtol=1e-4, atol=1e-4)
    valid = np.asarray(rolled.key_valid)
    for i in range(b):
        np.testing.assert_array_equal(valid[i, :20 + kept[i]], True)
        np.testing.assert_array_equal(valid[i, 20 + kept[i]:], False)
    nxt = jnp.asarray(rng.integers(0, 256, (b, 1)))
    got = model(nxt, rolled).logits[:, 0]
    for i in range(b):
        alone = model(prompt[i:i + 1], init(1, length)).cache
        for j in range(kept[i]):
            alone = model(fed[i:i + 1, j:j + 1], alone).cache
        np.testing.assert_allclose(got[i], model(nxt[i:i + 1], alone).logits[0, 0], rtol=1e-4, atol=1e-4)


# ---- greedy output is unchanged ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    return randomize(K31ForCausalLM(tiny_config(), rngs=nnx.Rngs(0)), 1)


def _four_layers(**overrides):
    """`tiny` cut to four layers that still hold every kind (dense and MoE FFNs, KDA and DSA
    mixers), at a third of the compile time: for tests whose claim is not about the layer stack."""
    return tiny_config(num_hidden_layers=4, layer_types=("kda", "mla", "kda", "mla"), **overrides)


def _prompts(n, seed=0, length=(5, 40)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, rng.integers(*length)).tolist() for _ in range(n)]


@pytest.mark.parametrize("make,batch", [(tiny_config, 1), (tiny_config, 8), (kimi_linear_tiny_config, 8)],
                         ids=["k31_dsa_b1", "k31_dsa_b8", "kimi_linear_b8"])
def test_greedy_speculation_is_token_for_token_plain(make, batch):
    """Drafts that are right, partly right or wrong per row (every row keeps its own length
    per step); a cache short enough that the verify steps compact it."""
    model = randomize(K31ForCausalLM(make(), rngs=nnx.Rngs(0)), 1)
    prompts = _prompts(batch, seed=batch)
    plain = Engine(model, max_len=112, prefill_chunk=16).generate(prompts, 64, stop_ids=NO_STOP)
    engine = Engine(model, max_len=112, prefill_chunk=16,
                    speculation=Speculation(Oracle(prompts, plain.tokens), max_draft=4, timed=False))
    spec = engine.generate(prompts, 64, stop_ids=NO_STOP)
    assert spec.tokens == plain.tokens
    st = engine.last_result.speculation
    assert st.verify_steps < 63 and 0 < st.accepted < st.drafted
    assert engine.compile_counts["verify"] <= 3 and engine.compile_counts["compact"] == 1


def test_embedded_model_ngram_speculation_is_plain_greedy():
    """The embedded model where its output repeats itself (a small model falls into loops):
    n-gram drafts are kept, and the output is plain greedy decoding's, alone and in a batch of
    8 different prompts."""
    lm = load_model()
    tok = lm.tokenizer
    heads = ["    parser.add_argument('--input')\n    parser.add_argument('--output')\n    parser.add_argument('",
             "import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n",
             "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n",
             "def area(width, height):\n    return width * height\n\n\n" * 3 + "def area("]
    prompts = [tok.encode(heads[i % 4] + "    " * (i // 4)) for i in range(8)]
    plain = Engine(lm.model, tok, max_len=256, prefill_chunk=64)
    spec = Engine(lm.model, tok, max_len=256, prefill_chunk=64,
                  speculation=Speculation("ngram", max_draft=4, timed=False))
    want = plain.generate(prompts[:1], 48, stop_ids=NO_STOP).tokens
    assert spec.generate(prompts[:1], 48, stop_ids=NO_STOP).tokens == want
    assert spec.last_result.speculation.accepted > 10
    assert spec.generate(prompts, 48, stop_ids=NO_STOP).tokens == plain.generate(prompts, 48, stop_ids=NO_STOP).tokens
    assert spec.last_result.speculation.accepted > 40


def test_speculation_honours_the_thinking_budget_and_stop_strings(tiny_model):
    """Drafts never run past the point where the budget forces its closing markup, and a stop
    string met inside kept drafts ends the row where plain decoding ends it."""
    tok = ByteTokenizer(384)
    prompts = [tok.encode("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
                          "<think>", allow_special=True), _prompts(1, seed=5)[0]]
    kw = dict(thinking_budget=6, stop=["e"], stop_ids=NO_STOP)
    plain = Engine(tiny_model, tok, max_len=160, prefill_chunk=16).generate(prompts, 40, **kw)
    engine = Engine(tiny_model, tok, max_len=160, prefill_chunk=16,
                    speculation=Speculation(Oracle(prompts, [t + [0] * 8 for t in _free_run(tiny_model, tok, prompts)]),
                                            max_draft=4, timed=False))
    spec = engine.generate(prompts, 40, **kw)
    assert spec.tokens == plain.tokens and spec.texts == plain.texts
    assert [c.forced_at for c in spec.completions] == [c.forced_at for c in plain.completions]
    assert engine.last_result.speculation.drafted > 0


def test_a_verify_step_is_charged_the_host_work_on_its_tokens():
    """A verify step's several tokens per row are pushed (stop strings, detokenising, the
    caller's own work on each delta) with no step in flight: the step's timing includes that
    work, so the guard weighs what the loop pays. A consumer that spends 30 ms per token makes
    every timed verify step cost at least that."""
    tiny_model = randomize(K31ForCausalLM(_four_layers(), rngs=nnx.Rngs(0)), 1)
    prompts = _prompts(1, seed=3)
    truth = Engine(tiny_model, max_len=96, prefill_chunk=16).generate(prompts, 16, stop_ids=NO_STOP).tokens
    engine = Engine(tiny_model, max_len=96, prefill_chunk=16,
                    speculation=Speculation(Oracle(prompts, truth), max_draft=4, timed=False))
    engine.generate(prompts, 16, stop_ids=NO_STOP)  # compiles (steps that compile are not timed)
    for _ in engine.stream(prompts, 16, stop_ids=NO_STOP):
        time.sleep(0.030)
    timed = [engine.step_timings.seconds(1, w) for w in Speculator(engine.speculation).widths()]
    assert any(t is not None for t in timed)
    assert all(t >= 0.030 for t in timed if t is not None), timed


def _free_run(model, tok, prompts):
    """The greedy continuation without the budget or stops (what an optimistic drafter sees)."""
    return Engine(model, tok, max_len=160, prefill_chunk=16).generate(prompts, 40, stop_ids=NO_STOP).tokens


# ---- sampled output keeps its distribution end to end -------------------------------------
def test_sampled_speculation_has_plain_sampling_distribution():
    """A 16-id vocabulary at temperature 1.3: over 1,024 seeded rows, the second and third
    generated ids are distributed alike with and without speculation (two-sample
    chi-square), with drafts both kept and rejected."""
    model = randomize(K31ForCausalLM(_four_layers(vocab_size=16), rngs=nnx.Rngs(0)), 3, scale=0.3)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    n, batch = 1024, 512
    greedy = Engine(model, max_len=64, prefill_chunk=16).generate([prompt], 3, stop_ids=NO_STOP).tokens[0]

    class Fixed(Drafter):
        def row(self, p):
            return _OracleRow(greedy, np.random.default_rng(0))

    counts = {}
    for name, spec in (("plain", None), ("spec", Speculation(Fixed(), max_draft=2, timed=False))):
        engine = Engine(model, max_len=64, prefill_chunk=16, speculation=spec)
        rows = []
        for start in range(0, n, batch):
            params = [SamplingParams(temperature=1.3, seed=start + i) for i in range(batch)]
            rows += engine.generate([prompt] * batch, 3, params, stop_ids=NO_STOP).tokens
        counts[name] = np.asarray(rows)
        if spec is not None:
            assert 0 < engine.last_result.speculation.accepted < engine.last_result.speculation.drafted
    for position in (1, 2):
        table = np.stack([np.bincount(counts[k][:, position], minlength=16) for k in ("plain", "spec")])
        table = table[:, table.sum(0) > 0]
        assert stats.chi2_contingency(table).pvalue > 1e-3


# ---- the continuous scheduler -------------------------------------------------------------
def test_scheduler_speculation_is_plain_greedy_with_nothing_compiled_after_warmup():
    lm = load_model(config="tiny")
    tok = lm.tokenizer
    prompts = [tok.encode(f"prompt number {i} " * (1 + i)) for i in range(6)]
    engine = Engine(lm.model, tok, max_len=192, prefill_chunk=8)
    want = [engine.generate([p], 24, stop_ids=NO_STOP).tokens[0] for p in prompts]
    sched = Scheduler(engine, max_batch=4, prefill_chunk=8,
                      speculation=Speculation(Oracle(prompts, want, seed=3), max_draft=2, timed=False))
    sched.warmup()
    counts = dict(sched.compile_counts)
    assert counts["verify"] == 2
    handles = [sched.submit(Request(p, max_new_tokens=24, stop_ids=NO_STOP)) for p in prompts]
    plain_handle = sched.submit(Request(prompts[0], max_new_tokens=24, stop_ids=NO_STOP), logprobs=True)
    sched._run_until_idle()
    assert [h.result(timeout=0).completion.tokens for h in handles] == want
    assert plain_handle.result(timeout=0).completion.tokens == want[0]  # logprobs: drafts nothing
    assert dict(sched.compile_counts) == counts
    assert sched.stats["verify_steps"] > 0 and 0 < sched.speculator.stats.accepted < sched.speculator.stats.drafted
    metrics = render_metrics(sched)
    assert f"k31jax_speculative_accepted_tokens_total {sched.speculator.stats.accepted}" in metrics
    assert f"k31jax_speculative_verify_steps_total {sched.stats['verify_steps']}" in metrics
