"""Float64 NumPy references for indexer distillation and top-k recall.

Written from the definitions (attention.md §5, DeepSeek-V3.2-Exp report; the recall as the
k31jax issue defines it), not from k31jax code. One sequence, or one document, at a time:

- target: per query, a layer's attention probabilities over its allowed keys, summed over the
  heads, then L1-normalised;
- KL(target ‖ softmax of the indexer scores over the same allowed keys) per query, and its
  gradient in the scores;
- top-k recall: the target's mass on the k allowed keys with the highest indexer scores
  (ties to the lower key index); a query counts when it has more than k allowed keys.
"""

import numpy as np

from .attention import indexer_scores, indexer_select, mla_latents
from .common import _f64
from .kda import _w, document_spans


def head_summed_attention(logits, allowed):
    """logits [H, T, S], allowed [T, S] bool (each row with a key) -> target [T, S]."""
    logits = _f64(logits)
    allowed = np.asarray(allowed, bool)
    H, T, S = logits.shape
    summed = np.zeros((T, S))
    for h in range(H):
        for t in range(T):
            keys = np.nonzero(allowed[t])[0]
            row = logits[h, t, keys]
            e = np.exp(row - row.max())
            summed[t, keys] += e / e.sum()
    return summed / summed.sum(axis=1, keepdims=True)


def _log_softmax_allowed(scores_row, keys):
    row = _f64(scores_row)[keys]
    top = row.max()
    return row - (top + np.log(np.sum(np.exp(row - top))))


def indexer_kl(target, scores, allowed):
    """[T]: Σ_{s allowed, p_s > 0} p_s (log p_s − log q_s), q = softmax of the scores over the
    allowed keys; 0 for a row without allowed keys."""
    target, allowed = _f64(target), np.asarray(allowed, bool)
    out = np.zeros(target.shape[0])
    for t in range(target.shape[0]):
        keys = np.nonzero(allowed[t])[0]
        if len(keys) == 0:
            continue
        log_q = _log_softmax_allowed(scores[t], keys)
        p = target[t, keys]
        nz = p > 0
        out[t] = np.sum(p[nz] * (np.log(p[nz]) - log_q[nz]))
    return out


def indexer_kl_grad(target, scores, allowed):
    """d Σ_t KL_t / d scores [T, S]: softmax − target on the allowed keys (the target sums to 1
    there), 0 elsewhere."""
    target, allowed = _f64(target), np.asarray(allowed, bool)
    grad = np.zeros(target.shape)
    for t in range(target.shape[0]):
        keys = np.nonzero(allowed[t])[0]
        if len(keys):
            grad[t, keys] = np.exp(_log_softmax_allowed(scores[t], keys)) - target[t, keys]
    return grad


def topk_recall(target, scores, allowed, k):
    """(recall [T], counted [T] bool): the target's mass on the top-min(k, n_t) allowed keys by
    score (a stable sort: ties to the lower index); counted iff n_t > k."""
    target, scores, allowed = _f64(target), _f64(scores), np.asarray(allowed, bool)
    recall = np.zeros(target.shape[0])
    counted = np.zeros(target.shape[0], bool)
    for t in range(target.shape[0]):
        keys = np.nonzero(allowed[t])[0]
        order = keys[np.argsort(-scores[t, keys], kind="stable")]
        recall[t] = target[t, order[:min(k, len(keys))]].sum()
        counted[t] = len(keys) > k
    return recall, counted


def mla_head_logits(x, p, cfg):
    """Per-head attention logits [H, T, T] of gated NoPE MLA for x [T, D] (attention.md §1.1,
    §1.2: q from the q-latent, per-head [k_nope | v] from the kv latent, k_pe shared, no
    rotation, scale (d_nope + d_pe)^-½); unmasked."""
    x = _f64(x)
    T = x.shape[0]
    H = int(cfg["num_heads"])
    dn, dr = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    dv = int(cfg["v_head_dim"])
    lat = mla_latents(x, p, cfg)
    q = (lat["c_q"] @ _w(p, "q_b_proj").T).reshape(T, H, dn + dr)
    k_nope = (lat["c_kv"] @ _w(p, "kv_b_proj").T).reshape(T, H, dn + dv)[..., :dn]
    logits = np.zeros((H, T, T))
    for h in range(H):
        logits[h] = (q[:, h, :dn] @ k_nope[:, h].T + q[:, h, dn:] @ lat["k_pe"].T) * (dn + dr) ** -0.5
    return logits


def layer_distill(x, p, ip, cfg, index_heads, index_dim, segment_ids, *, select_k=None, recall_k=None):
    """One MLA layer on one packed row x [T, D]: per-query (kl [T], recall [T], ceiling [T],
    counted [T]), zero at padding; the ceiling is the recall of a perfect ranking (the target's
    own top-k). Each document alone: the allowed keys are its causal ones, or with
    `select_k` the indexer's top-`select_k` selection among them (the sparse stage); recall
    (with `recall_k`) is against that same target."""
    x = _f64(x)
    T = x.shape[0]
    kl, recall, ceiling, counted = np.zeros(T), np.zeros(T), np.zeros(T), np.zeros(T, bool)
    for s, e in document_spans(segment_ids):
        xd = x[s:e]
        scores = indexer_scores(xd, mla_latents(xd, p, cfg)["c_q"], ip, index_heads, index_dim)
        allowed = np.tril(np.ones((e - s, e - s), bool))
        if select_k is not None:
            allowed = indexer_select(scores, select_k)
        target = head_summed_attention(mla_head_logits(xd, p, cfg), allowed)
        kl[s:e] = indexer_kl(target, scores, allowed)
        if recall_k is not None:
            recall[s:e], counted[s:e] = topk_recall(target, scores, allowed, recall_k)
            ceiling[s:e] = topk_recall(target, target, allowed, recall_k)[0]
    return kl, recall, ceiling, counted
