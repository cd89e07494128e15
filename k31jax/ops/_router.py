"""The MoE router (noaux_tc). Spec attention.md §7."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_HI = jax.lax.Precision.HIGHEST


def router_scores(x: Float[Array, "N D"], w_gate: Float[Array, "D E"], activation: str = "sigmoid") -> Float[Array, "N E"]:
    """The router's unbiased fp32 affinity of every token for every expert."""
    logits = jnp.dot(x.astype(jnp.float32), w_gate.astype(jnp.float32), precision=_HI)
    if activation == "sigmoid":
        return jax.nn.sigmoid(logits)
    if activation == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"router activation {activation!r}: expected 'sigmoid' or 'softmax'")


def route(
    x: Float[Array, "N D"],
    w_gate: Float[Array, "D E"],
    bias: Float[Array, "E"] | None,
    top_k: int,
    *,
    renormalize: bool = True,
    scaling: float = 1.0,
    activation: str = "sigmoid",
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[Int[Array, "N K"], Float[Array, "N K"]]:
    """Choose `top_k` experts per token and their weights, all in fp32.

    The correction `bias` is used for choosing only; weights are the unbiased scores,
    renormalised (`/ (Σ + 1e-20)`) when `renormalize and top_k > 1`, then times `scaling`.
    Group limiting applies only when `n_group > 1 and n_group > topk_group`.
    """
    scores = router_scores(x, w_gate, activation)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if n_group > 1 and n_group > topk_group:
        n, e = choice.shape
        grouped = choice.reshape(n, n_group, e // n_group)
        group_score = jax.lax.top_k(grouped, min(2, e // n_group))[0].sum(-1)
        _, keep = jax.lax.top_k(group_score, topk_group)
        keep_mask = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], keep].set(True)
        choice = jnp.where(keep_mask[:, :, None], grouped, -jnp.inf).reshape(n, e)
    _, idx = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), weights * scaling
