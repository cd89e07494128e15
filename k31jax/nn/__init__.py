"""NNX modules: thin wrappers that hold parameters and call `k31jax.ops`, the model, its
cache pytree, and counts computed on the abstract model (`abstract_model`: nothing allocated).

`param`, `normal` and `constant` create parameters annotated with logical axis names (sharded
eagerly under an active mesh): the modules here and the vision tower build with them."""

from ._cache import CACHE_AXES, Cache, KDALayerCache, KDATrail, MLALayerCache, constrain_cache, init_cache, kpe_width
from ._experts_format import dequantize_experts, merge_expert_adapters, quantize_experts, with_expert_adapters
from ._ffn import DenseMLP, LatentMoE, MoEOutput, PackedExperts, Routing
from ._kda_layer import KDAMixer
from ._layer_stack import (LAYER_STACKS, OUT_MAJOR_PROJECTIONS, REMAT_POLICIES, ROUTED_EXPERTS, expert_words,
                           out_major_projections, unstack_layers)
from ._mla_layer import Indexer, MLAMixer
from ._model import INTERMEDIATES, HiddenOutput, K31ForCausalLM, LayerNorms, ModelOutput, abstract_model, reconfigure
from ._param import OutMajor, constant, normal, param
from ._sizes import ParamCount, count_params

__all__ = [
    "CACHE_AXES", "INTERMEDIATES", "LAYER_STACKS", "OUT_MAJOR_PROJECTIONS", "OutMajor", "REMAT_POLICIES",
    "ROUTED_EXPERTS", "Cache", "DenseMLP", "HiddenOutput", "Indexer",
    "K31ForCausalLM", "KDALayerCache", "KDAMixer", "KDATrail", "LatentMoE", "LayerNorms", "MLALayerCache", "MLAMixer",
    "ModelOutput", "MoEOutput", "PackedExperts", "ParamCount", "Routing", "abstract_model", "constant",
    "constrain_cache", "count_params", "dequantize_experts", "expert_words", "init_cache", "kpe_width", "normal",
    "merge_expert_adapters", "out_major_projections", "param", "quantize_experts", "reconfigure", "unstack_layers",
    "with_expert_adapters",
]
