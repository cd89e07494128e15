"""Float64 NumPy references: MoE router, Stable LatentMoE, dense MLP.

attention.md §7 and architecture.md §7-§8. Written from the specification only (docs/).
"""

import numpy as np

from .common import _f64, rms_norm, sigmoid, situ_glu, softmax, swiglu


def route(x, w_gate, bias, top_k, renormalize, scaling, n_group=1, topk_group=1,
          activation="sigmoid"):
    """MoE router, attention.md §7. x [N, D], w_gate [E, D], bias [E] or None.

    Returns (idx [N, K] ascending expert id, weights [N, K] in idx order).
    """
    x = _f64(x)
    W = _f64(w_gate)
    N = x.shape[0]
    E = W.shape[0]
    logits = x @ W.T
    if activation == "sigmoid":
        s = sigmoid(logits)
    elif activation == "softmax":
        s = softmax(logits, axis=-1)
    else:
        raise ValueError(f"unknown router activation {activation!r}")
    b = np.zeros(E) if bias is None else _f64(bias).reshape(E)
    idx = np.zeros((N, top_k), dtype=np.int64)
    wts = np.zeros((N, top_k))
    for n in range(N):
        sp = s[n] + b  # bias only for choosing
        if n_group > 1 and n_group > topk_group:
            grp = sp.reshape(n_group, E // n_group)
            gscore = np.array([np.sum(np.sort(row)[::-1][:2]) for row in grp])
            keep = np.argsort(-gscore, kind="stable")[:topk_group]
            gmask = np.zeros(n_group, dtype=bool)
            gmask[keep] = True
            sp = np.where(np.repeat(gmask, E // n_group), sp, -np.inf)
        chosen = np.argsort(-sp, kind="stable")[:top_k]  # ties -> lower id
        chosen = np.sort(chosen)
        w = s[n, chosen]  # unbiased scores
        if top_k > 1 and renormalize:
            w = w / (np.sum(w) + 1e-20)
        w = w * scaling
        idx[n], wts[n] = chosen, w
    return idx, wts


def _glu(g, u, act, beta1=None, beta2=None):
    if act == "situ":
        return situ_glu(g, u, beta1, beta2)
    if act == "silu":
        return swiglu(g, u)
    raise ValueError(f"unknown activation {act!r}")


def dense_mlp(x, p, act="situ", beta1=4.0, beta2=25.0):
    """Dense GLU MLP, architecture.md §8: down(act(gate x, up x)). p: gate_proj, up_proj, down_proj."""
    x = _f64(x)
    g = x @ _f64(p["gate_proj"]).T
    u = x @ _f64(p["up_proj"]).T
    return _glu(g, u, act, beta1, beta2) @ _f64(p["down_proj"]).T


def latent_moe(x, p, cfg):
    """Stable LatentMoE, architecture.md §7, per-token loop. x [N, D]; returns y [N, D].

    p: gate, e_score_correction_bias, routed_expert_down_proj (absent -> no latent),
    routed_expert_norm (optional), routed_expert_up_proj, experts [{w1, w2, w3}],
    shared_experts {gate_proj, up_proj, down_proj} or None.
    cfg: top_k, renormalize, routed_scaling_factor, rms_norm_eps, n_group, topk_group,
    act ('situ' + beta1, beta2 | 'silu'), optional router_activation (default sigmoid).
    """
    x = _f64(x)
    N, D = x.shape
    act = cfg["act"]
    b1, b2 = cfg.get("beta1"), cfg.get("beta2")
    idx, wts = route(x, p["gate"], p.get("e_score_correction_bias"), int(cfg["top_k"]),
                     bool(cfg["renormalize"]), float(cfg["routed_scaling_factor"]),
                     int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1)),
                     cfg.get("router_activation", "sigmoid"))
    down = p.get("routed_expert_down_proj")
    norm = p.get("routed_expert_norm")
    up = p.get("routed_expert_up_proj")
    shared = p.get("shared_experts")
    y = np.zeros((N, D))
    for n in range(N):
        u_in = x[n] if down is None else _f64(down) @ x[n]  # 1-2: router on full x, then down
        u = None
        for e, w in zip(idx[n], wts[n]):  # 3-4: experts in latent space, weighted sum
            ex = p["experts"][int(e)]
            h = _glu(_f64(ex["w1"]) @ u_in, _f64(ex["w3"]) @ u_in, act, b1, b2)
            term = w * (_f64(ex["w2"]) @ h)
            u = term if u is None else u + term
        if norm is not None:  # 5: one RMSNorm on the summed latent
            u = rms_norm(u, norm, float(cfg["rms_norm_eps"]))
        yr = u if up is None else _f64(up) @ u  # 6: up to D
        if shared is not None:  # 7: shared experts on the original x
            yr = yr + dense_mlp(x[n][None], shared, act, b1, b2)[0]
        y[n] = yr
    return y
