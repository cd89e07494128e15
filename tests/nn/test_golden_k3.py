"""Parity with the K3 release modeling code on a tiny random model in the release layout.

`../shared/data/k3_golden_tiny/` holds the checkpoint (per-expert MXFP4, `A_log` padded,
`language_model.` prefix) and what the unmodified release code computed on it (see its
README). Compared: full forward, cached prefill, three cached decode steps, per-layer
activations, and the router's expert sets.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.paths import SHARED_DATA_DIR
from k31jax import ModelConfig, load_hf_weights

GOLDEN = SHARED_DATA_DIR / "k3_golden_tiny"
pytestmark = pytest.mark.skipif(not GOLDEN.exists(), reason=f"{GOLDEN} not present")
RTOL = 1e-4  # the reference's own run-to-run noise is ~7e-5 (README)


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(GOLDEN / "k3_golden.npz"))


@pytest.fixture(scope="module")
def model():
    return load_hf_weights(GOLDEN, dtype="float32")


run = nnx.jit(lambda m, t, c: m(t, c, return_intermediates=True))


def assert_rel(actual, expected, rtol=RTOL, what=""):
    actual = np.asarray(actual, np.float32)
    err = np.abs(actual - expected).max() / np.abs(expected).max()
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"


def test_config_schedule():
    cfg = ModelConfig.from_hf(GOLDEN)
    assert cfg.mla_layers == (3, 7, 11, 12)
    assert cfg.kda_a_log_len == 32 and cfg.attn_res_block_size == 3
    assert not cfg.use_indexer


def test_full_forward(model, golden):
    assert_rel(run(model, jnp.asarray(golden["input_ids"]), None).logits, golden["full/logits"], what="full logits")


def _check_phase(inter, golden, phase, cfg):
    for key in ("embed", "final_attn_res", "final_hidden"):
        assert_rel(inter[key], golden[f"{phase}/{key}"], 2 * RTOL, f"{phase}/{key}")
    for layer in range(cfg.num_hidden_layers):
        g = f"{phase}/layer{layer:02d}/"
        for ours, theirs in (("attn_in", "attn_in"), ("attn_out", "attn_out"), ("mlp_in", "mlp_in"),
                             ("mlp_out", "mlp_out"), ("partial_sum", "prefix_sum")):
            assert_rel(inter[ours][layer], golden[g + theirs], 3 * RTOL, g + theirs)
        if cfg.is_moe_layer(layer):
            ours = np.asarray(inter["router_idx"][layer]).reshape(-1, cfg.num_experts_per_token)
            theirs = golden[g + "router_topk_ids"].reshape(-1, cfg.num_experts_per_token)
            margin = golden[g + "router_margin"].reshape(-1)
            solid = margin > 1e-5
            assert solid.mean() > 0.9
            for a, b in zip(ours[solid], theirs[solid]):
                assert set(a.tolist()) == set(b.tolist()), g + "router_topk_ids"
            w_ours = np.sort(np.asarray(inter["router_weights"][layer]).reshape(ours.shape), -1)
            w_theirs = np.sort(golden[g + "router_topk_weights"].reshape(ours.shape), -1)
            np.testing.assert_allclose(w_ours[solid], w_theirs[solid], rtol=1e-3, atol=1e-5)


def test_prefill_and_cached_decode(model, golden):
    cfg = model.config
    out = run(model, jnp.asarray(golden["prefill_input_ids"]), model.init_cache(2, 64))
    assert_rel(out.logits, golden["prefill/logits"], what="prefill logits")
    _check_phase(out.intermediates, golden, "prefill", cfg)
    cache = out.cache
    # the latent cache holds the post-norm c_kv and the raw k_pe (attention.md §1.4)
    slot = cfg.mla_layers.index(3)
    assert_rel(cache.mla_ckv[slot, :, :45], golden["cache/prefill/layer03/mla_ckv_norm"], what="c_kv")
    k_pe = cache.mla_kpe[slot, :, :45, :cfg.qk_rope_head_dim]  # rows padded to 128 lanes (`nn.kpe_width`)
    assert_rel(k_pe, golden["cache/prefill/layer03/mla_k_pe"], what="k_pe")
    assert not np.asarray(cache.mla_kpe[..., cfg.qk_rope_head_dim:]).any()
    # KDA state: the release stores it value-major [B, H, V, K]; ours is key-major
    kslot = cfg.kda_layers.index(0)
    assert_rel(np.swapaxes(np.asarray(cache.kda_state[kslot]), -1, -2),
               golden["cache/prefill/layer00/recurrent_state"], what="KDA state")
    for i in range(3):
        step = jnp.asarray(golden["decode_input_ids"][:, i:i + 1])
        out = run(model, step, out.cache)
        assert_rel(out.logits, golden[f"decode{i}/logits"], what=f"decode{i} logits")
        _check_phase(out.intermediates, golden, f"decode{i}", cfg)
    assert int(out.cache.pos) == 48
