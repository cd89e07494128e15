"""The jitted training and evaluation steps, as pure functions of explicit pytrees.

A batch is a dict of `[A, B, T]` arrays (A micro-batches of B packed rows, from
`k31jax.train._data`). One training step scans the A micro-batches, sums their gradients of
`loss_sum / trained tokens of the whole step` (so accumulation equals one step on the union,
exactly), applies the optimizer to the trainable tree, then moves the router's selection
bias toward balance from the step's expert load (`_balance`). Parameters are pure dicts
(`nnx.to_pure_dict`), merged into the model inside the step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ..config import ModelConfig
from ..ops import Backends
from ._balance import SignBiasUpdate, expert_load, load_metrics, sequence_balance_loss
from ._lora import LoraState, apply_lora
from ._loss import chunked_cross_entropy

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Static settings of the jitted steps (hashable: part of the compiled program's key)."""

    backends: Backends
    remat: str = "none"
    vocab_chunk: int = 4096
    z_loss: float = 0.0
    balance_loss: float = 0.0
    bias_update_rate: float = 0.0
    lora_scale: float | None = None  # set when the trainable tree is a LoraState


def moe_rows(cfg: ModelConfig) -> np.ndarray:
    """Layer indices of the MoE layers (rows of the stacked per-layer router outputs)."""
    return np.asarray(cfg.moe_layers, np.int32)


def micro_batch_loss(model, batch: dict[str, jax.Array], s: StepSettings, denominator,
                     total_rows: int) -> tuple[jax.Array, dict]:
    """One micro-batch `[B, T]`: (objective, aux). The objective is the masked cross entropy
    summed over its tokens and divided by `denominator` (the step's trained tokens), plus the
    balance loss weighted by this micro-batch's share of the step's `total_rows`; aux holds
    sums and the expert load."""
    cfg = model.config
    collect = ("router_idx",) if cfg.moe_layers else ()
    if cfg.moe_layers and s.balance_loss:
        collect += ("router_scores",)
    out = model.hidden_states(batch["tokens"], segment_ids=batch["segment_ids"], backends=s.backends, remat=s.remat,
                              collect=collect)
    hidden, per_layer = out.hidden, out.intermediates
    loss_sum, stats = chunked_cross_entropy(hidden, model.lm_head[...], batch["targets"], batch["loss_mask"],
                                            vocab_chunk=s.vocab_chunk, z_loss=s.z_loss)
    objective = loss_sum / denominator
    aux = dict(nll_sum=stats["nll_sum"], z_loss_sum=stats["z_loss_sum"], tokens=stats["tokens"],
               correct=stats["correct"], bytes=jnp.sum(batch["target_bytes"] * batch["loss_mask"]),
               balance_loss=jnp.zeros((), jnp.float32))
    if cfg.moe_layers:
        rows = moe_rows(cfg)
        real = (batch["segment_ids"] > 0).astype(jnp.float32)  # the router sees every real token
        idx = per_layer["router_idx"][rows]
        aux["load"] = expert_load(idx, real, cfg.num_experts)
        if s.balance_loss:
            balance = sequence_balance_loss(per_layer["router_scores"][rows], idx, real, alpha=s.balance_loss)
            aux["balance_loss"] = balance
            objective = objective + balance * batch["tokens"].shape[0] / total_rows
    return objective, aux


def partition(params: Params, is_trained, prefix: str = "") -> tuple[Params, Params]:
    """Split a nested parameter dict by `is_trained(path)` ("moe/w_gate") into (the rest, the
    trained sub-dict): disjoint, so both can be donated to the step."""
    rest, trained = {}, {}
    for key, value in params.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            r, t = partition(value, is_trained, path + "/")
            if r:
                rest[key] = r
            if t:
                trained[key] = t
        elif is_trained(path):
            trained[key] = value
        else:
            rest[key] = value
    return rest, trained


def overlay(params: Params, sub: Params) -> Params:
    """`params` with the leaves of the nested dict `sub` (a subset of its paths) replaced."""
    out = dict(params)
    for key, value in sub.items():
        out[key] = overlay(params[key], value) if isinstance(value, dict) and key in params else value
    return out


def _merge_trainable(params: Params, trainable, s: StepSettings) -> Params:
    if s.lora_scale is not None:
        return apply_lora(params, trainable)
    return overlay(params, trainable)


def train_step(graphdef, tx: optax.GradientTransformation, s: StepSettings, params: Params, opt_state,
               trainable, batch: dict[str, jax.Array]):
    """One optimizer step over `batch` `[A, B, T]` -> (params, opt_state, trainable, metrics).

    Without LoRA, `params` and `trainable` are the two halves of `partition`: the model is
    `overlay(params, trainable)`, gradients and optimizer state exist for `trainable` alone (so
    frozen weights cost no gradient memory), and `params` changes only by the router-bias
    update. With LoRA `trainable` is the adapters and `params` the whole (frozen) model."""
    n_micro, rows = batch["tokens"].shape[:2]
    denominator = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)

    def objective(tr, mb):
        model = nnx.merge(graphdef, _merge_trainable(params, tr, s))
        return micro_batch_loss(model, mb, s, denominator, n_micro * rows)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def accumulate(carry, mb):
        grads, sums = carry
        (_, aux), g = grad_fn(trainable, mb)
        return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, aux)), None

    zeros = jax.tree.map(jnp.zeros_like, trainable)
    sums0 = {k: jnp.zeros((), jnp.float32) for k in ("nll_sum", "z_loss_sum", "tokens", "correct", "bytes",
                                                    "balance_loss")}
    if "moe" in params:  # the per-layer load, shaped like the router bias [n_moe, E]
        sums0["load"] = jnp.zeros(params["moe"]["gate_bias"].shape, jnp.float32)
    (grads, sums), _ = jax.lax.scan(accumulate, (zeros, sums0), batch)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    metrics = dict(loss=sums["nll_sum"] / jnp.maximum(sums["tokens"], 1.0), tokens=sums["tokens"],
                   accuracy=sums["correct"] / jnp.maximum(sums["tokens"], 1.0), bytes=sums["bytes"],
                   z_loss=sums["z_loss_sum"] / jnp.maximum(sums["tokens"], 1.0),
                   balance_loss=sums["balance_loss"] / n_micro, grad_norm=optax.tree.norm(grads),
                   update_norm=optax.tree.norm(updates))
    if "load" in sums:
        if s.bias_update_rate:
            moe = dict(params["moe"])
            moe["gate_bias"] = SignBiasUpdate(s.bias_update_rate)(moe["gate_bias"], sums["load"])
            params = dict(params, moe=moe)
        metrics["expert_load"] = sums["load"]
        metrics.update({f"router_{k}": v for k, v in load_metrics(sums["load"]).items()})
    return params, opt_state, trainable, metrics


def eval_step(graphdef, s: StepSettings, params: Params, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Sums over one `[B, T]` batch: nll (nats), trained tokens, their UTF-8 bytes, correct."""
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(batch["tokens"], segment_ids=batch["segment_ids"], backends=s.backends).hidden
    _, stats = chunked_cross_entropy(hidden, model.lm_head[...], batch["targets"], batch["loss_mask"],
                                     vocab_chunk=s.vocab_chunk)
    return dict(nll_sum=stats["nll_sum"], tokens=stats["tokens"], correct=stats["correct"],
                bytes=jnp.sum(batch["target_bytes"] * batch["loss_mask"]))


def is_lora(trainable) -> bool:
    return isinstance(trainable, LoraState)

