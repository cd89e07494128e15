"""The config: presets, the 0-indexed schedule, and clear errors on inconsistent input."""

import copy
import re
import json

import pytest

from helpers.paths import GOLDEN_DIR, REPO_ROOT
from k31jax import ConfigError, ModelConfig, preset_names
from k31jax.config import preset_dir

RELEASE = json.loads((REPO_ROOT / "configs" / "k3.json").read_text())


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
    path = GOLDEN_DIR / "kimi_linear_tiny" / "config.json"
    raw = json.loads(path.read_text())
    nested = ModelConfig.from_hf(raw)
    flat = dict(raw)
    del flat["linear_attn_config"]
    assert ModelConfig.from_hf(flat) == nested
    assert (nested.kda_head_dim, nested.kda_num_heads, nested.kda_conv_size) == (16, 4, 4)


# ---- field-by-field validation: types, ranges, sane upper bounds ----------------------------

@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", "13", "ModelConfig.num_hidden_layers: expected an integer in [1, 4096], got '13' (str)"),
    ("num_hidden_layers", 13.0, "ModelConfig.num_hidden_layers: expected an integer in [1, 4096], got 13.0 (float)"),
    ("num_experts", True, "ModelConfig.num_experts: expected an integer in [0, 65536], got True (bool)"),
    ("vocab_size", None, "ModelConfig.vocab_size: expected an integer in [1, 16777216], got null"),
    ("hidden_size", 1 << 20, "ModelConfig.hidden_size: 1048576 is outside [1, 131072]"),
    ("q_lora_rank", 2.5, "ModelConfig.q_lora_rank: expected an integer in [1, 131072] or null, got 2.5 (float)"),
    ("rms_norm_eps", float("nan"), "ModelConfig.rms_norm_eps: expected a finite number, got nan (float)"),
    ("rms_norm_eps", 0.0, "ModelConfig.rms_norm_eps: 0.0 is out of range (expected > 0.0 and <= 1.0)"),
    ("routed_scaling_factor", "2", "ModelConfig.routed_scaling_factor: expected a finite number, got '2' (str)"),
    ("moe_renormalize", 1, "ModelConfig.moe_renormalize: expected true or false, got 1 (int)"),
    ("dtype", 16, "ModelConfig.dtype: expected a string, got 16 (int)"),
])
def test_fields_are_type_and_range_checked(field, value, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig.preset("tiny", **{field: value})
    assert str(e.value).endswith(message), str(e.value)


@pytest.mark.parametrize("value, message", [
    ("thirteen", "num_hidden_layers: expected an integer in [1, 4096], got 'thirteen' (str)"),
    (None, "num_hidden_layers: expected an integer in [1, 4096], got null"),
    (13.7, "num_hidden_layers: expected an integer in [1, 4096], got 13.7 (float)"),  # never silently 13
    (1e9, "num_hidden_layers: expected an integer in [1, 4096], got 1000000000.0 (float)"),
    (10 ** 9, "num_hidden_layers: 1000000000 is outside [1, 4096]"),  # before the schedule is built
])
def test_from_hf_reads_integers_without_conversion(value, message):
    raw = json.loads((preset_dir() / "tiny.json").read_text())
    raw["text_config"]["num_hidden_layers"] = value
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(raw)
    assert str(e.value) == f"<dict>: {message}"


def test_from_hf_rejects_bad_nested_and_flat_kda_fields():
    raw = json.loads((preset_dir() / "tiny.json").read_text())
    raw["text_config"]["linear_attn_config"]["short_conv_kernel_size"] = "4"
    with pytest.raises(ConfigError, match=r"linear_attn_config\.short_conv_kernel_size: expected an integer"):
        ModelConfig.from_hf(raw)
    raw = json.loads((preset_dir() / "tiny.json").read_text())
    raw["text_config"]["linear_attn_config"]["use_full_rank_gate"] = "yes"
    with pytest.raises(ConfigError, match=r"linear_attn_config\.use_full_rank_gate: expected true or false"):
        ModelConfig.from_hf(raw)
    raw = json.loads((preset_dir() / "tiny.json").read_text())
    raw["text_config"]["linear_attn_config"]["gate_lower_bound"] = float("-inf")
    with pytest.raises(ConfigError, match="gate_lower_bound: expected a finite number or null, got -inf"):
        ModelConfig.from_hf(raw)


def test_from_hf_file_that_is_not_an_object_or_not_utf8(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="list.json: expected a JSON object .* got a list"):
        ModelConfig.from_hf(tmp_path / "list.json")
    (tmp_path / "latin1.json").write_bytes(b'{"model_type": "k\xe9"}')
    with pytest.raises(ConfigError, match=r"latin1.json: not UTF-8 text \(invalid continuation byte at byte 17\)"):
        ModelConfig.from_hf(tmp_path / "latin1.json")


def test_presets_pass_the_field_checks():
    for name in ("k3", "k31_pro", "kimi_linear_48b", "tiny"):
        assert ModelConfig.preset(name).num_hidden_layers > 0


# ---- transformers 5.x configs: null means absent ---------------------------------------------

def _kimi_linear_golden() -> dict:
    return json.loads((GOLDEN_DIR / "kimi_linear_tiny" / "config.json").read_text())


def test_transformers5_nulls_beside_mlp_layer_types_are_absent_keys():
    """transformers 5.x writes `first_k_dense_replace` / `moe_layer_freq` as null beside
    `mlp_layer_types`: the schedule is read off `mlp_layer_types`."""
    raw = _kimi_linear_golden()
    expected = ModelConfig.from_hf(raw)
    v5 = {**raw, "first_k_dense_replace": None, "moe_layer_freq": None,
          "mlp_layer_types": ["sparse" if expected.is_moe_layer(i) else "dense"
                              for i in range(expected.num_hidden_layers)]}
    assert ModelConfig.from_hf(v5) == expected
    assert expected.first_k_dense_replace == 1 and expected.dense_layers == (0,)
    one_null = {**v5, "first_k_dense_replace": 1}
    assert ModelConfig.from_hf(one_null) == expected
    # every other layer MoE from layer 2 (is_moe_layer: i >= k and i % freq == 0)
    n = raw["num_hidden_layers"]
    every_other = {**v5, "mlp_layer_types": ["sparse" if i >= 2 and i % 2 == 0 else "dense" for i in range(n)]}
    cfg = ModelConfig.from_hf(every_other)
    assert (cfg.first_k_dense_replace, cfg.moe_layer_freq) == (2, 2) and cfg.moe_layers == (2, 4, 6)
    assert ModelConfig.from_hf({**every_other, "first_k_dense_replace": 1, "moe_layer_freq": 2}) == \
        cfg.replace(first_k_dense_replace=1)  # the keys, given, say the same schedule
    # nulls without mlp_layer_types: the defaults (every layer MoE)
    bare = {k: v for k, v in v5.items() if k != "mlp_layer_types"}
    assert ModelConfig.from_hf(bare).moe_layers == tuple(range(n))


@pytest.mark.parametrize("mlp, message", [
    (lambda n: ["dense", "sparse", "dense", "sparse", "sparse"] + ["dense"] * (n - 5), "not a schedule of"),
    (lambda n: ["dense"] * (n - 1), "mlp_layer_types has 6 entries, expected num_hidden_layers=7"),
    (lambda n: ["dense", "moe"] + ["sparse"] * (n - 2), "expected a list of 'dense' / 'sparse'"),
])
def test_transformers5_mlp_layer_types_errors_name_the_key(mlp, message):
    raw = _kimi_linear_golden()
    assert raw["num_hidden_layers"] == 7
    v5 = {**raw, "first_k_dense_replace": None, "moe_layer_freq": None, "mlp_layer_types": mlp(7)}
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf(v5)
