"""Thin NNX modules over the vision ops: the MoonViT-V2 tower, the patch-merger projector, and
the two together. Parameters carry logical axis names (tensor parallel over the attention
heads and the MLP width under the `k31jax.sharding` rules); nothing here computes on its own.

Parameter layout (release name -> here, spec checkpoint_format.md §3.7):
- `patch_embed.proj.weight` [D, 3, p, p] -> `patch_embed` [3*p*p, D] (Conv2d as a Linear);
- `patch_embed.pos_emb.weight` [64, 64, D] -> `pos_emb` as is;
- blocks (stacked on a leading "layers" axis): `wqkv` [3*H*hd, D] -> [D, 3, H*hd]; `wo`
  [D, H*hd] -> [H*hd, D]; `mlp.fc0` / `mlp.fc1` -> `fc0` [D, F] / `fc1` [F, D]; norms as is;
- projector: `proj.0` / `proj.2` [out, in] -> `proj0` / `proj2` [in, out]; `post_norm` as is.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import VisionConfig
from ..nn import constant, normal
from ..sharding import constrain
from . import _ops
from ._layout import VisionInputs
from ._preprocess import ImageProcessorConfig


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype, *, rngs: nnx.Rngs):
        d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.qkv_hidden_size
        self.norm0 = constant((d,), 1.0, dtype, ("norm",))
        self.wqkv = normal(rngs, (d, 3, e), 1 / math.sqrt(d), dtype, ("embed", None, "heads"))
        self.wo = normal(rngs, (e, d), 1 / math.sqrt(e), dtype, ("heads", "embed"))
        self.norm1 = constant((d,), 1.0, dtype, ("norm",))
        self.fc0 = normal(rngs, (d, f), 1 / math.sqrt(d), dtype, ("embed", "mlp"))
        self.fc1 = normal(rngs, (f, d), 1 / math.sqrt(f), dtype, ("mlp", "embed"))


def _stacked_blocks(cfg: VisionConfig, dtype, rngs: nnx.Rngs) -> VisionBlock:
    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(r):
        return VisionBlock(cfg, dtype, rngs=r)

    return build(rngs)


class VisionTower(nnx.Module):
    """MoonViT-V2: `tower(inputs) -> [N, D]`, the final-normed features of every packed patch."""

    def __init__(self, cfg: VisionConfig, dtype="bfloat16", *, rngs: nnx.Rngs, attention_block: int = 1024):
        dt = jnp.dtype(dtype)
        d, p = cfg.hidden_size, cfg.patch_size
        self.cfg = cfg
        self.attention_block = attention_block
        self.patch_embed = normal(rngs, (3 * p * p, d), 1 / math.sqrt(3 * p * p), dt, (None, "embed"))
        self.pos_emb = normal(rngs, (cfg.pos_emb_height, cfg.pos_emb_width, d), 1.0, dt, (None, None, "embed"))
        self.blocks = _stacked_blocks(cfg, dt, rngs)
        self.final_norm = constant((d,), 1.0, dt, ("norm",))

    def __call__(self, inputs: VisionInputs) -> jax.Array:
        cfg = self.cfg
        x = _ops.patch_embed(jnp.asarray(inputs.patches), self.patch_embed[...])
        x = x + _ops.position_embedding(self.pos_emb[...], inputs.pos_index, inputs.pos_weight)
        x = constrain(x, "seq", "act_embed")
        angles = _ops.rope_angles(jnp.asarray(inputs.positions), cfg.head_dim)
        segment_ids = jnp.asarray(inputs.segment_ids)
        blocks = nnx.to_pure_dict(nnx.state(self.blocks, nnx.Param))

        def step(x, p):
            x = _ops.vision_block(x, p, angles, segment_ids, num_heads=cfg.num_attention_heads,
                                  eps=cfg.norm_eps, block_size=self.attention_block)
            return constrain(x, "seq", "act_embed"), None

        x, _ = jax.lax.scan(step, x, blocks)
        return _ops.rms_norm(x, self.final_norm[...], cfg.norm_eps)


class VisionProjector(nnx.Module):
    """`patchmergerv2`: merged tokens [M, kh*kw*D] -> text embeddings [M, text_hidden_size]."""

    def __init__(self, cfg: VisionConfig, dtype="bfloat16", *, rngs: nnx.Rngs):
        dt = jnp.dtype(dtype)
        m, t = cfg.merged_hidden_size, cfg.text_hidden_size
        self.cfg = cfg
        self.proj0 = normal(rngs, (m, m), 1 / math.sqrt(m), dt, (None, "mlp"))
        self.proj2 = normal(rngs, (m, t), 1 / math.sqrt(m), dt, ("mlp", "embed"))
        self.post_norm = constant((t,), 1.0, dt, ("norm",))

    def __call__(self, merged: jax.Array) -> jax.Array:
        return _ops.project(merged, self.proj0[...], self.proj2[...], self.post_norm[...], self.cfg.projector_ln_eps)


class VisionModel(nnx.Module):
    """Tower + 2x2 merge + projector: `model(inputs) -> [M, text_hidden_size]`, one row per
    `<|media_pad|>` token, images in packing order (`features` also returns the stages).
    `processor`: the image processor's settings for this tower (the K3 values at its patch
    and merge sizes; a checkpoint's `preprocessor_config.json` replaces them when loaded)."""

    def __init__(self, cfg: VisionConfig, dtype="bfloat16", *, rngs: nnx.Rngs, attention_block: int = 1024):
        self.tower = VisionTower(cfg, dtype, rngs=rngs, attention_block=attention_block)
        self.projector = VisionProjector(cfg, dtype, rngs=rngs)
        self.processor = ImageProcessorConfig(patch_size=cfg.patch_size, merge_kernel_size=cfg.merge_kernel_size[0])

    def features(self, inputs: VisionInputs) -> dict[str, jax.Array]:
        tower = self.tower(inputs)
        merged = _ops.merge_patches(tower, jnp.asarray(inputs.merge_index))
        return {"tower": tower, "merged": merged, "projected": self.projector(merged)}

    def __call__(self, inputs: VisionInputs) -> jax.Array:
        return self.features(inputs)["projected"]


def abstract_vision_model(cfg: VisionConfig, dtype="bfloat16", *, attention_block: int = 1024) -> VisionModel:
    """The model with abstract parameters (shapes, dtypes, logical axes; nothing allocated)."""
    return nnx.eval_shape(lambda: VisionModel(cfg, dtype, rngs=nnx.Rngs(0), attention_block=attention_block))


def count_vision_params(cfg: VisionConfig) -> dict[str, int]:
    """`{"tower": ..., "projector": ...}` parameter counts, on the abstract model."""
    model = abstract_vision_model(cfg)
    count = lambda m: sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    return {"tower": count(model.tower), "projector": count(model.projector)}
