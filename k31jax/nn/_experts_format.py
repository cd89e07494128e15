"""Switching a model's routed experts between float master weights and packed MXFP4."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..quant import mxfp4_dequantize_packed, mxfp4_quantize_packed
from ._model import K31ForCausalLM, abstract_model

_ROUTED = ("w_gate", "w_up", "w_down")


def _rebuild(model: K31ForCausalLM, cfg, convert) -> K31ForCausalLM:
    """`model`'s parameters under `cfg`, each routed expert weight's subtree passed through
    `convert(subtree, target)` (target: the new model's abstract subtree)."""
    graphdef, state = nnx.split(abstract_model(cfg))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    target = nnx.to_pure_dict(state)
    if "moe" in pure:
        pure["moe"] = dict(pure["moe"], **{w: convert(pure["moe"][w], target["moe"][w]) for w in _ROUTED})
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def quantize_experts(model: K31ForCausalLM, rule: str = "floor") -> K31ForCausalLM:
    """A copy whose routed experts are packed MXFP4, quantised from the float (master) weights
    with `rule` along the contraction axis: the same rule QAT's forward pass used, so the
    exported bytes are exactly what the model trained against (mx_formats.md §6)."""
    cfg = model.config.replace(expert_weights="mxfp4", expert_qat=False)

    if model.config.expert_adapter_rank:
        raise ValueError("quantize_experts: the experts are packed with adapters beside them; "
                         "merge_expert_adapters re-rounds them with their adapters")

    def pack(w, _):
        packed, scale = mxfp4_quantize_packed(jnp.asarray(w, jnp.float32), rule=rule)
        return {"packed": packed, "scale": scale}

    return _rebuild(model, cfg, pack)


def dequantize_experts(model: K31ForCausalLM) -> K31ForCausalLM:
    """A copy holding the exact float (config dtype) values of packed MXFP4 experts."""
    cfg = model.config.replace(expert_weights="bf16", expert_adapter_rank=0)
    dtype = jnp.dtype(cfg.dtype)
    return _rebuild(model, cfg, lambda w, _: _decoded(w, dtype))


def _decoded(w, dtype):
    """A packed expert weight's float value, with its adapters' product added when it has them."""
    value = mxfp4_dequantize_packed(w["packed"], w["scale"], dtype=jnp.float32)
    if "adapter_a" in w:
        value = value + jnp.matmul(w["adapter_a"], w["adapter_b"], precision=jax.lax.Precision.HIGHEST)
    return value.astype(dtype)


def with_expert_adapters(model: K31ForCausalLM, rank: int) -> K31ForCausalLM:
    """A copy of a packed-expert model with zero LoRA factors of `rank` beside each routed
    expert weight (`PackedExperts.adapter`); the packed arrays are shared, not copied."""
    if model.config.expert_weights != "mxfp4":
        raise ValueError(f"with_expert_adapters: the experts are {model.config.expert_weights!r}, not packed "
                         "MXFP4 (LoRA merges into float experts)")
    cfg = model.config.replace(expert_adapter_rank=rank)

    def slots(w, target):
        return {"packed": w["packed"], "scale": w["scale"],
                **{k: jnp.zeros(target[k].shape, target[k].dtype) for k in ("adapter_a", "adapter_b")}}

    return _rebuild(model, cfg, slots)


def merge_expert_adapters(model: K31ForCausalLM, rule: str = "floor") -> K31ForCausalLM:
    """The model with each packed expert weight replaced by its adapters merged in and the sum
    rounded back to MXFP4 (`quantize_experts`' rule): packed experts again, no adapters. The
    rounding undoes part of a small adapter's effect (`benchmarks/qat_finetune.py` measures
    it against serving the adapters unmerged)."""
    cfg = model.config.replace(expert_adapter_rank=0)

    def merged(w, _):
        packed, scale = mxfp4_quantize_packed(_decoded(w, jnp.float32), rule=rule)
        return {"packed": packed, "scale": scale}

    return _rebuild(model, cfg, merged)
