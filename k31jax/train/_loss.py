"""Next-token cross entropy from the final hidden states, without the `[B, T, V]` logits.

K3's vocabulary is 163,840: at 32k tokens per step the fp32 logits alone are 21 GB, and
autodiff would keep them (and the softmax) for the backward pass. `chunked_cross_entropy`
walks the vocabulary in chunks of `vocab_chunk` columns of `lm_head` instead:

- forward: an online logsumexp (running max `m`, running `Σ exp(logit - m)`) plus the
  target logit and the running argmax, one `[N, chunk]` block of logits at a time;
- backward (`jax.custom_vjp`): each chunk's logits are recomputed from `hidden` and the
  saved per-token logsumexp, turned into `dlogits = softmax · (1 + 2 z lse) − onehot`
  (times the mask), and immediately contracted into `d hidden` (accumulated) and that
  chunk's columns of `d lm_head` (written in place). Only `[N]` vectors are saved.

Peak temporary memory is O(N · chunk) instead of O(N · V), and the gradients are those of
the full-vocabulary loss. A custom VJP is used rather than autodiff of a checkpointed scan
because the transpose of slicing a closed-over `lm_head` would add a full `[D, V]` zero
buffer per chunk.

Dtype policy: logits, logsumexp and the loss are fp32 (`preferred_element_type=float32`;
float64 operands, under x64, stay float64);
the backward matmuls take `dlogits` in the operands' dtype with fp32 accumulation, and
return `d hidden` / `d lm_head` in the dtypes of `hidden` / `lm_head`.

Loss convention: everything is a masked SUM over tokens (divide by `stats["tokens"]`, or a
fixed token budget, in the trainer), so micro-batches add up exactly under accumulation.
With `z_loss > 0` the returned loss is `nll_sum + z_loss · Σ mask · lse²` (PaLM's z-loss);
`stats["nll_sum"]` is the pure cross entropy in nats, for perplexity and bits per byte.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_F32 = jnp.float32


def _logit_dtype(*arrays) -> jnp.dtype:
    """fp32 for bf16 / fp32 operands; float64 stays float64 (x64 reference runs)."""
    return jnp.promote_types(jnp.result_type(*arrays), _F32)


def _check_inputs(hidden, lm_head, targets, mask, name: str) -> None:
    if hidden.ndim != 3:
        raise ValueError(f"{name}: hidden must be [B, T, D], got shape {hidden.shape}")
    b, t, d = hidden.shape
    if lm_head.ndim != 2 or lm_head.shape[0] != d:
        raise ValueError(f"{name}: lm_head must be [D={d}, V], got shape {lm_head.shape}")
    if targets.shape != (b, t):
        raise ValueError(f"{name}: targets must be [B, T] = {(b, t)}, got shape {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"{name}: targets must be integer token ids, got dtype {targets.dtype}")
    if mask.shape != (b, t):
        raise ValueError(f"{name}: mask must be [B, T] = {(b, t)}, got shape {mask.shape}")


def _stats(loss, nll_sum, z_sum, mask, correct) -> dict[str, jax.Array]:
    return dict(loss=loss, nll_sum=nll_sum, z_loss_sum=z_sum, tokens=mask.sum(), correct=correct)


def full_cross_entropy(
    hidden: Float[Array, "B T D"],
    lm_head: Float[Array, "D V"],
    targets: Int[Array, "B T"],
    mask: Float[Array, "B T"],
    *,
    z_loss: float = 0.0,
) -> tuple[Float[Array, ""], dict[str, jax.Array]]:
    """The plain loss: materialises the fp32 `[B, T, V]` logits (the baseline that
    `chunked_cross_entropy` must match, and the peak-memory comparison in benchmarks).

    Returns `(loss_sum, stats)` exactly as `chunked_cross_entropy`.
    """
    _check_inputs(hidden, lm_head, targets, mask, "full_cross_entropy")
    acc = _logit_dtype(hidden, lm_head)
    mask = mask.astype(acc)
    logits = jnp.dot(hidden, lm_head, preferred_element_type=acc)
    lse = jax.nn.logsumexp(logits, axis=-1)
    # "clip": ids at masked positions may be out of range (e.g. -100); their terms are × 0
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1, mode="clip")[..., 0]
    nll_sum = jnp.sum(mask * (lse - target_logit))
    z_sum = z_loss * jnp.sum(mask * lse * lse)
    correct = jnp.sum(mask * (jnp.argmax(logits, axis=-1) == targets))
    loss = nll_sum + z_sum
    return loss, _stats(loss, nll_sum, z_sum, mask, correct)


def _for_each_chunk(lm_head, chunk: int, body, carry):
    """`carry = body(carry, lm_head[:, start:start + width], start)` over the vocabulary:
    a `lax.scan` over the full chunks (sliced in place, no padded copy of `lm_head`), then
    one static step for the remainder when `V % chunk != 0`."""
    v = lm_head.shape[1]
    n_full, rest = divmod(v, chunk)
    if n_full:
        def step(c, i):
            start = i * chunk
            return body(c, jax.lax.dynamic_slice_in_dim(lm_head, start, chunk, axis=1), start), None

        carry, _ = jax.lax.scan(step, carry, jnp.arange(n_full, dtype=jnp.int32))
    if rest:
        carry = body(carry, lm_head[:, n_full * chunk:], n_full * chunk)
    return carry


def _forward_stats(h, w, targets, chunk):
    """Per token: logsumexp, target logit and argmax id, by an online pass over the chunks."""
    n, acc = h.shape[0], _logit_dtype(h, w)

    def body(carry, w_chunk, start):
        run_max, run_sum, target_logit, best = carry
        logits = jnp.dot(h, w_chunk, preferred_element_type=acc)
        chunk_max = logits.max(axis=-1)
        new_max = jnp.maximum(run_max, chunk_max)
        run_sum = run_sum * jnp.exp(run_max - new_max) + jnp.exp(logits - new_max[:, None]).sum(-1)
        local = targets - start
        inside = (local >= 0) & (local < w_chunk.shape[1])
        picked = jnp.take_along_axis(logits, jnp.clip(local, 0, w_chunk.shape[1] - 1)[:, None], axis=-1)[:, 0]
        target_logit = target_logit + jnp.where(inside, picked, 0.0)
        # strict ">" keeps the earlier chunk on ties: the first maximal id, like argmax
        best = jnp.where(chunk_max > run_max, jnp.argmax(logits, axis=-1).astype(jnp.int32) + start, best)
        return new_max, run_sum, target_logit, best

    init = (jnp.full((n,), -jnp.inf, acc), jnp.zeros((n,), acc), jnp.zeros((n,), acc),
            jnp.zeros((n,), jnp.int32))
    run_max, run_sum, target_logit, best = _for_each_chunk(w, chunk, body, init)
    return run_max + jnp.log(run_sum), target_logit, best


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked_core(h, w, targets, mask, chunk, z_loss):
    out, _ = _chunked_core_fwd(h, w, targets, mask, chunk, z_loss)
    return out


def _chunked_core_fwd(h, w, targets, mask, chunk, z_loss):
    lse, target_logit, best = _forward_stats(h, w, targets, chunk)
    nll = lse - target_logit
    is_correct = (best == targets).astype(lse.dtype)
    out = (jnp.sum(mask * nll), z_loss * jnp.sum(mask * lse * lse), jnp.sum(mask * is_correct))
    return out, (h, w, targets, mask, lse, nll, is_correct)


def _chunked_core_bwd(chunk, z_loss, residuals, cotangents):
    h, w, targets, mask, lse, nll, is_correct = residuals
    g_nll, g_z, g_correct = cotangents
    # d nll_sum / d logit = mask (softmax - onehot); d z_sum / d logit = mask 2 z lse softmax
    soft_coef = mask * (g_nll + 2.0 * z_loss * g_z * lse)
    hot_coef = mask * g_nll
    compute, acc = jnp.result_type(h, w), _logit_dtype(h, w)

    def body(carry, w_chunk, start):
        d_h, d_w = carry
        logits = jnp.dot(h, w_chunk, preferred_element_type=acc)
        width = w_chunk.shape[1]
        onehot = (targets - start)[:, None] == jnp.arange(width, dtype=jnp.int32)[None, :]
        d_logits = jnp.exp(logits - lse[:, None]) * soft_coef[:, None] - jnp.where(onehot, hot_coef[:, None], 0.0)
        d_logits = d_logits.astype(compute)
        d_h = d_h + jnp.dot(d_logits, w_chunk.T, preferred_element_type=acc)
        d_w_chunk = jnp.dot(h.T, d_logits, preferred_element_type=acc).astype(d_w.dtype)
        d_w = jax.lax.dynamic_update_slice_in_dim(d_w, d_w_chunk, start, axis=1)
        return d_h, d_w

    d_h, d_w = _for_each_chunk(w, chunk, body, (jnp.zeros(h.shape, acc), jnp.zeros_like(w)))
    d_mask = g_nll * nll + g_z * z_loss * lse * lse + g_correct * is_correct
    return d_h.astype(h.dtype), d_w, None, d_mask


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def chunked_cross_entropy(
    hidden: Float[Array, "B T D"],
    lm_head: Float[Array, "D V"],
    targets: Int[Array, "B T"],
    mask: Float[Array, "B T"],
    *,
    vocab_chunk: int = 4096,
    z_loss: float = 0.0,
) -> tuple[Float[Array, ""], dict[str, jax.Array]]:
    """Masked-sum next-token cross entropy in nats, over vocabulary chunks.

    hidden: final hidden states (after the final norm), any float dtype.
    lm_head: `[D, V]`, V need not be a multiple of `vocab_chunk`.
    targets: the next token ids, in `[0, V)` wherever `mask != 0` (ids at masked positions,
      e.g. -100, are ignored).
    mask: token weights, usually 0/1 (padding, prompt tokens).
    z_loss: coefficient of `Σ mask · logsumexp²` added to the loss.

    Returns `(loss, stats)`: `loss = nll_sum + z_loss_sum` (fp32 scalar, differentiable in
    `hidden` and `lm_head`); stats `loss`, `nll_sum` (nats), `z_loss_sum` (the z-loss term,
    coefficient included), `tokens` (Σ mask) and `correct` (Σ mask · [argmax == target]).
    """
    _check_inputs(hidden, lm_head, targets, mask, "chunked_cross_entropy")
    if not isinstance(vocab_chunk, int) or vocab_chunk < 1:
        raise ValueError(f"chunked_cross_entropy: vocab_chunk must be a positive int, got {vocab_chunk!r}")
    b, t, d = hidden.shape
    mask = mask.astype(_logit_dtype(hidden, lm_head))
    chunk = min(vocab_chunk, lm_head.shape[1])
    nll_sum, z_sum, correct = _chunked_core(hidden.reshape(b * t, d), lm_head, targets.reshape(b * t).astype(jnp.int32),
                                            mask.reshape(b * t), chunk, float(z_loss))
    loss = nll_sum + z_sum
    return loss, _stats(loss, nll_sum, z_sum, mask, correct)


def bits_per_byte(loss_sum_nats: Float[Array, ""], n_bytes) -> Float[Array, ""]:
    """Tokenizer-independent bits per UTF-8 byte: `nll_sum / (ln 2 · n_bytes)`.

    Pass the pure cross entropy (`stats["nll_sum"]`, no z-loss) summed over the same tokens
    whose text is `n_bytes` long."""
    return jnp.asarray(loss_sum_nats, _F32) / (math.log(2.0) * jnp.asarray(n_bytes, _F32))
