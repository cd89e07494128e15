"""MoE load balancing for fine-tuning: expert load, router-bias updates, the sequence-wise
balance loss, and load metrics.

The router (architecture.md §7, attention.md §7) chooses the top-k experts of
`sigmoid(x W_gate) + gate_bias` and weights them by the unbiased scores, so `gate_bias`
steers *selection* only and is not learned by gradient (`k31jax.train` freezes it in the
optimizer). K3 sets it with "Quantile Balancing" (K3 report §2.3.3), whose exact rule is not
public; `SignBiasUpdate` is DeepSeek-V3's auxiliary-loss-free rule, the published rule for the
same noaux_tc router. Other rules plug in through the `BiasUpdateRule` protocol.

Layer axes: `router_idx` from the model's intermediates is `[L, B, T, K]` over ALL layers
(dense layers report expert 0 with weight 0); select the MoE layers (`cfg.moe_layers`) so that
row l lines up with `moe.gate_bias[l]`.

Dtype policy: loads, biases, scores and losses are fp32.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_F32 = jnp.float32


def _check_mask(router_idx, mask, n_token_axes: int, name: str):
    tokens = router_idx.shape[router_idx.ndim - 1 - n_token_axes:-1]
    if mask is None:
        return jnp.ones(tokens, _F32)
    if mask.shape != tokens:
        raise ValueError(f"{name}: mask must have the token shape {tokens} of router_idx "
                         f"{router_idx.shape}, got {mask.shape}")
    return mask.astype(_F32)


def expert_load(
    router_idx: Int[Array, "*L B T K"] | Int[Array, "N K"],
    mask: Float[Array, "B T"] | Float[Array, "N"] | None,
    num_experts: int,
) -> Float[Array, "*L E"]:
    """Tokens routed to each expert, counting each token by its mask weight (padding 0).

    router_idx: `[L, B, T, K]` -> `[L, E]`; `[B, T, K]` or `[N, K]` -> `[E]`.
    mask: over the token axes (`[B, T]` or `[N]`), or None for all tokens.
    """
    if router_idx.ndim not in (2, 3, 4):
        raise ValueError(f"expert_load: router_idx must be [L, B, T, K], [B, T, K] or [N, K], "
                         f"got shape {router_idx.shape}")
    n_token_axes = 1 if router_idx.ndim == 2 else 2
    weight = _check_mask(router_idx, mask, n_token_axes, "expert_load")
    lead = router_idx.shape[: router_idx.ndim - 1 - n_token_axes]
    idx = router_idx.reshape(lead + (-1,)).astype(jnp.int32)  # [*L, tokens * K]
    w = jnp.broadcast_to(weight[..., None], router_idx.shape[len(lead):]).reshape(-1)

    def count(layer_idx):
        return jax.ops.segment_sum(w, layer_idx, num_segments=num_experts)

    if not lead:
        return count(idx)
    return jax.vmap(count)(idx.reshape(-1, idx.shape[-1])).reshape(lead + (num_experts,))


class BiasUpdateRule(Protocol):
    """Maps the router correction bias and the observed load to the next bias."""

    def __call__(self, bias: Float[Array, "*L E"], load: Float[Array, "*L E"]) -> Float[Array, "*L E"]: ...


@dataclasses.dataclass(frozen=True)
class SignBiasUpdate:
    """DeepSeek-V3's auxiliary-loss-free balancing: per layer,
    `b_e += rate · sign(mean_load − load_e)` (under-loaded experts become likelier picks).

    Apply once per optimizer step on the load summed over that step's tokens; DeepSeek-V3
    used rate 1e-3 for most of pre-training.
    """

    rate: float = 1e-3

    def __call__(self, bias: Float[Array, "*L E"], load: Float[Array, "*L E"]) -> Float[Array, "*L E"]:
        if bias.shape != load.shape:
            raise ValueError(f"SignBiasUpdate: bias {bias.shape} and load {load.shape} must match")
        load = load.astype(_F32)
        step = jnp.sign(load.mean(-1, keepdims=True) - load)
        return (bias.astype(_F32) + self.rate * step).astype(bias.dtype)


def sequence_balance_loss(
    router_scores: Float[Array, "*L B T E"],
    router_idx: Int[Array, "*L B T K"],
    mask: Float[Array, "B T"] | None = None,
    *,
    alpha: float = 1e-4,
) -> Float[Array, ""]:
    """DeepSeek-V3's complementary sequence-wise balance loss.

    Per sequence with T valid tokens: `s'_t = s_t / Σ_e s_{t,e}` (the affinities of ALL
    experts, normalised), `f_e = E / (K T) · Σ_t [e chosen at t]`, `P_e = (1/T) Σ_t s'_{t,e}`,
    loss `alpha · Σ_e f_e P_e` (1·alpha when perfectly balanced). Returns the mean over the B
    sequences (an empty sequence contributes 0), summed over leading layer axes.

    router_scores: the router's unbiased scores for every expert, e.g.
    `sigmoid(x @ gate)`; gradients flow through them only (`f` is a count).
    """
    if router_scores.shape[:-1] != router_idx.shape[:-1] or router_scores.ndim < 3:
        raise ValueError(f"sequence_balance_loss: router_scores [..., B, T, E] {router_scores.shape} and "
                         f"router_idx [..., B, T, K] {router_idx.shape} must share their leading axes")
    n_experts, top_k = router_scores.shape[-1], router_idx.shape[-1]
    weight = _check_mask(router_idx, mask, 2, "sequence_balance_loss")  # [B, T]
    n_tokens = weight.sum(-1)  # [B]
    per_token = 1.0 / jnp.maximum(n_tokens, 1.0)
    scores = router_scores.astype(_F32)
    normalised = scores / scores.sum(-1, keepdims=True)
    prob = jnp.einsum("...bte,bt->...be", normalised, weight) * per_token[:, None]
    # f: each sequence's own (masked) counts, [*L, B, E]
    per_sequence_counts = jax.vmap(lambda idx, w: expert_load(idx, w, n_experts))  # over B
    lead = router_idx.shape[:-3]
    flat_idx = router_idx.reshape((-1,) + router_idx.shape[-3:])  # [L', B, T, K]
    freq = jax.vmap(lambda idx: per_sequence_counts(idx, weight))(flat_idx)
    freq = freq.reshape(lead + (weight.shape[0], n_experts))
    freq = freq * (n_experts / top_k) * per_token[:, None]
    per_sequence = alpha * jnp.sum(jax.lax.stop_gradient(freq) * prob, axis=-1)  # [*L, B]
    return jnp.sum(jnp.mean(per_sequence, axis=-1))


def load_metrics(load: Float[Array, "*L E"]) -> dict[str, Float[Array, "*L"]]:
    """Per layer: `max_over_mean` (1 is perfect balance), `cv` (population std / mean) and
    `dead_fraction` (experts that got no token). A layer with no tokens reports 0 for the
    first two."""
    load = load.astype(_F32)
    mean = load.mean(-1)
    safe = jnp.where(mean > 0, mean, 1.0)
    return dict(max_over_mean=jnp.where(mean > 0, load.max(-1) / safe, 0.0),
                cv=jnp.where(mean > 0, load.std(-1) / safe, 0.0),
                dead_fraction=(load == 0).mean(-1))
