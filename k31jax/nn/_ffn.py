"""FFN modules: the dense GLU MLP (layer 0) and the Stable LatentMoE. Spec architecture.md §7-8."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from ..config import ModelConfig
from ..ops import (Backends, ExpertAdapter, MXFP4Weight, ep_routed_experts, glu, make_ep_plan, rms_norm, route,
                   routed_experts, router_scores)
from ..quant import mxfp4_quantize_packed, mxfp4_weight
from ._param import constant, normal, param


class PackedExperts(nnx.Module):
    """Stacked MXFP4 expert weights `[E, out, in]`, held packed: `packed` uint8
    `[E, out, in/2]` (low nibble = even element) and `scale` uint8 E8M0 `[E, out, in/32]`.

    `adapter_rank` > 0 adds LoRA factors beside them (`ExpertAdapter`: `adapter_a` fp32
    `[E, out, r]`, `adapter_b` `[E, r, in]`, zero here; `k31jax.train` fills them), applied
    unmerged so the packed bytes stay as they are."""

    def __init__(self, packed, scale, axes, adapter_rank: int = 0):
        self.packed = param(packed, axes)
        self.scale = param(scale, axes)
        if adapter_rank:
            e, out, half = packed.shape
            self.adapter_a = param(jnp.zeros((e, out, adapter_rank), jnp.float32), (axes[0], axes[1], None))
            self.adapter_b = param(jnp.zeros((e, adapter_rank, 2 * half), jnp.float32), (axes[0], None, axes[2]))

    def weight(self, row=None) -> MXFP4Weight:
        """The weight; with `row`, `packed` / `scale` hold a whole layer stack and this is its row."""
        return mxfp4_weight(self.packed[...], self.scale[...], row)

    def adapter(self, row=None) -> ExpertAdapter | None:
        """The LoRA factors (None without them); `row` as in `weight`."""
        if not hasattr(self, "adapter_a"):
            return None
        a, b = self.adapter_a[...], self.adapter_b[...]
        return ExpertAdapter(a, b) if row is None else ExpertAdapter(a[row], b[row])


def _expert_weight(rngs, shape, cfg: ModelConfig, axes):
    """A routed-expert weight in the config's storage format (random init: N(0, σ))."""
    w = normal(rngs, shape, cfg.initializer_range, jnp.float32, axes)
    if cfg.expert_weights == "bf16":
        return param(w[...].astype(jnp.dtype(cfg.dtype)), axes)
    packed, scale = mxfp4_quantize_packed(w[...])
    return PackedExperts(packed, scale, axes, cfg.expert_adapter_rank)


def _weight_value(w, row=None):
    """A routed-expert weight's value; `row` applies to packed experts only (`expert_row`)."""
    return w.weight(row) if isinstance(w, PackedExperts) else w[...]


def _ep_plan(ep: str, n_tokens: int, weights):
    """The expert-parallel plan when a mesh is active and its rules split the experts."""
    if ep == "off" or jax.sharding.get_abstract_mesh().empty:
        return None
    return make_ep_plan(n_tokens, weights, exchange=ep)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Each token's chosen experts `[B, T, K]` and their combine weights `[B, T, K]` fp32."""

    experts: Int[Array, "B T K"]
    weights: Float[Array, "B T K"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEOutput:
    """What `LatentMoE` returns: its output `[B, T, D]` and the routing that produced it."""

    output: Float[Array, "B T D"]
    routing: Routing


class DenseMLP(nnx.Module):
    """`down(act(gate x, up x))`; also the fused shared experts."""

    def __init__(self, cfg: ModelConfig, width: int, *, rngs: nnx.Rngs):
        d, dt, std = cfg.hidden_size, jnp.dtype(cfg.dtype), cfg.initializer_range
        self.act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.gate_proj = normal(rngs, (d, width), std, dt, ("embed", "mlp"))
        self.up_proj = normal(rngs, (d, width), std, dt, ("embed", "mlp"))
        self.down_proj = normal(rngs, (width, d), std, dt, ("mlp", "embed"))

    def __call__(self, x):
        return glu(x @ self.gate_proj[...], x @ self.up_proj[...], *self.act) @ self.down_proj[...]


class LatentMoE(nnx.Module):
    """Router on x, experts in the latent space, one RMSNorm of the summed latent, up, + shared.

    Without `routed_expert_hidden_size` (Kimi Linear) the experts run on x directly.
    Routed expert weights are stacked `[E, out, in]`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        ell = cfg.expert_in_dim
        dt, std = jnp.dtype(cfg.dtype), cfg.initializer_range
        self.cfg = cfg
        self.gate = normal(rngs, (d, e), std, dt, ("embed", None))
        self.gate_bias = constant((e,), 0.0, jnp.float32, (None,))
        if cfg.latent_moe:
            self.latent_down = normal(rngs, (d, ell), std, dt, ("embed", "latent"))
            if cfg.latent_moe_use_norm:
                self.latent_norm = constant((ell,), 1.0, dt, ("norm",))
            self.latent_up = normal(rngs, (ell, d), std, dt, ("latent", "embed"))
        self.w_gate = _expert_weight(rngs, (e, i, ell), cfg, ("expert", "expert_mlp", "latent"))
        self.w_up = _expert_weight(rngs, (e, i, ell), cfg, ("expert", "expert_mlp", "latent"))
        self.w_down = _expert_weight(rngs, (e, ell, i), cfg, ("expert", "latent", "expert_mlp"))
        self.shared = (DenseMLP(cfg, cfg.shared_intermediate_size, rngs=rngs)
                       if cfg.num_shared_experts else None)

    def route(self, x):
        c = self.cfg
        return route(
            x, self.gate[...], self.gate_bias[...], c.num_experts_per_token,
            renormalize=c.moe_renormalize, scaling=c.routed_scaling_factor,
            activation=c.moe_router_activation_func, n_group=c.num_expert_group,
            topk_group=c.topk_group)

    def scores(self, x):
        """x `[B, T, D]` -> the router's unbiased fp32 scores for every expert `[B, T, E]`
        (the balance loss needs all of them, not only the chosen ones)."""
        b, t, d = x.shape
        return router_scores(x.reshape(b * t, d), self.gate[...], self.cfg.moe_router_activation_func).reshape(b, t, -1)

    def __call__(self, x, *, backends: Backends | None = None, expert_row=None) -> MoEOutput:
        """x `[B, T, D]` -> `MoEOutput` (y `[B, T, D]`, the routing: chosen experts `[B, T, K]`
        and their weights).

        expert_row: set when the routed experts hold a whole layer stack (`LAYER_STACKS`) and
        this layer is its row `expert_row` (the model's inference layer step: a decode step
        then reads the chosen experts straight from the stack).

        backends (default `Backends()`): `moe` is the local grouped-matmul form, `kernels` the
        seam its "auto" consults for packed MXFP4 experts, `ep` the expert parallelism under an
        active mesh whose rules split the experts (without one, or with unsplit experts, this
        is the single-device path whatever `ep` says).
        """
        backends = backends or Backends()
        c = self.cfg
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        idx, weights = self.route(flat)
        u_in = flat @ self.latent_down[...] if c.latent_moe else flat
        kwargs = dict(hidden_act=c.hidden_act, beta_gate=c.activation_situ_beta,
                      beta_up=c.activation_situ_linear_beta,
                      weight_fake_quant=c.expert_qat, activation_fake_quant=c.expert_activations == "mxfp8")
        ws = tuple(_weight_value(w, expert_row) for w in (self.w_gate, self.w_up, self.w_down))
        adapters = (tuple(w.adapter(expert_row) for w in (self.w_gate, self.w_up, self.w_down))
                    if c.expert_adapter_rank else None)
        plan = _ep_plan(backends.ep, b * t, ws)
        if plan is None:
            u = routed_experts(u_in, idx, weights, *ws, form=backends.moe, kernels=backends.kernels,
                               adapters=adapters, **kwargs)
        else:
            u = ep_routed_experts(u_in, idx, weights, *ws, plan=plan, local=backends.moe, kernels=backends.kernels,
                                  adapters=adapters, **kwargs)
        u = u.astype(x.dtype)
        if c.latent_moe:
            if c.latent_moe_use_norm:
                u = rms_norm(u, self.latent_norm[...], c.rms_norm_eps)
            u = u @ self.latent_up[...]
        if self.shared is not None:
            u = u + self.shared(flat)
        k = idx.shape[-1]
        return MoEOutput(u.reshape(b, t, d), Routing(idx.reshape(b, t, k), weights.reshape(b, t, k)))
