"""Float64 NumPy references for Kimi Delta Attention (kda.md §2-§7).

Written from the specification only (docs/); not from k31jax code. One sequence, no batch axis.
"""

import numpy as np

from .common import _f64, l2_normalize, short_conv, sigmoid, silu, softplus_torch


def _w(p, name):
    """Weight by HF name, accepting `name` or `name.weight`."""
    if name in p:
        return _f64(p[name])
    return _f64(p[name + ".weight"])


def _has(p, name):
    return name in p or (name + ".weight") in p


def kda_gate(z, A_log, dt_bias, num_heads, lower_bound):
    """KDA forget gate g (log decay), kda.md §3. z [T, H, dk] = f_b(f_a x); returns [T, H, dk].

    lower_bound float: lb * sigmoid(exp(A_log[h]) * (z + dt_bias)).
    lower_bound None:  -exp(A_log[h]) * softplus(z + dt_bias) (torch threshold 20).
    """
    z = _f64(z)
    T, H, dk = z.shape
    assert H == num_heads
    a = _f64(A_log).reshape(-1)[:num_heads]  # one scalar per head; [128] padded or [1,1,H,1]
    assert a.shape == (num_heads,)
    u = z + _f64(dt_bias).reshape(H, dk)[None]
    A = np.exp(a)[None, :, None]
    if lower_bound is None:
        return -A * softplus_torch(u)
    return float(lower_bound) * sigmoid(A * u)


def kda_recurrent(q, k, v, g, beta, initial_state=None):
    """Delta-rule recurrence, kda.md §4 (key-major state), one token at a time.

    q, k, g [T, H, dk]; v [T, H, dv]; beta [T, H]; q, k used as given.
    Returns (o [T, H, dv], S [H, dk, dv]).
    """
    q, k, v, g, beta = map(_f64, (q, k, v, g, beta))
    T, H, dk = q.shape
    dv = v.shape[-1]
    S = np.zeros((H, dk, dv)) if initial_state is None else _f64(initial_state).copy()
    o = np.zeros((T, H, dv))
    for t in range(T):
        for h in range(H):
            Sh = np.exp(g[t, h])[:, None] * S[h]             # 1. decay row i by e^{g_t[i]}
            r = Sh.T @ k[t, h]                                # 2. read with decayed state
            Sh = Sh + beta[t, h] * np.outer(k[t, h], v[t, h] - r)  # 3. delta write
            o[t, h] = Sh.T @ q[t, h]                          # 4. read-out after the write
            S[h] = Sh
    return o, S


def kda_layer(x, p, cfg, conv_history=None, initial_state=None):
    """Whole KDA mixer, kda.md §2-§7, for x [T, D] (already input_layernorm'd).

    p: HF names (q_proj, k_proj, v_proj, {q,k,v}_conv1d, f_a_proj, f_b_proj, b_proj, A_log,
    dt_bias, o_norm, o_proj, g_proj | g_a_proj+g_b_proj). cfg: num_heads, head_dim,
    lower_bound, rms_norm_eps. conv_history: {'q','k','v'} [K-1, H*dk] pre-conv rows or None.
    Returns (y [T, D], final_state [H, dk, dv], new_conv_history).
    """
    x = _f64(x)
    T, D = x.shape
    H, dk = int(cfg["num_heads"]), int(cfg["head_dim"])
    eps = float(cfg["rms_norm_eps"])

    # kda.md §2: project, short conv (full channels, per branch), SiLU on q, k and v.
    conv_out, new_hist = {}, {}
    for b in ("q", "k", "v"):
        pre = x @ _w(p, f"{b}_proj").T  # [T, C]
        wc = _w(p, f"{b}_conv1d")
        K = wc.shape[-1]
        C = pre.shape[1]
        hist = None if conv_history is None else conv_history[b]
        conv_out[b] = silu(short_conv(pre, wc, hist))
        prev = np.zeros((K - 1, C)) if hist is None else _f64(hist).reshape(K - 1, C)
        new_hist[b] = np.concatenate([prev, pre], axis=0)[-(K - 1):] if K > 1 else np.zeros((0, C))
    dv = conv_out["v"].shape[1] // H
    q = conv_out["q"].reshape(T, H, dk)
    k = conv_out["k"].reshape(T, H, dk)
    v = conv_out["v"].reshape(T, H, dv)
    q = l2_normalize(q, 1e-6) * dk ** -0.5
    k = l2_normalize(k, 1e-6)

    # kda.md §3: gates from x.
    z = ((x @ _w(p, "f_a_proj").T) @ _w(p, "f_b_proj").T).reshape(T, H, dk)
    g = kda_gate(z, _w(p, "A_log"), _w(p, "dt_bias"), H, cfg["lower_bound"])
    beta = sigmoid(x @ _w(p, "b_proj").T)  # [T, H]

    # kda.md §4: recurrence.
    o, S = kda_recurrent(q, k, v, g, beta, initial_state)

    # kda.md §7: gated RMSNorm per head (normalise, weight, then gate), o_proj.
    if _has(p, "g_proj"):
        G = x @ _w(p, "g_proj").T
    else:
        G = (x @ _w(p, "g_a_proj").T) @ _w(p, "g_b_proj").T
    G = G.reshape(T, H, dv)
    on = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps)
    on = on * _w(p, "o_norm").reshape(-1)[None, None, :] * sigmoid(G)
    y = on.reshape(T, H * dv) @ _w(p, "o_proj").T
    return y, S, new_hist


# ---------------------------------------------------------------- packed rows (segment ids)
#
# A packed row holds several documents: segment_ids[t] = 1, 2, ... per contiguous document and
# 0 for padding (kda.md §6: reset the state and conv window at a segment start). "Exact" means
# each document computes what it would alone, so the references below literally run every
# document alone through the single-sequence references and place the results; padding
# positions output zero.


def document_spans(segment_ids):
    """[(start, end)] of the documents of one row: maximal runs of one non-zero id."""
    ids = np.asarray(segment_ids).reshape(-1)
    spans, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or ids[t] != ids[start]:
            if ids[start] != 0:
                spans.append((start, t))
            start = t
    return spans


def short_conv_packed(x, w, segment_ids, history=None):
    """short_conv per document, x [T, C]; zeros at padding. Only a document starting at t = 0
    continues `history` [K-1, C] (the row's left context); every other one starts from zeros.

    Returns (y [T, C], the new history: the last K-1 pre-conv inputs of the last document
    alone, i.e. of its left context followed by its tokens; `history` for a row without one).
    """
    x = _f64(x)
    C = x.shape[1]
    K = _f64(w).shape[-1]
    zeros = np.zeros((K - 1, C))
    y = np.zeros_like(x)
    new_hist = zeros if history is None else _f64(history).reshape(K - 1, C)
    for s, e in document_spans(segment_ids):
        left = zeros if (s != 0 or history is None) else _f64(history).reshape(K - 1, C)
        y[s:e] = short_conv(x[s:e], w, left)
        new_hist = np.concatenate([left, x[s:e]], axis=0)[len(left) + (e - s) - (K - 1):]
    return y, new_hist


def kda_recurrent_packed(q, k, v, g, beta, segment_ids, initial_state=None):
    """kda_recurrent per document (one row; shapes as kda_recurrent); zero outputs at padding.

    A document starting at t = 0 continues `initial_state`, every other starts from zero. The
    returned state is the last document's (padding steps are identities), or the initial
    state (zeros when None) for a row without documents.
    """
    q, k, v, g, beta = map(_f64, (q, k, v, g, beta))
    T, H, _ = q.shape
    o = np.zeros((T, H, v.shape[-1]))
    S = np.zeros((H, q.shape[-1], v.shape[-1])) if initial_state is None else _f64(initial_state)
    for s, e in document_spans(segment_ids):
        o[s:e], S = kda_recurrent(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                  initial_state if s == 0 else None)
    return o, S


def kda_layer_packed(x, p, cfg, segment_ids):
    """kda_layer per document of one packed row x [T, D], each from a fresh state and conv
    window; zeros at padding. Returns (y [T, D], the last document's final state and conv
    history, as kda_layer returns them; None, None for a row without documents)."""
    x = _f64(x)
    y = np.zeros((x.shape[0], _w(p, "o_proj").shape[0]))
    S = hist = None
    for s, e in document_spans(segment_ids):
        y[s:e], S, hist = kda_layer(x[s:e], p, cfg)
    return y, S, hist
