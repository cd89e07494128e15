"""The config: presets, the 0-indexed schedule, and clear errors on inconsistent input."""

import copy
import json
from pathlib import Path

import pytest

from k31jax import ConfigError, ModelConfig, preset_names

RELEASE = json.loads((Path(__file__).resolve().parents[1] / "configs" / "k3.json").read_text())


def test_presets_parse():
    assert {"k3", "k31_pro", "kimi_linear_48b", "tiny"} <= set(preset_names())
    for name in preset_names():
        ModelConfig.preset(name)


def test_k3_schedule_is_zero_indexed():
    cfg = ModelConfig.preset("k3")
    assert cfg.mla_layers == tuple(range(3, 92, 4)) + (92,)
    assert len(cfg.kda_layers) == 69 and 0 in cfg.kda_layers
    assert cfg.dense_layers == (0,) and len(cfg.moe_layers) == 92
    assert cfg.num_attn_res_slots == 8 and cfg.kda_a_log_len == 128
    assert cfg.routed_scaling_factor == 1.0 and cfg.qk_head_dim == 192
    assert cfg.index_topk is None


def test_k31_pro_and_tiny():
    pro = ModelConfig.preset("k31_pro")
    assert (pro.index_topk, pro.index_n_heads, pro.index_head_dim) == (2048, 64, 128)
    tiny = ModelConfig.preset("tiny")
    assert tiny.num_hidden_layers >= 9 and tiny.layer_types[-1] == "mla" and tiny.layer_types[-2] == "mla"
    assert tiny.attn_res_block_size == 3 and tiny.num_attn_res_slots >= 4
    assert tiny.use_indexer and tiny.index_topk < 45
    assert 8 <= tiny.num_experts <= 16 and 2 <= tiny.num_experts_per_token <= 4
    assert tiny.num_shared_experts == 2 and tiny.latent_moe and tiny.kda_full_rank_gate
    assert tiny.kda_gate_lower_bound == -5.0 and tiny.mla_use_output_gate


def test_kimi_linear_switches():
    kl = ModelConfig.preset("kimi_linear_48b")
    assert kl.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert kl.kda_gate_lower_bound is None and not kl.kda_full_rank_gate
    assert kl.attn_res_block_size is None and kl.hidden_act == "silu" and not kl.latent_moe
    assert kl.q_lora_rank is None and not kl.mla_use_output_gate and kl.kda_a_log_len == 32


def _broken(mutate):
    raw = copy.deepcopy(RELEASE)
    mutate(raw["text_config"])
    return raw


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t["linear_attn_config"]["kda_layers"].remove(1), "missing [1]"),
    (lambda t: t["linear_attn_config"]["kda_layers"].append(4), "in both"),
    (lambda t: t["linear_attn_config"]["full_attn_layers"].append(94), "out of range [94]"),
    (lambda t: t.update(index_share_layers=2), "index_share_layers"),
    (lambda t: t.update(indexer_rope=True), "indexer_rope"),
    (lambda t: t.update(index_topk=2048), "index_n_heads"),
    (lambda t: t.update(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
    (lambda t: t.update(num_experts_per_token=1000), "num_experts_per_token"),
    (lambda t: t.update(num_expert_group=5), "num_expert_group"),
    (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
    (lambda t: t.pop("hidden_size"), "hidden_size"),
    (lambda t: t["linear_attn_config"].update(sliding_window=4), "sliding_window"),
])
def test_errors_name_the_field(mutate, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_hf(_broken(mutate))


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="no such config"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)


def test_direct_construction_is_validated():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ConfigError, match="layer_types"):
        cfg.replace(layer_types=cfg.layer_types[:-1])
    with pytest.raises(ConfigError, match="q_lora_rank"):
        cfg.replace(q_lora_rank=None)
    with pytest.raises(ConfigError, match="kda_a_log_len"):
        cfg.replace(kda_a_log_len=2)


@pytest.mark.parametrize("key,value", [("rope_theta", 10000.0), ("sliding_window", 4096), ("use_sliding_window", True),
                                       ("rope_scaling", {"type": "yarn"})])
def test_unknown_keys_are_rejected_by_name(key, value):
    raw = _broken(lambda t: t.update({key: value}))
    with pytest.raises(ConfigError, match=f"unknown config keys \\['{key}'\\]"):
        ModelConfig.from_hf(raw)
    assert ModelConfig.from_hf(raw, allow_unknown=True) == ModelConfig.from_hf(RELEASE)


def test_generic_transformers_keys_are_ignored():
    raw = _broken(lambda t: t.update(use_cache=True, transformers_version="5.0", torchscript=False, top_p=0.9))
    assert ModelConfig.from_hf(raw) == ModelConfig.from_hf(RELEASE)


@pytest.mark.parametrize("mutate,message", [
    (lambda t: t.update(num_key_value_heads=1), "num_key_value_heads=1"),
    (lambda t: t.update(qk_head_dim=7), "qk_head_dim=7"),
    (lambda t: t.update(attention_bias=True), "attention_bias"),
    (lambda t: t.update(topk_method="greedy"), "topk_method"),
    (lambda t: t.update(linear_head_dim=3), "linear_head_dim=3"),
    (lambda t: t.update(mlp_layer_types=["dense"] * t["num_hidden_layers"]), "mlp_layer_types"),
])
def test_restated_keys_must_agree(mutate, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_broken(mutate))


def test_transformers_flat_kimi_linear_layout():
    """transformers re-saves Kimi Linear with flat `linear_*` keys and `layer_types`; without
    `linear_attn_config` those alone give the same config."""
    path = Path(__file__).parent / "golden" / "kimi_linear_tiny" / "config.json"
    raw = json.loads(path.read_text())
    nested = ModelConfig.from_hf(raw)
    flat = dict(raw)
    del flat["linear_attn_config"]
    assert ModelConfig.from_hf(flat) == nested
    assert (nested.kda_head_dim, nested.kda_num_heads, nested.kda_conv_size) == (16, 4, 4)
