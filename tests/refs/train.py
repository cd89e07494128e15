"""Float64 NumPy references for the training pieces (k31jax.train).

Written from the definitions, not from k31jax code:
- cross entropy with a token mask and PaLM's z-loss, and its analytic gradients;
- expert load counts, the DeepSeek-V3 auxiliary-loss-free bias update (sign rule) and the
  DeepSeek-V3 complementary sequence-wise balance loss (DeepSeek-V3 report §2.1.2), and
  load-balance metrics (architecture.md §7: the router bias only chooses experts);
- the LoRA merge W + (alpha / rank) A B.
"""

import numpy as np

from .common import _f64


def cross_entropy(hidden, lm_head, targets, mask, z_loss=0.0):
    """hidden [B, T, D], lm_head [D, V], targets [B, T], mask [B, T].

    loss = Σ_t mask_t (lse_t − logit_t[y_t]) + z · Σ_t mask_t lse_t². Returns a dict with
    loss, nll_sum, z_loss_sum, tokens, correct (argmax == target, first maximal id), and the
    gradients d_hidden, d_lm_head of `loss`: d logit_t = mask_t (p_t (1 + 2 z lse_t) − e_{y_t}).
    """
    h = _f64(hidden)
    w = _f64(lm_head)
    y = np.asarray(targets)
    m = _f64(mask)
    b, t, _ = h.shape
    v = w.shape[1]
    logits = h @ w
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    valid = (y >= 0) & (y < v)
    y_safe = np.where(valid, y, 0)
    target_logit = np.take_along_axis(logits, y_safe[..., None], -1)[..., 0]
    nll = lse - target_logit
    nll_sum = float(np.sum(m * nll))
    z_sum = float(z_loss * np.sum(m * lse**2))
    correct = float(np.sum(m * ((np.argmax(logits, -1) == y) & valid)))
    p = np.exp(logits - lse[..., None])
    onehot = np.zeros_like(logits)
    bi, ti = np.nonzero(valid)
    onehot[bi, ti, y[bi, ti]] = 1.0
    d_logits = m[..., None] * (p * (1.0 + 2.0 * z_loss * lse[..., None]) - onehot)
    d_hidden = d_logits @ w.T
    d_lm_head = h.reshape(b * t, -1).T @ d_logits.reshape(b * t, v)
    return dict(loss=nll_sum + z_sum, nll_sum=nll_sum, z_loss_sum=z_sum, tokens=float(m.sum()),
                correct=correct, d_hidden=d_hidden, d_lm_head=d_lm_head)


def expert_load(router_idx, mask, num_experts):
    """Tokens per expert. router_idx [..., K] with the token axes just before K; mask over the
    token axes (or None). Leading axes beyond the mask's are layers: [L, B, T, K] -> [L, E]."""
    idx = np.asarray(router_idx)
    n_token_axes = 1 if idx.ndim == 2 else 2
    lead = idx.shape[: idx.ndim - 1 - n_token_axes]
    tokens = idx.shape[len(lead):-1]
    m = np.ones(tokens) if mask is None else _f64(mask)
    out = np.zeros(lead + (num_experts,))
    for lead_pos in np.ndindex(*lead):
        for tok in np.ndindex(*tokens):
            for e in idx[lead_pos + tok]:
                out[lead_pos + (e,)] += m[tok]
    return out


def sign_bias_update(bias, load, rate):
    """DeepSeek-V3 aux-loss-free rule per layer: raise the bias of under-loaded experts
    (load below the layer's mean) by `rate`, lower over-loaded ones, leave exact-mean ones."""
    b = _f64(bias)
    load = _f64(load)
    mean = load.mean(-1, keepdims=True)
    return b + rate * np.where(load < mean, 1.0, np.where(load > mean, -1.0, 0.0))


def sequence_balance_loss(scores, router_idx, mask, alpha):
    """DeepSeek-V3 complementary sequence-wise balance loss.

    scores [..., B, T, E] (all experts' affinities), router_idx [..., B, T, K], mask [B, T].
    Per sequence (T_b valid tokens): s'_{t,e} = s_{t,e} / Σ_j s_{t,j};
    f_e = E / (K T_b) Σ_t [e ∈ topk_t]; P_e = (1 / T_b) Σ_t s'_{t,e}; L_b = alpha Σ_e f_e P_e.
    Returns Σ over leading (layer) axes of the mean over the B sequences (an empty sequence
    contributes 0).
    """
    s = _f64(scores)
    idx = np.asarray(router_idx)
    e = s.shape[-1]
    k = idx.shape[-1]
    lead = s.shape[:-3]
    b, t = s.shape[-3:-1]
    m = np.ones((b, t)) if mask is None else _f64(mask)
    total = 0.0
    for lead_pos in np.ndindex(*lead):
        per_seq = []
        for bi in range(b):
            n_tok = m[bi].sum()
            if n_tok == 0:
                per_seq.append(0.0)
                continue
            f = np.zeros(e)
            p = np.zeros(e)
            for ti in range(t):
                if m[bi, ti] == 0:
                    continue
                row = s[lead_pos + (bi, ti)]
                p += m[bi, ti] * row / row.sum()
                for ex in idx[lead_pos + (bi, ti)]:
                    f[ex] += m[bi, ti]
            f *= e / (k * n_tok)
            p /= n_tok
            per_seq.append(alpha * float(np.sum(f * p)))
        total += float(np.mean(per_seq))
    return total


def load_metrics(load):
    """Per layer: max / mean load, coefficient of variation (population std / mean), and the
    fraction of experts with zero load. A layer with zero total load reports 0 for the first
    two."""
    load = _f64(load)
    mean = load.mean(-1)
    safe = np.where(mean > 0, mean, 1.0)
    return dict(max_over_mean=np.where(mean > 0, load.max(-1) / safe, 0.0),
                cv=np.where(mean > 0, load.std(-1) / safe, 0.0),
                dead_fraction=(load == 0).mean(-1))


def lora_merge(w, a, b, alpha, rank):
    """W [..., n, m] + (alpha / rank) A [..., n, r] @ B [..., r, m]."""
    return _f64(w) + (alpha / rank) * (_f64(a) @ _f64(b))
