"""k31jax: Moonshot's Kimi K3.1 Pro (and K3, Kimi Linear) in JAX / Flax NNX.

The curated public API. Pure ops live in `k31jax.ops`, NNX modules in `k31jax.nn`, MX
formats in `k31jax.quant`, the tokenizer and chat format in `k31jax.chat`.
"""

from .cache import Cache, init_cache
from .ckpt import load_checkpoint, load_hf_weights
from .config import ConfigError, K3Config, ModelConfig, preset_names
from .nn import K31ForCausalLM, dequantize_experts, quantize_experts
from ._sizes import ParamCount, abstract_model, count_params

__all__ = [
    "Cache", "ConfigError", "K31ForCausalLM", "K3Config", "ModelConfig", "ParamCount",
    "abstract_model", "count_params", "dequantize_experts", "init_cache", "load_checkpoint", "load_hf_weights",
    "preset_names", "quantize_experts",
]
__version__ = "0.1.0"
