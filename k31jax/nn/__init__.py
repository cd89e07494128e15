"""NNX modules: thin wrappers that hold parameters and call `k31jax.ops`, the model, its
cache pytree, and counts computed on the abstract model (`abstract_model`: nothing allocated).

`param`, `normal` and `constant` create parameters annotated with logical axis names (sharded
eagerly under an active mesh): the modules here and the vision tower build with them."""

from ._cache import CACHE_AXES, Cache, constrain_cache, init_cache
from ._experts_format import dequantize_experts, quantize_experts
from ._ffn import DenseMLP, LatentMoE, PackedExperts
from ._kda_layer import KDAMixer
from ._mla_layer import Indexer, MLAMixer
from ._model import (INTERMEDIATES, LAYER_STACKS, REMAT_POLICIES, K31ForCausalLM, LayerNorms, abstract_model,
                     expert_words, unstack_layers)
from ._param import constant, normal, param
from ._sizes import ParamCount, count_params

__all__ = [
    "CACHE_AXES", "Cache", "DenseMLP", "INTERMEDIATES", "Indexer", "K31ForCausalLM", "KDAMixer", "LAYER_STACKS",
    "LatentMoE", "LayerNorms", "MLAMixer", "PackedExperts", "ParamCount", "REMAT_POLICIES", "abstract_model",
    "constant", "constrain_cache", "count_params", "dequantize_experts", "init_cache", "normal", "param",
    "quantize_experts", "unstack_layers", "expert_words",
]
