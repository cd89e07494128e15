"""The jitted sampler on hand-made logits (one compiled shape, [64, 8])."""

import jax
import numpy as np
import pytest

from k31jax.generate import SamplingParams
from k31jax.generate._sampling import make_sampler_state, sample_tokens, sampler_arrays

B, V = 64, 8
_sample = jax.jit(sample_tokens)
LOGITS = np.log(np.array([0.05, 0.5, 0.02, 0.3, 0.01, 0.1, 0.01, 0.01], np.float32))


def draw(params, logits=LOGITS, prompts=None, force=None, seeds=None):
    ps = [SamplingParams(**{**params, "seed": (seeds[i] if seeds else i)}) for i in range(B)]
    arrays = sampler_arrays(ps, prompts or [[0]] * B, V)
    state = make_sampler_state(**arrays)
    f = np.full(B, -1, np.int32) if force is None else np.asarray(force, np.int32)
    tokens, state = _sample(np.broadcast_to(logits, (B, V)), state, f)
    return np.asarray(tokens), state


def test_greedy_and_degenerate_filters_pick_the_argmax():
    for params in ({}, {"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_p": 1e-6},
                   {"temperature": 1.0, "min_p": 1.0}):
        tokens, _ = draw(params)
        assert (tokens == 1).all(), params


def test_top_k_top_p_min_p_restrict_the_support():
    tokens, _ = draw({"temperature": 1.0, "top_k": 3})
    assert set(tokens) <= {1, 3, 5} and len(set(tokens)) > 1
    # top-p 0.8: mass before token 3 is 0.5 (< 0.8, kept), before token 5 is 0.8 (dropped)
    tokens, _ = draw({"temperature": 1.0, "top_p": 0.8})
    assert set(tokens) == {1, 3}
    # min-p 0.25: keep p >= 0.125 -> {0.5, 0.3}
    tokens, _ = draw({"temperature": 1.0, "min_p": 0.25})
    assert set(tokens) == {1, 3}


def test_temperature_sampling_follows_the_distribution():
    counts = np.zeros(V)
    for rep in range(8):
        tokens, _ = draw({"temperature": 1.0}, seeds=[rep * B + i for i in range(B)])
        counts += np.bincount(tokens, minlength=V)
    freq = counts / counts.sum()
    assert np.abs(freq - np.exp(LOGITS)).max() < 0.08


def test_seeds_are_per_row():
    a, _ = draw({"temperature": 1.0}, seeds=list(range(B)))
    b, _ = draw({"temperature": 1.0}, seeds=list(range(B))[::-1])
    assert (a == b[::-1]).all()  # a row's sample depends on its own seed only


def test_repetition_penalty_and_seen_tokens():
    logits = np.log(np.array([0.05, 0.4, 0.02, 0.35, 0.01, 0.15, 0.01, 0.01], np.float32)) + 3.0
    tokens, state = draw({"repetition_penalty": 1.5}, logits=logits, prompts=[[1]] * B)
    assert (tokens == 3).all()  # token 1 was in the prompt: its positive logit is divided
    seen = np.asarray(state.seen)
    assert seen[:, 1].all() and seen[:, 3].all() and not seen[:, 0].any()
    tokens, _ = draw({}, logits=logits, prompts=[[1]] * B)
    assert (tokens == 1).all()  # penalty 1.0: untouched


def test_forced_tokens_override_sampling():
    force = [-1] * (B // 2) + [6] * (B // 2)
    tokens, state = draw({"temperature": 1.0}, force=force)
    assert (tokens[B // 2:] == 6).all() and (tokens[: B // 2] != 6).any()
    assert int(state.step) == 1


def test_invalid_params_are_named():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature.*repetition_penalty"):
        SamplingParams(temperature=-1, repetition_penalty=0)
