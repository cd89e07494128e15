"""Loading the vision tower and projector with the text model, and sharding it.

A 2-layer tiny text model with a tiny MoonViT (the `TINY` tower of `helpers.vision` at the
text width) written in the release layout from known tensors, then converted to Orbax:
- `load_checkpoint(vision=True)` and `load_hf_weights(vision=True)` return the text model
  and a `VisionModel` whose parameters and forward (tower, merge, projector on two packed
  images of different sizes) equal those of the model built from the source tensors;
  `load_checkpoint_vision` reads the vision model alone from either folder;
- a checkpoint whose config has no `vision_config`, or whose vision tensors were dropped at
  conversion, is an error naming the folder and what is missing;
- restored onto 8 fake CPU devices (`load_sharded(..., vision=True)`), the tower is tensor
  parallel over heads and MLP width (checked on the placed parameters, and equal to
  `shard_model`'s placement) and its forward equals the single-device one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from helpers.model import rel_err
from helpers.release import release_ready_model
from helpers.vision import GRIDS, TINY, images, patchify, release_weights
from k31jax import convert, sharding
from k31jax.ckpt import (CheckpointError, ModelWithVision, load_checkpoint, load_checkpoint_vision,
                         load_hf_weights)
from k31jax.ckpt._synthetic import write_synthetic_release
from k31jax.distributed import load_sharded, shard_model
from k31jax.vision import VisionLoadError, VisionModel, load_vision_model, pack_images

TEXT = dict(num_hidden_layers=2, layer_types=("kda", "mla"))
features = jax.jit(lambda m, x: m.features(x))


def leaves(module) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(module, nnx.Param)))}


def spec(param) -> tuple:
    s = tuple(param[...].sharding.spec)
    return s + (None,) * (param.ndim - len(s))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(release folder, Orbax checkpoint, text model, source vision tensors, packed images)."""
    model, params = release_ready_model(seed=5, **TEXT)
    vcfg = dataclasses.replace(TINY, text_hidden_size=model.config.hidden_size)
    cfg = model.config.replace(vision=vcfg)
    # The release stores BF16: source values that bf16 holds exactly, so every path is exact.
    weights = {n: v.astype(ml_dtypes.bfloat16).astype(np.float32) for n, v in release_weights(vcfg, seed=9).items()}
    root = tmp_path_factory.mktemp("vision_loading")
    src = write_synthetic_release(root / "release", cfg, params=params, vision_config=vcfg.to_hf(),
                                  vision_params=weights, num_shards=2)
    dst = convert(src, root / "orbax").dst
    inputs = pack_images([patchify(im, vcfg.patch_size) for im in images(vcfg, GRIDS)], GRIDS, vcfg)
    return src, dst, model, weights, vcfg, inputs


@pytest.fixture(scope="module")
def source_features(folders):
    _, _, _, weights, vcfg, inputs = folders
    return features(load_vision_model(weights, vcfg, dtype="float32"), inputs)


def test_text_and_vision_load_together_from_orbax_and_release(folders, source_features):
    src, dst, model, weights, vcfg, inputs = folders
    source = leaves(load_vision_model(weights, vcfg, dtype="float32"))
    from_orbax = load_checkpoint(dst, dtype=jnp.float32, vision=True)
    from_release = load_hf_weights(src, dtype="float32", vision=True)
    text_params = leaves(model)
    for loaded in (from_orbax, from_release):
        assert isinstance(loaded, ModelWithVision) and isinstance(loaded.vision, VisionModel)
        text, vision = loaded  # unpacks like a pair
        assert text.config.vision == vcfg
        got = leaves(text)
        assert got.keys() == text_params.keys()
        for k in text_params:
            np.testing.assert_array_equal(got[k], text_params[k], err_msg=k)
        got = leaves(vision)
        assert got.keys() == source.keys()
        for k in source:
            assert got[k].dtype == np.float32
            np.testing.assert_array_equal(got[k], source[k], err_msg=k)
        out = features(vision, inputs)  # same structure and shapes: the source's compiled forward
        for key in ("tower", "merged", "projected"):
            np.testing.assert_array_equal(np.asarray(out[key]), np.asarray(source_features[key]), err_msg=key)
    assert source_features["projected"].shape == (sum(h * w // 4 for h, w in GRIDS), vcfg.text_hidden_size)
    # Without the flag the return value is the text model, as before.
    assert type(load_checkpoint(dst, dtype=jnp.float32)).__name__ == "K31ForCausalLM"

    # The vision model alone: bf16 by default from Orbax (as `load_checkpoint`), the config's
    # dtype (float32 here) by default from a release folder (as `load_hf_weights`).
    for alone in (load_checkpoint_vision(dst), load_checkpoint_vision(src, dtype="bfloat16")):
        assert alone.tower.blocks.wqkv[...].dtype == jnp.bfloat16
        for k, v in leaves(alone).items():
            np.testing.assert_array_equal(v.astype(np.float32), source[k], err_msg=k)


def test_missing_vision_config_or_tensors_name_the_folder(folders, tmp_path):
    src, _, model, _, _, _ = folders
    text_only = write_synthetic_release(tmp_path / "text-only", model.config.replace(vision=None), num_shards=1)
    ckpt = convert(text_only, tmp_path / "text-only-orbax").dst
    for load in (lambda: load_hf_weights(text_only, vision=True), lambda: load_checkpoint_vision(text_only),
                 lambda: load_checkpoint(ckpt, vision=True), lambda: load_checkpoint_vision(ckpt)):
        with pytest.raises(CheckpointError, match="text-only.*: vision=True, but the checkpoint's config has no "
                                                  "vision_config"):
            load()
    dropped = convert(src, tmp_path / "no-vision-tensors", vision=False).dst
    with pytest.raises(VisionLoadError, match=r"no-vision-tensors: missing vision tensors \['mm_projector"):
        load_checkpoint(dropped, vision=True)


def test_sharded_restore_is_tensor_parallel_and_equals_single_device(folders, source_features):
    _, dst, _, weights, vcfg, inputs = folders
    mesh = sharding.make_mesh(tensor=4, data=2)
    model, vision = load_sharded(dst, mesh, dtype=jnp.float32, vision=True)
    blocks = vision.tower.blocks
    assert spec(blocks.wqkv) == (None, None, None, "tensor")  # [layers, D, q|k|v, heads*hd]
    assert spec(blocks.wo) == (None, "tensor", None)
    assert spec(blocks.fc0) == (None, None, "tensor") and spec(blocks.fc1) == (None, "tensor", None)
    assert spec(vision.projector.proj0) == (None, "tensor") and spec(vision.projector.proj2) == ("tensor", None)
    shard = blocks.wqkv[...].addressable_shards[0].data
    assert shard.shape == (vcfg.num_hidden_layers, vcfg.hidden_size, 3, vcfg.qkv_hidden_size // 4)  # one head each
    assert spec(model.embed) != (None, None)  # the text model is placed on the same mesh
    # `shard_model` of a single-device VisionModel places it the same way (same rule tables).
    placed = shard_model(load_vision_model(weights, vcfg, dtype="float32"), mesh)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(placed, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(vision, nnx.Param))):
        assert a[...].sharding.spec == b[...].sharding.spec, path
    replicated = NamedSharding(mesh, PartitionSpec())  # one sharding for every parameter: vision's too
    _, vision_replicated = load_checkpoint(dst, dtype=jnp.float32, shardings=replicated, vision=True)
    assert vision_replicated.tower.blocks.wqkv[...].sharding == replicated
    with sharding.activate(mesh):
        out = jax.jit(lambda m, x: m.features(x))(vision, inputs)
    for key in ("tower", "merged", "projected"):
        assert rel_err(out[key], source_features[key]) < 1e-5, key
