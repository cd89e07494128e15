"""Switching a model's routed experts between float master weights and packed MXFP4."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ..quant import mxfp4_dequantize_packed, mxfp4_quantize_packed
from ._model import K31ForCausalLM, abstract_model

_ROUTED = ("w_gate", "w_up", "w_down")


def _rebuild(model: K31ForCausalLM, cfg, convert) -> K31ForCausalLM:
    graphdef, state = nnx.split(abstract_model(cfg))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if "moe" in pure:
        pure["moe"] = dict(pure["moe"], **{w: convert(pure["moe"][w]) for w in _ROUTED})
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def quantize_experts(model: K31ForCausalLM, rule: str = "floor") -> K31ForCausalLM:
    """A copy whose routed experts are packed MXFP4, quantised from the float (master) weights
    with `rule` along the contraction axis: the same rule QAT's forward pass used, so the
    exported bytes are exactly what the model trained against (mx_formats.md §6)."""
    cfg = model.config.replace(expert_weights="mxfp4", expert_qat=False)

    def pack(w):
        packed, scale = mxfp4_quantize_packed(jnp.asarray(w, jnp.float32), rule=rule)
        return {"packed": packed, "scale": scale}

    return _rebuild(model, cfg, pack)


def dequantize_experts(model: K31ForCausalLM) -> K31ForCausalLM:
    """A copy holding the exact float (config dtype) values of packed MXFP4 experts."""
    cfg = model.config.replace(expert_weights="bf16")
    dtype = jnp.dtype(cfg.dtype)
    return _rebuild(model, cfg, lambda w: mxfp4_dequantize_packed(w["packed"], w["scale"], dtype=dtype))
