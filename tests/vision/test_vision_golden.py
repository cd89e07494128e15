"""MoonViT-V2 against an independent PyTorch peer (tests/golden/make_vision_golden.py, run in the
torch venv): the K3 processor on two differently sized PNGs (one RGBA, both resized), packed
together, then the tower, the 2x2 merge and the projector, within 1e-5 relative in float32."""

import json

import jax
import numpy as np
import pytest

from helpers.model import rel_err
from helpers.paths import GOLDEN_DIR
from k31jax.config import VisionConfig
from k31jax.vision import ImageProcessorConfig, load_vision_model, pack_images, preprocess_image

GOLDEN = GOLDEN_DIR / "vision_tiny.npz"


@pytest.fixture(scope="module")
def golden():
    data = np.load(GOLDEN)
    return {k: data[k] for k in data.files}


def _configs(golden):
    cfg = json.loads(str(golden["config_json"]))
    t, p = cfg["tower"], cfg["processor"]
    vision = VisionConfig(patch_size=t["patch_size"], hidden_size=t["hidden"], intermediate_size=t["mlp"],
                          num_attention_heads=t["heads"], qkv_hidden_size=t["qkv"], num_hidden_layers=t["layers"],
                          pos_emb_height=t["pos_h"], pos_emb_width=t["pos_w"], mm_hidden_size=t["hidden"],
                          text_hidden_size=t["text"], projector_ln_eps=t["projector_eps"])
    processor = ImageProcessorConfig(
        patch_size=p["patch_size"], merge_kernel_size=p["merge_kernel_size"], in_patch_limit=p["in_patch_limit"],
        patch_limit_on_one_side=p["patch_limit_on_one_side"], image_mean=tuple(p["image_mean"]),
        image_std=tuple(p["image_std"]), chessboard_square=p["chessboard_square_size"],
        chessboard_white=p["chessboard_white_value"], chessboard_gray=p["chessboard_gray_value"])
    return vision, processor


def test_preprocessing_matches_the_peer(golden):
    _, processor = _configs(golden)
    images = [preprocess_image(golden[f"image_{i}"].tobytes(), processor) for i in range(2)]
    assert [[1, *im.grid] for im in images] == golden["grid_thws"].tolist()
    assert [im.num_tokens for im in images] == golden["num_tokens"].tolist()
    assert images[0].grid != images[1].grid
    np.testing.assert_allclose(np.concatenate([im.patches for im in images]), golden["pixel_values"], atol=1e-6)


def test_tower_merge_and_projector_match_the_peer(golden):
    vision, processor = _configs(golden)
    weights = {k[2:]: v for k, v in golden.items() if k.startswith("w:")}
    images = [preprocess_image(golden[f"image_{i}"].tobytes(), processor) for i in range(2)]
    inputs = pack_images([im.patches for im in images], [im.grid for im in images], vision)
    model = load_vision_model(weights, vision, dtype="float32")
    got = jax.jit(lambda m, x: m.features(x))(model, inputs)
    for key in ("tower", "merged", "projected"):
        assert rel_err(got[key], golden[key]) < 1e-5, (key, rel_err(got[key], golden[key]))
