"""MoonViT-V2 tower, merge, projector, loading and sharding against the float64 references
(tests/refs/vision.py, written from vision.md); parameter counts of the K3 tower.

Covers: each op vs its reference (patch embedding = the Conv2d, bilinear position resize
without antialias incl. the identity case, the 2-D RoPE angle layout, packed attention that
never crosses images, dense == blockwise, merge order, projector), the whole model on two
packed images of different sizes, the release-name loader (dict and safetensors, errors
naming the tensor), sharded == single device on 8 fake CPU devices, `VisionConfig` reading,
and the K3 counts on the abstract model (and in `k31jax info`)."""

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.model import rel_err
from helpers.vision import GRIDS, TINY, images, patchify, release_weights
from k31jax import sharding
from k31jax.config import ConfigError, ModelConfig, VisionConfig, preset_dir
from k31jax.vision import (VisionLoadError, count_vision_params, load_vision_model, pack_images, release_shapes,
                           vision_state)
from k31jax.vision import _ops
from k31jax.vision._layout import bilinear_taps
from refs import vision as RV


def reference(weights, imgs, grids, cfg):
    tower_w = {k[len("vision_tower."):]: v for k, v in weights.items() if k.startswith("vision_tower.")}
    proj_w = {k[len("mm_projector."):]: v for k, v in weights.items() if k.startswith("mm_projector.")}
    rc = dict(num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads, patch_size=cfg.patch_size,
              eps=cfg.norm_eps)
    tower = [RV.tower(im, tower_w, rc) for im in imgs]
    merged = [RV.merge_2x2(t, *g) for t, g in zip(tower, grids)]
    projected = [RV.projector(m, proj_w, cfg.projector_ln_eps) for m in merged]
    return {k: np.concatenate(v) for k, v in (("tower", tower), ("merged", merged), ("projected", projected))}


@pytest.fixture(scope="module")
def case():
    weights = release_weights(TINY)
    imgs = images(TINY, GRIDS)
    inputs = pack_images([patchify(im, TINY.patch_size) for im in imgs], GRIDS, TINY)
    return weights, imgs, inputs, reference(weights, imgs, GRIDS, TINY)


features = jax.jit(lambda m, x: m.features(x))


# ----------------------------------------------------------------------------- ops


def test_patch_embed_is_the_conv():
    rng = np.random.default_rng(2)
    image, weight = rng.standard_normal((3, 12, 20)), rng.standard_normal((7, 3, 4, 4))
    got = _ops.patch_embed(jnp.asarray(patchify(image, 4), jnp.float32),
                           jnp.asarray(weight.reshape(7, -1).T, jnp.float32))
    assert rel_err(got, RV.conv_patch_embed(image, weight)) < 1e-5


@pytest.mark.parametrize("grid", [(5, 7), (3, 11), (9, 2), (1, 1)])
def test_position_table_resize_is_bilinear_without_antialias(grid):
    table = np.random.default_rng(3).standard_normal((5, 7, 6))
    idx, w = bilinear_taps(*grid, 5, 7)
    got = _ops.position_embedding(jnp.asarray(table, jnp.float32), jnp.asarray(idx), jnp.asarray(w, jnp.float32))
    want = RV.resize_bilinear(table, *grid).reshape(-1, 6)
    assert rel_err(got, want) < 1e-6
    if grid == (5, 7):  # the table itself, untouched
        np.testing.assert_array_equal(np.asarray(got), table.reshape(-1, 6).astype(np.float32))


def test_rope_angle_layout_and_rotation():
    head_dim, (h, w) = 16, (3, 5)
    rows, cols = np.divmod(np.arange(h * w), w)
    angles = np.asarray(_ops.rope_angles(jnp.asarray(np.stack([rows, cols], -1)), head_dim))
    freqs = 10000.0 ** (-4 * np.arange(4) / head_dim)
    np.testing.assert_allclose(angles[7, 0::2], cols[7] * freqs, rtol=1e-6)  # even slots: column x
    np.testing.assert_allclose(angles[7, 1::2], rows[7] * freqs, rtol=1e-6)  # odd slots: row y
    x = np.random.default_rng(4).standard_normal((h * w, 2, head_dim))
    got = _ops.apply_rope_2d(jnp.asarray(x, jnp.float32), jnp.asarray(angles))
    assert rel_err(got, RV.rope_2d(x, h, w)) < 1e-6


@pytest.mark.parametrize("block", [1024, 8, 5])
def test_packed_attention_stays_inside_each_image(block):
    rng = np.random.default_rng(5)
    lengths = [7, 12, 3]
    q, k, v = (rng.standard_normal((sum(lengths), 2, 8)) for _ in range(3))
    seg = np.repeat(np.arange(3), lengths).astype(np.int32)
    run = lambda q, k, v: _ops.packed_attention(*(jnp.asarray(t, jnp.float32) for t in (q, k, v)),  # noqa: E731
                                                jnp.asarray(seg), 8 ** -0.5, block_size=block)
    got = np.asarray(run(q, k, v))
    starts = np.cumsum([0] + lengths)
    want = np.concatenate([RV.attention(q[a:b], k[a:b], v[a:b]) for a, b in zip(starts[:-1], starts[1:])])
    assert rel_err(got, want) < 1e-5
    k2, v2 = k.copy(), v.copy()
    k2[starts[1]:], v2[starts[1]:] = 100.0, -100.0  # other images' keys and values change ...
    np.testing.assert_allclose(np.asarray(run(q, k2, v2))[:starts[1]], got[:starts[1]], rtol=1e-6)  # ... image 0 not


def test_merge_order_is_tl_tr_bl_br():
    x = np.random.default_rng(6).standard_normal((4 * 6, 3))
    inputs = pack_images([np.zeros((24, 3, 4, 4))], [(4, 6)], TINY)
    got = _ops.merge_patches(jnp.asarray(x, jnp.float32), jnp.asarray(inputs.merge_index))
    assert rel_err(got, RV.merge_2x2(x, 4, 6)) < 1e-7
    np.testing.assert_array_equal(inputs.merge_index[1], [2, 3, 8, 9])  # token (0, 1): patches (0,2) (0,3) (1,2) (1,3)


def test_projector():
    rng = np.random.default_rng(7)
    x, w0, w2, norm = rng.standard_normal((5, 16)), rng.standard_normal((16, 16)) / 4, rng.standard_normal((9, 16)) / 4, \
        1 + 0.2 * rng.standard_normal(9)
    got = _ops.project(jnp.asarray(x, jnp.float32), jnp.asarray(w0.T, jnp.float32), jnp.asarray(w2.T, jnp.float32),
                       jnp.asarray(norm, jnp.float32), 1e-5)
    want = RV.projector(x, {"proj.0.weight": w0, "proj.2.weight": w2, "post_norm.weight": norm}, 1e-5)
    assert rel_err(got, want) < 1e-5


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("block", [1024, 16])
def test_model_on_two_packed_images_matches_the_reference(case, block):
    weights, _, inputs, want = case
    got = features(load_vision_model(weights, TINY, dtype="float32", attention_block=block), inputs)
    assert got["tower"].shape == (sum(h * w for h, w in GRIDS), TINY.hidden_size)
    assert got["projected"].shape == (sum(h * w // 4 for h, w in GRIDS), TINY.text_hidden_size)
    for key in ("tower", "merged", "projected"):
        assert rel_err(got[key], want[key]) < 1e-5, key


def test_bf16_model_stays_close(case):
    weights, _, inputs, want = case
    got = features(load_vision_model(weights, TINY, dtype="bfloat16"), inputs)
    assert got["projected"].dtype == jnp.bfloat16
    assert rel_err(got["projected"], want["projected"]) < 0.1


def test_loader_reads_safetensors_and_names_bad_tensors(case, tmp_path):
    from k31jax.ckpt import SafetensorsIndex, ShardWriter

    weights, _, inputs, want = case
    entries = [(n, "F32", tuple(v.shape)) for n, v in weights.items()]
    with ShardWriter(tmp_path / "model.safetensors", entries) as w:
        for n, v in weights.items():
            w.write(n, v.astype(np.float32))
    got = features(load_vision_model(SafetensorsIndex(tmp_path), TINY, dtype="float32"), inputs)
    assert rel_err(got["projected"], want["projected"]) < 1e-5

    missing = {k: v for k, v in weights.items() if "blocks.1.wo" not in k}
    with pytest.raises(VisionLoadError, match=r"missing vision tensors \['vision_tower.encoder.blocks.1.wo.weight'\]"):
        vision_state(missing, TINY)
    extra = {**weights, "vision_tower.encoder.blocks.2.wo.weight": np.zeros((24, 32))}
    with pytest.raises(VisionLoadError, match="blocks.2.wo.weight.*vt_num_hidden_layers=2"):
        vision_state(extra, TINY)
    bad = {**weights, "mm_projector.proj.2.weight": np.zeros((20, 95))}
    with pytest.raises(VisionLoadError, match=r"mm_projector.proj.2.weight: shape \[20, 95\], expected \[20, 96\]"):
        vision_state(bad, TINY)


def test_sharded_equals_single_device(case):
    """Tensor parallel over the heads and the MLP width on 8 fake CPU devices."""
    weights, _, inputs, _ = case
    single = features(load_vision_model(weights, TINY, dtype="float32"), inputs)
    mesh = sharding.make_mesh(tensor=4, data=2)
    with sharding.activate(mesh):
        model = load_vision_model(weights, TINY, dtype="float32", mesh=mesh)
        spec = lambda p: tuple(p[...].sharding.spec) + (None,) * (p.ndim - len(p[...].sharding.spec))  # noqa: E731
        assert spec(model.tower.blocks.wqkv) == (None, None, None, "tensor")  # [layers, D, q|k|v, heads]
        assert spec(model.tower.blocks.wo) == (None, "tensor", None)
        assert spec(model.tower.blocks.fc0) == (None, None, "tensor")
        assert spec(model.projector.proj0) == (None, "tensor")
        sharded = jax.jit(lambda m, x: m.features(x))(model, inputs)
    for key in ("tower", "merged", "projected"):
        assert rel_err(sharded[key], single[key]) < 1e-5, key


# ----------------------------------------------------------------------------- config and counts


def test_k3_counts_on_the_abstract_model():
    cfg = ModelConfig.preset("k3").vision
    counts = count_vision_params(cfg)
    assert counts == {"tower": 401_214_464, "projector": 46_144_512}
    assert sum(int(np.prod(s)) for s in release_shapes(cfg).values()) == 401_214_464 + 46_144_512


def test_info_cli_prints_the_vision_counts():
    out = subprocess.run([sys.executable, "-m", "k31jax.cli", "info", "--config", "k3"],
                         capture_output=True, text=True, check=True).stdout
    assert "vision tower" in out and "401,214,464" in out
    assert "projector (patch merger)" in out and "46,144,512" in out


def test_vision_config_reads_the_release():
    raw = json.loads((preset_dir() / "k3.json").read_text())
    v = ModelConfig.from_hf(raw).vision
    assert (v.hidden_size, v.num_hidden_layers, v.head_dim, v.merged_hidden_size) == (1024, 27, 128, 4096)
    assert v.norm_eps == 2.0 ** -23 and v.projector_ln_eps == 1e-5 and v.media_placeholder_token_id == 163605
    assert VisionConfig.from_hf(v.to_hf()) == v
    d = dataclasses.asdict(ModelConfig.from_hf(raw))  # the trainer's JSON round trip
    assert ModelConfig(**{**d, "layer_types": tuple(d["layer_types"])}).vision == v
    assert ModelConfig.preset("tiny").vision is None

    for key, value, message in (("pos_emb_interpolation_mode", "bicubic", "implements 'bilinear'"),
                                ("attn_bias", True, "attn_bias=True"),
                                ("vt_num_attention_heads", 7, "not a multiple of num_attention_heads=7")):
        broken = json.loads(json.dumps(raw))
        broken["vision_config"][key] = value
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_hf(broken)
    broken = json.loads(json.dumps(raw))
    broken["vision_config"]["video_attn_type"] = "spatial"
    with pytest.raises(ConfigError, match="vision_config.video_attn_type"):
        ModelConfig.from_hf(broken)
    assert ModelConfig.from_hf(broken, allow_unknown=True).vision == v


def test_references_sanity():
    """The float64 references on cases with known answers (they are the yardstick above)."""
    const = np.full((5, 7, 3), 2.5)
    np.testing.assert_allclose(RV.resize_bilinear(const, 9, 4), 2.5, rtol=1e-14)  # a constant stays constant
    ramp = np.arange(4.0)[None, :, None] * np.ones((1, 1, 1))
    np.testing.assert_allclose(RV.resize_bilinear(ramp, 1, 8)[0, :, 0],  # 2x upsampling of 0..3, edges clamped
                               [0, 0.25, 0.75, 1.25, 1.75, 2.25, 2.75, 3], rtol=1e-14)
    x = np.random.default_rng(8).standard_normal((6, 2, 8))
    np.testing.assert_allclose(np.linalg.norm(RV.rope_2d(x, 2, 3), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(RV.rope_2d(x, 2, 3)[0], x[0], rtol=1e-14)  # patch (0, 0) is not rotated
    feats = np.arange(4 * 4)[:, None].astype(float)
    np.testing.assert_array_equal(RV.merge_2x2(feats, 4, 4),
                                  [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]])
    assert RV.navit_size(10000, 10000)[2:4] == (3612, 3612) and RV.navit_size(28, 28)[4] == 1
