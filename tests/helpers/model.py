"""Tiny model configs, randomized weights, modules with abstract parameters, and the relative
error the numeric tests compare with."""

import jax
import numpy as np
from flax import nnx

from k31jax import ModelConfig


def randomize(model, seed: int, scale: float = 0.05):
    """Perturb every parameter (zeros included) so no part of the model is trivially inert."""
    state = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(state)
    new = [jax.numpy.asarray((np.asarray(l, np.float32) + scale * rng.standard_normal(l.shape)).astype(l.dtype))
           for l in leaves]
    nnx.update(model, jax.tree.unflatten(treedef, new))
    return model


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig.preset("tiny", **{"dtype": "float32", **overrides})


def kimi_linear_tiny_config(**overrides) -> ModelConfig:
    """A tiny Kimi Linear: softplus gate, low-rank output gate, ungated MLA with plain q_proj,
    plain residuals, SwiGLU, no latent MoE, scaling 2.446."""
    base = tiny_config()
    return base.replace(
        kda_gate_lower_bound=None, kda_full_rank_gate=False, kda_a_log_len=base.kda_num_heads,
        q_lora_rank=None, mla_use_output_gate=False, attn_res_block_size=None, hidden_act="silu",
        activation_situ_linear_beta=None, routed_expert_hidden_size=None, routed_scaling_factor=2.446,
        num_shared_experts=1, index_topk=None, index_n_heads=0, index_head_dim=0, **overrides)


def abstract(cls, *args):
    """The module with abstract parameters (no random init, which compiles per shape); every
    parameter is then filled from NumPy, so a leftover abstract leaf would fail loudly."""
    return nnx.eval_shape(lambda: cls(*args, rngs=nnx.Rngs(0)))


def rel_err(got, want):
    """max |got - want| / max(1, max |want|): absolute for O(1) tensors, relative for big ones."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0))
