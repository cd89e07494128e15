"""Parity with a peer: transformers' `kimi_linear` (torch CPU path) on a tiny random model.

The golden files are made by `tests/golden/make_kimi_linear_golden.py` (own venv with torch;
see its docstring). The model exercises the Kimi Linear switches: softplus KDA gate,
low-rank output gate, plain `q_proj` MLA without a gate, plain residuals, SwiGLU, experts on
the full width, routed scaling 2.446.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.paths import GOLDEN_DIR
from k31jax import ModelConfig, load_hf_weights

GOLDEN = GOLDEN_DIR / "kimi_linear_tiny"
RTOL = 1e-4


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN / "golden.npz"))


@pytest.fixture(scope="module")
def model():
    return load_hf_weights(GOLDEN, dtype="float32")


forward = nnx.jit(lambda m, t, c: m(t, c))


def assert_rel(actual, expected, what):
    err = np.abs(np.asarray(actual) - expected).max() / np.abs(expected).max()
    assert err <= RTOL, f"{what}: relative error {err:.3g} > {RTOL}"


def test_config_switches():
    cfg = ModelConfig.from_hf(GOLDEN)
    assert cfg.kda_gate_lower_bound is None and not cfg.kda_full_rank_gate
    assert cfg.q_lora_rank is None and not cfg.mla_use_output_gate
    assert cfg.attn_res_block_size is None and cfg.hidden_act == "silu"
    assert not cfg.latent_moe and cfg.routed_scaling_factor == pytest.approx(2.446)
    assert cfg.mla_layers == (3, 6)
    meta = json.loads(str(np.load(GOLDEN / "golden.npz")["meta_json"]))
    assert "transformers" in json.dumps(meta)


def test_full_forward(model, golden):
    logits = forward(model, jnp.asarray(golden["input_ids"], jnp.int32), None).logits
    assert_rel(logits, golden["logits"], "logits")


def test_long_sequence_crosses_chunks(model, golden):
    logits = forward(model, jnp.asarray(golden["long_input_ids"], jnp.int32), None).logits
    assert_rel(logits, golden["long_logits"], "long logits (150 tokens, 3 KDA chunks)")


def test_prefill_and_decode(model, golden):
    ids = jnp.asarray(golden["input_ids"], jnp.int32)
    n = golden["prefill_logits"].shape[1]
    out = forward(model, ids[:, :n], model.init_cache(ids.shape[0], 64))
    assert_rel(out.logits, golden["prefill_logits"], "prefill logits")
    for i in range(golden["decode_logits"].shape[1]):
        out = forward(model, ids[:, n + i:n + i + 1], out.cache)
        assert_rel(out.logits[:, 0], golden["decode_logits"][:, i], f"decode step {i}")
