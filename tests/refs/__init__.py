"""Independent float64 NumPy references for k31jax, written from the specification only (restated in docs/).

Never translated from k31jax code. See common.py, kda.py, attention.py, moe.py.
"""

from .attention import indexer_scores, indexer_select, mla_latents, mla_layer
from .common import (attn_res_mix, l2_normalize, layer_norm, rms_norm, short_conv, sigmoid,
                     silu, situ_glu, softmax, softplus_torch, swiglu)
from .kda import kda_gate, kda_layer, kda_recurrent
from .moe import dense_mlp, latent_moe, route

__all__ = [
    "attn_res_mix", "dense_mlp", "indexer_scores", "indexer_select", "kda_gate", "kda_layer",
    "kda_recurrent", "l2_normalize", "latent_moe", "layer_norm", "mla_latents", "mla_layer",
    "rms_norm", "route", "short_conv", "sigmoid", "silu", "situ_glu", "softmax",
    "softplus_torch", "swiglu",
]
