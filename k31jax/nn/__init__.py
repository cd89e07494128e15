"""NNX modules: thin wrappers that hold parameters and call `k31jax.ops`."""

from ._experts_format import dequantize_experts, quantize_experts
from ._ffn import DenseMLP, LatentMoE, PackedExperts
from ._kda_layer import KDAMixer
from ._mla_layer import Indexer, MLAMixer
from ._model import K31ForCausalLM, LayerNorms

__all__ = ["DenseMLP", "Indexer", "K31ForCausalLM", "KDAMixer", "LatentMoE", "LayerNorms", "MLAMixer",
           "PackedExperts", "dequantize_experts", "quantize_experts"]
