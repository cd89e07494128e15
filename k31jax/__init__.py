"""k31jax: Moonshot's Kimi K3.1 Pro (and K3, Kimi Linear) in JAX / Flax NNX.

The curated public API: what a researcher types. The layers underneath, bottom to top:
`config` -> `quant`, `chat` -> `sharding` (rules, meshes, constraints) -> `kernels` -> `ops`
(pure functions, the kernel seam, `Backends`) -> `nn` (modules, cache, counts) -> `vision`
-> `ckpt` (formats, loading, converting) -> `distributed` (placement on meshes, planner,
multi-process) -> `generate` -> `train` | `serve` -> `aot` -> `cli`; each imports only from below, and only
another package's public names (tests/project/test_architecture.py).
"""

from . import distributed, sharding
from .ckpt import convert, export, load_checkpoint, load_hf_weights, verify_checkpoint
from .config import ConfigError, ModelConfig, preset_names
from .distributed import init_sharded, load_sharded, plan_memory
from .generate import ChatSession, Engine, SamplingParams, load_model
from .nn import (Cache, K31ForCausalLM, ModelOutput, ParamCount, abstract_model, count_params, dequantize_experts,
                 quantize_experts)
from .ops import Backends
from .sharding import activate, make_mesh

__all__ = [
    "Backends", "Cache", "ChatSession", "ConfigError", "Engine", "K31ForCausalLM", "ModelConfig", "ModelOutput", "ParamCount",
    "SamplingParams", "abstract_model", "activate", "convert", "count_params", "dequantize_experts", "distributed",
    "export", "init_sharded", "load_checkpoint", "load_hf_weights", "load_model", "load_sharded", "make_mesh",
    "plan_memory", "preset_names", "quantize_experts", "sharding", "verify_checkpoint",
]
__version__ = "0.1.0"
