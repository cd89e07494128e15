"""Full-scale shapes and counts, on paper only (`nnx.eval_shape`; nothing is allocated)."""

import subprocess
import sys

import jax
import numpy as np
from flax import nnx

from k31jax import ModelConfig, abstract_model, count_params

K3_TEXT = 2_779_484_478_208
K3_ACTIVE = 104_189_614_848
INDEXER_PER_LAYER = 13_959_424
K3_TEXT_BYTES = 1_560_860_324_864 - 2 * (401_214_464 + 46_144_512)  # release bytes minus vision


def test_k3_counts():
    c = count_params(ModelConfig.preset("k3"))
    assert c.total == K3_TEXT
    assert c.active_excluding_embedding == K3_ACTIVE
    assert c.by_component["routed_experts"] == 2_722_740_830_208
    assert c.by_component["kda_mixer"] == 69 * 443_740_416
    assert c.by_component["mla_mixer"] == 24 * 232_196_096
    assert c.by_component["layer_norms"] == 93 * 43_008
    assert c.by_component["dense_mlp"] == 726_663_168
    assert c.by_component["moe_non_expert"] == 92 * 189_927_808
    assert c.by_component["embed_head"] == 2_348_831_744
    assert c.by_component["indexer"] == 0
    assert c.f32_params == 11_122_432
    assert c.bytes() == K3_TEXT_BYTES


def test_k31_pro_adds_the_indexer():
    c = count_params(ModelConfig.preset("k31_pro"))
    assert c.by_component["indexer"] == 24 * INDEXER_PER_LAYER
    assert c.total == K3_TEXT + 335_026_176
    assert c.active_excluding_embedding == 104_524_641_024


def test_abstract_model_allocates_nothing_and_has_logical_axes():
    model = abstract_model(ModelConfig.preset("k31_pro"))
    state = nnx.state(model, nnx.Param)
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert all(isinstance(v.get_value(), jax.ShapeDtypeStruct) for v in leaves)
    w = model.moe.w_gate  # the release config keeps experts packed: 2 E2M1 codes per byte
    assert w.packed.shape == (92, 896, 3072, 3584 // 2) and w.packed.dtype == np.uint8
    assert w.scale.shape == (92, 896, 3072, 3584 // 32)
    assert w.packed.get_metadata()["out_sharding"] == ("layers", "expert", "expert_mlp", "latent")
    for v in leaves:  # every parameter names an axis for every dimension
        assert len(v.get_metadata()["out_sharding"]) == len(v.shape)
    assert model.mla.indexer.wq_b.shape == (24, 1536, 64 * 128)


def test_kimi_linear_48b_is_about_48b():
    c = count_params(ModelConfig.preset("kimi_linear_48b"))
    assert 48e9 < c.total < 50e9
    assert 2.9e9 < c.active_excluding_embedding < 3.3e9


def test_info_cli_prints_the_totals():
    for name, total, active in (("k3", K3_TEXT, K3_ACTIVE), ("k31_pro", K3_TEXT + 335_026_176, 104_524_641_024)):
        out = subprocess.run([sys.executable, "-m", "k31jax.cli", "info", "--config", name],
                             capture_output=True, text=True, check=True).stdout
        assert f"{total:,}" in out and f"{active:,}" in out
        assert "routed experts" in out and "29,595,009,024" in out
