"""Float64 NumPy references: gated NoPE MLA and the lightning indexer.

attention.md §1-§3 and architecture.md §6, §10. Written from the specification only (docs/). One sequence.
"""

import numpy as np

from .common import _f64, layer_norm, rms_norm, sigmoid, softmax
from .kda import _has, _w, document_spans

MLA_LATENT_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm eps (architecture.md §3)
INDEXER_LN_EPS = 1e-6  # indexer k_norm eps (architecture.md §10.1)


def mla_latents(x, p, cfg):
    """MLA latents, attention.md §1.1: dict(c_q (post-norm or None), c_kv (post-norm), k_pe)."""
    x = _f64(x)
    r_kv = int(cfg["kv_lora_rank"])
    if cfg.get("q_lora_rank") is None:
        c_q = None
    else:
        c_q = rms_norm(x @ _w(p, "q_a_proj").T, _w(p, "q_a_layernorm"), MLA_LATENT_EPS)
    kva = x @ _w(p, "kv_a_proj_with_mqa").T  # [T, r_kv + d_pe]: latent rows first, then k_pe
    c_kv = rms_norm(kva[:, :r_kv], _w(p, "kv_a_layernorm"), MLA_LATENT_EPS)
    k_pe = kva[:, r_kv:]  # not normalised, not rotated
    return dict(c_q=c_q, c_kv=c_kv, k_pe=k_pe)


def mla_layer(x, p, cfg, allowed=None):
    """Naive (MHA) gated NoPE MLA, attention.md §1.1-§1.2, for x [T, D]; returns y [T, D].

    allowed: optional bool [T, T] (query, key) mask, ANDed with causal (DSA selection).
    """
    x = _f64(x)
    T = x.shape[0]
    H = int(cfg["num_heads"])
    d_nope, d_pe = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    d_v = int(cfg["v_head_dim"])
    lat = mla_latents(x, p, cfg)
    if lat["c_q"] is None:
        q = x @ _w(p, "q_proj").T
    else:
        q = lat["c_q"] @ _w(p, "q_b_proj").T
    q = q.reshape(T, H, d_nope + d_pe)  # per head [nope | pe]
    q_nope, q_pe = q[..., :d_nope], q[..., d_nope:]
    kv = (lat["c_kv"] @ _w(p, "kv_b_proj").T).reshape(T, H, d_nope + d_v)  # per head [k_nope | v]
    k_nope, v = kv[..., :d_nope], kv[..., d_nope:]
    k_pe = lat["k_pe"]  # [T, d_pe], shared by all heads

    mask = np.tril(np.ones((T, T), dtype=bool))
    if allowed is not None:
        mask = mask & np.asarray(allowed, dtype=bool)
    if not mask.any(axis=1).all():
        raise ValueError("mla_layer: a query row has no allowed key")
    scale = (d_nope + d_pe) ** -0.5
    o = np.zeros((T, H, d_v))
    for h in range(H):
        logits = (q_nope[:, h] @ k_nope[:, h].T + q_pe[:, h] @ k_pe.T) * scale  # [T, T]
        logits = np.where(mask, logits, -np.inf)
        o[:, h] = softmax(logits, axis=-1) @ v[:, h]
    o = o.reshape(T, H * d_v)  # head-major
    if _has(p, "g_proj"):
        o = o * sigmoid(x @ _w(p, "g_proj").T)
    return o @ _w(p, "o_proj").T


def indexer_scores(x, c_q, p, n_heads, head_dim):
    """Lightning indexer scores I [T, T], architecture.md §10.2; -inf where s > t.

    p: wq_b [H_I*d_I, r_q], wk [d_I, D], k_norm_weight, k_norm_bias [d_I], weights_proj [H_I, D].
    """
    x, c_q = _f64(x), _f64(c_q)
    T = x.shape[0]
    qI = (c_q @ _f64(p["wq_b"]).T).reshape(T, n_heads, head_dim)  # head-major, no rotation
    kI = layer_norm(x @ _f64(p["wk"]).T, p["k_norm_weight"], p["k_norm_bias"], INDEXER_LN_EPS)
    w = (x @ _f64(p["weights_proj"]).T) * n_heads ** -0.5  # [T, H_I]
    I = np.full((T, T), -np.inf)
    for t in range(T):
        for s in range(t + 1):
            I[t, s] = head_dim ** -0.5 * np.sum(w[t] * np.maximum(qI[t] @ kI[s], 0.0))
    return I


def indexer_select(scores, topk):
    """DSA selection, attention.md §3: allowed[t, s] = s <= t and s in top-min(k, t+1) of row t.

    Ties go to the lower index (stable sort), like lax.top_k; compare selections as sets.
    """
    scores = _f64(scores)
    T = scores.shape[0]
    allowed = np.zeros((T, scores.shape[1]), dtype=bool)
    for t in range(T):
        n = min(int(topk), t + 1)
        order = np.argsort(-scores[t, : t + 1], kind="stable")
        allowed[t, order[:n]] = True
    return allowed


def mla_attention_core(q_nope, q_pe, k_nope, k_pe, v, scale, allowed=None):
    """Naive MLA attention core, attention.md §1.2, one sequence of T queries over T keys.

    q_nope [T, H, dn], q_pe [T, H, dr], k_nope [T, H, dn], k_pe [T, dr] (shared by all heads),
    v [T, H, dv]; causal, ANDed with `allowed` [T, T] when given. Returns o [T, H, dv].
    """
    q_nope, q_pe, k_nope, k_pe, v = map(_f64, (q_nope, q_pe, k_nope, k_pe, v))
    T, H = q_nope.shape[:2]
    mask = np.tril(np.ones((T, T), dtype=bool))
    if allowed is not None:
        mask = mask & np.asarray(allowed, dtype=bool)
    o = np.zeros((T, H, v.shape[-1]))
    for h in range(H):
        logits = (q_nope[:, h] @ k_nope[:, h].T + q_pe[:, h] @ k_pe.T) * scale
        o[:, h] = softmax(np.where(mask, logits, -np.inf), axis=-1) @ v[:, h]
    return o


# ---------------------------------------------------------------- packed rows (segment ids)
# Each document of a packed row run alone (see kda.py); padding positions output zero.


def mla_attention_core_packed(q_nope, q_pe, k_nope, k_pe, v, scale, segment_ids, allowed=None):
    """mla_attention_core per document of one packed row; `allowed` [T, T] is cut per document."""
    o = np.zeros(np.shape(q_nope)[:2] + (np.shape(v)[-1],))
    for s, e in document_spans(segment_ids):
        sub = None if allowed is None else np.asarray(allowed)[s:e, s:e]
        o[s:e] = mla_attention_core(q_nope[s:e], q_pe[s:e], k_nope[s:e], k_pe[s:e], v[s:e], scale, sub)
    return o


def indexer_select_packed(scores, topk, segment_ids):
    """DSA selection per document: allowed[t, s] only for s in t's document, the top
    min(k, position in document + 1) of the document's causal scores. scores [T, T] as from
    `indexer_scores` (a pair's score depends on the pair alone, so a document's block of the
    row's scores is the document's own score matrix)."""
    scores = _f64(scores)
    allowed = np.zeros(scores.shape, dtype=bool)
    for s, e in document_spans(segment_ids):
        allowed[s:e, s:e] = indexer_select(scores[s:e, s:e], topk)
    return allowed


def mla_layer_packed(x, p, cfg, segment_ids, index=None):
    """mla_layer per document of one packed row x [T, D]; zeros at padding.

    index: None (dense), or (indexer params as for `indexer_scores`, n_heads, head_dim, topk)
    for DSA: each document selects among its own tokens.
    """
    x = _f64(x)
    y = np.zeros((x.shape[0], _w(p, "o_proj").shape[0]))
    for s, e in document_spans(segment_ids):
        allowed = None
        if index is not None:
            ip, n_heads, head_dim, topk = index
            c_q = mla_latents(x[s:e], p, cfg)["c_q"]
            allowed = indexer_select(indexer_scores(x[s:e], c_q, ip, n_heads, head_dim), topk)
        y[s:e] = mla_layer(x[s:e], p, cfg, allowed=allowed)
    return y
