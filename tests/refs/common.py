"""Float64 NumPy references: norms, activations, AttnRes mix, short conv.

Written from the specification only (docs/) (architecture.md §3, §4, §8; kda.md §2). Not from k31jax code.
"""

import numpy as np


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def sigmoid(x):
    """Stable logistic sigmoid, exp(-log(1 + exp(-x)))."""
    x = _f64(x)
    return np.exp(-np.logaddexp(0.0, -x))


def silu(x):
    """x * sigmoid(x)."""
    x = _f64(x)
    return x * sigmoid(x)


def softplus_torch(u):
    """torch softplus (beta 1, threshold 20): u if u > 20 else log1p(exp(u)); kda.md §3."""
    u = _f64(u)
    return np.where(u > 20.0, u, np.log1p(np.exp(np.minimum(u, 20.0))))


def softmax(x, axis=-1):
    """Max-subtracted softmax."""
    x = _f64(x)
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def rms_norm(x, w, eps):
    """Kimi RMSNorm, architecture.md §3: x * rsqrt(mean(x^2) + eps) * w."""
    x = _f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(w)


def layer_norm(x, w, b, eps):
    """LayerNorm (mean-centred, biased variance), indexer k_norm, architecture.md §10.1."""
    x = _f64(x)
    mu = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * _f64(w) + _f64(b)


def l2_normalize(x, eps=1e-6):
    """KDA q/k L2 norm, kda.md §2.4: x / sqrt(sum(x^2) + eps), eps inside the sqrt."""
    x = _f64(x)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def situ_glu(g, u, beta1, beta2):
    """SiTU-GLU, architecture.md §8: [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]; beta2 None -> u."""
    g, u = _f64(g), _f64(u)
    gate = beta1 * np.tanh(g / beta1) * sigmoid(g)
    up = u if beta2 is None else beta2 * np.tanh(u / beta2)
    return gate * up


def swiglu(g, u):
    """SwiGLU, architecture.md §8: silu(g) * u."""
    return silu(g) * _f64(u)


def attn_res_mix(candidates, w_norm, w_proj, eps=1e-5):
    """AttnRes Mix, architecture.md §4. candidates: list of [..., D] (snapshots, then prefix)."""
    vs = [_f64(v) for v in candidates]
    q = _f64(w_norm).reshape(-1) * _f64(w_proj).reshape(-1)  # fused pseudo-query [D]
    scores = []
    for v in vs:
        r = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
        scores.append(np.sum(r * q, axis=-1))  # [...]
    alpha = softmax(np.stack(scores, axis=0), axis=0)  # [n, ...]
    out = np.zeros_like(vs[0])
    for a, v in zip(alpha, vs):
        out = out + a[..., None] * v  # raw, un-normalised candidates
    return out


def short_conv(x, w, history=None):
    """Causal depthwise conv, kda.md §2.2: y_t[c] = sum_j w[c, j] * in_{t-K+1+j}[c]; no bias/act.

    x [T, C]; w [C, 1, K] or [C, K]; history [K-1, C] oldest first (None -> zeros).
    """
    x = _f64(x)
    w = _f64(w)
    if w.ndim == 3:
        w = w[:, 0, :]
    C, K = w.shape
    T = x.shape[0]
    hist = np.zeros((K - 1, C)) if history is None else _f64(history).reshape(K - 1, C)
    full = np.concatenate([hist, x], axis=0)  # row K-1+t is token t
    y = np.zeros((T, C))
    for t in range(T):
        for j in range(K):
            # in_{t-K+1+j} lives at row (t-K+1+j) + (K-1) = t + j of `full`
            y[t] += w[:, j] * full[t + j]
    return y
