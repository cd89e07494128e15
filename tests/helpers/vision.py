"""A tiny MoonViT tower for the vision tests: its config, random weights under the release
names, and random images of two different, non-square grids."""

import numpy as np

from k31jax.config import VisionConfig
from k31jax.vision import release_shapes

TINY = VisionConfig(patch_size=4, hidden_size=24, intermediate_size=48, num_attention_heads=4, qkv_hidden_size=32,
                    num_hidden_layers=2, pos_emb_height=5, pos_emb_width=7, mm_hidden_size=24, text_hidden_size=20)
# Two images of different, non-square grids (rows, columns); 6x4 upsamples the 5x7 table's
# rows and downsamples its columns, 4x10 the other way round.
GRIDS = [(6, 4), (4, 10)]


def release_weights(cfg, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in release_shapes(cfg).items():
        if len(shape) == 1:  # norm weights around 1, not 1
            out[name] = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            out[name] = rng.standard_normal(shape) * (1.0 if "pos_emb" in name else 1.0 / np.sqrt(shape[-1]))
    return out


def patchify(image, p):
    c, h, w = image.shape
    return image.reshape(c, h // p, p, w // p, p).transpose(1, 3, 0, 2, 4).reshape(-1, c, p, p)


def images(cfg, grids, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, (3, h * cfg.patch_size, w * cfg.patch_size)) for h, w in grids]
