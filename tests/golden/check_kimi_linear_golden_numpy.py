"""Cross-check of `kimi_linear_tiny/golden.npz` against a float64 NumPy model written from the spec.

The golden comes from transformers' `KimiLinearForCausalLM` (see make_kimi_linear_golden.py).
This script re-implements the same model independently from the specification (`docs/`: architecture.md §11,
kda.md, attention.md §1 and §7) in float64 NumPy, reading `model.safetensors` directly (BF16 is
decoded by hand, so only numpy is needed), and checks that the two agree. It then re-runs with
a list of deliberate bugs and checks that each one moves the logits well past any sane test
tolerance: the golden can tell them apart. (A wrong layer schedule, e.g. HF's default MLA at
0-indexed 4, 8, ..., is not in the list: the weights would not even load.)

    python tests/golden/check_kimi_linear_golden_numpy.py     # any python with numpy

Expected: correct model within ~1e-5 of the fp32 golden; every bug variant >= 1e-2 away.
Slow-ish (a per-token recurrence in float64): a few seconds.
"""

from __future__ import annotations

import json
import os
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DIR = os.path.join(HERE, "kimi_linear_tiny")

BUGS = {
    "o_norm_eps_1e-6": "KDA gated o_norm with eps 1e-6 instead of rms_norm_eps 1e-5",
    "l2_F.normalize": "q/k L2 norm as F.normalize (x / max(|x|, eps)) instead of x / sqrt(|x|^2 + 1e-6)",
    "kv_norm_eps_1e-5": "MLA kv_a_layernorm with rms_norm_eps instead of 1e-6",
    "scaling_1.0": "routed_scaling_factor 1.0 instead of 2.446",
    "biased_weights": "expert weights from the biased scores",
    "mla_scale_nope_only": "MLA softmax scale 1/sqrt(qk_nope) instead of 1/sqrt(nope + rope)",
    "lower_bound_gate": "K3 lower-bounded gate instead of the softplus gate",
    "A_log_per_channel": "A_log broadcast over channels instead of one per head",
    "read_before_write": "KDA read-out before the delta write (excludes the current token)",
    "no_renormalize": "router weights not renormalised",
}


def load_safetensors(path: str) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        raw = data[a:b]
        if meta["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        elif meta["dtype"] == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{name}: unexpected dtype {meta['dtype']}")
        out[name] = arr.reshape(meta["shape"]).astype(np.float64)
    return out


def rms(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def lin(x, w):
    return x @ w.T


def softplus(u):  # torch-thresholded
    return np.where(u > 20.0, u, np.log1p(np.exp(np.minimum(u, 20.0))))


class Model:
    def __init__(self, cfg: dict, W: dict, bug: str = ""):
        self.c, self.W, self.bug = cfg, W, bug
        lac = cfg["linear_attn_config"]
        self.H, self.dk, self.K = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
        n = cfg["num_hidden_layers"]
        self.mla_layers = {i - 1 for i in lac["full_attn_layers"]}
        assert self.mla_layers.isdisjoint(i - 1 for i in lac["kda_layers"])
        assert self.mla_layers | {i - 1 for i in lac["kda_layers"]} == set(range(n))

    def sub(self, prefix):
        return {k[len(prefix):]: v for k, v in self.W.items() if k.startswith(prefix)}

    def kda(self, x, p):
        B, T, _ = x.shape
        H, dk, K = self.H, self.dk, self.K

        def conv(y, w):  # causal depthwise, w [C, 1, K]; tap K-1 is the current token
            yp = np.concatenate([np.zeros((B, K - 1, y.shape[-1])), y], 1)
            return sum(w[:, 0, j] * yp[:, j : j + T] for j in range(K))

        q = silu(conv(lin(x, p["q_proj.weight"]), p["q_conv1d.weight"])).reshape(B, T, H, dk)
        k = silu(conv(lin(x, p["k_proj.weight"]), p["k_conv1d.weight"])).reshape(B, T, H, dk)
        v = silu(conv(lin(x, p["v_proj.weight"]), p["v_conv1d.weight"])).reshape(B, T, H, dk)
        if self.bug == "l2_F.normalize":
            l2 = lambda a: a / np.maximum(np.sqrt((a**2).sum(-1, keepdims=True)), 1e-6)  # noqa: E731
        else:
            l2 = lambda a: a / np.sqrt((a**2).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
        q, k = l2(q) * dk**-0.5, l2(k)
        z = (lin(lin(x, p["f_a_proj.weight"]), p["f_b_proj.weight"]) + p["dt_bias"]).reshape(B, T, H, dk)
        A = p["A_log"].reshape(H)  # [1, 1, H, 1] on disk
        if self.bug == "lower_bound_gate":
            g = -5.0 * sig(np.exp(A)[:, None] * z)
        elif self.bug == "A_log_per_channel":
            g = -np.exp(np.resize(A, dk)) * softplus(z)
        else:
            g = -np.exp(A)[:, None] * softplus(z)
        beta = sig(lin(x, p["b_proj.weight"]))
        S = np.zeros((B, H, dk, dk))  # key-major
        o = np.zeros((B, T, H, dk))
        for t in range(T):
            S = S * np.exp(g[:, t])[..., None]
            if self.bug == "read_before_write":
                o[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
            r = np.einsum("bhkv,bhk->bhv", S, k[:, t])
            S = S + beta[:, t, :, None, None] * np.einsum("bhk,bhv->bhkv", k[:, t], v[:, t] - r)
            if self.bug != "read_before_write":
                o[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
        gate = lin(lin(x, p["g_a_proj.weight"]), p["g_b_proj.weight"]).reshape(B, T, H, dk)
        eps = 1e-6 if self.bug == "o_norm_eps_1e-6" else self.c["rms_norm_eps"]
        y = rms(o, p["o_norm.weight"], eps) * sig(gate)
        return lin(y.reshape(B, T, H * dk), p["o_proj.weight"])

    def mla(self, x, p):
        c = self.c
        B, T, _ = x.shape
        nh, dn, dr, dv, r = (c[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
        assert c["q_lora_rank"] is None
        q = lin(x, p["q_proj.weight"]).reshape(B, T, nh, dn + dr)
        ckv = lin(x, p["kv_a_proj_with_mqa.weight"])
        lat, kpe = ckv[..., :r], ckv[..., r:]  # k_pe: not normalised, not rotated
        lat = rms(lat, p["kv_a_layernorm.weight"], c["rms_norm_eps"] if self.bug == "kv_norm_eps_1e-5" else 1e-6)
        kv = lin(lat, p["kv_b_proj.weight"]).reshape(B, T, nh, dn + dv)
        kn, vv = kv[..., :dn], kv[..., dn:]
        scale = dn**-0.5 if self.bug == "mla_scale_nope_only" else (dn + dr) ** -0.5
        logit = (np.einsum("bthd,bshd->bhts", q[..., :dn], kn) + np.einsum("bthd,bsd->bhts", q[..., dn:], kpe)) * scale
        logit = np.where(np.tril(np.ones((T, T), bool)), logit, -np.inf)
        pr = np.exp(logit - logit.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("bhts,bshd->bthd", pr, vv).reshape(B, T, nh * dv)
        return lin(o, p["o_proj.weight"])

    @staticmethod
    def swiglu(x, wg, wu, wd):
        return lin(silu(lin(x, wg)) * lin(x, wu), wd)

    def moe(self, x, p):
        c = self.c
        E, k = c["num_experts"], c["num_experts_per_token"]
        s = sig(lin(x, p["gate.weight"]))
        sb = s + p["gate.e_score_correction_bias"]
        idx = np.argsort(-sb, -1, kind="stable")[..., :k]
        w = np.take_along_axis(sb if self.bug == "biased_weights" else s, idx, -1)
        if self.bug != "no_renormalize":
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        w = w * (1.0 if self.bug == "scaling_1.0" else c["routed_scaling_factor"])
        y = self.swiglu(x, p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"], p["shared_experts.down_proj.weight"])
        for e in range(E):
            we = (w * (idx == e)).sum(-1, keepdims=True)
            if we.any():
                y = y + we * self.swiglu(x, p[f"experts.{e}.w1.weight"], p[f"experts.{e}.w3.weight"], p[f"experts.{e}.w2.weight"])
        return y

    def __call__(self, ids):
        c, W = self.c, self.W
        eps = c["rms_norm_eps"]
        h = W["model.embed_tokens.weight"][ids]
        for i in range(c["num_hidden_layers"]):
            pre = f"model.layers.{i}."
            x = rms(h, W[pre + "input_layernorm.weight"], eps)
            attn = self.sub(pre + "self_attn.")
            h = h + (self.mla(x, attn) if i in self.mla_layers else self.kda(x, attn))
            x = rms(h, W[pre + "post_attention_layernorm.weight"], eps)
            if i < c["first_k_dense_replace"]:
                m = self.sub(pre + "mlp.")
                h = h + self.swiglu(x, m["gate_proj.weight"], m["up_proj.weight"], m["down_proj.weight"])
            else:
                h = h + self.moe(x, self.sub(pre + "block_sparse_moe."))
        return lin(rms(h, W["model.norm.weight"], eps), W["lm_head.weight"])


def main():
    with open(os.path.join(DIR, "config.json")) as f:
        cfg = json.load(f)
    W = load_safetensors(os.path.join(DIR, "model.safetensors"))
    G = np.load(os.path.join(DIR, "golden.npz"))
    ok = True
    ref = Model(cfg, W)
    for ids_key, lg_key in (("input_ids", "logits"), ("long_input_ids", "long_logits")):
        err = float(np.abs(ref(G[ids_key]) - G[lg_key]).max())
        good = err < 1e-4
        ok &= good
        print(f"{'ok ' if good else 'BAD'} spec model vs golden {lg_key}: max abs diff {err:.3e}")
    ids, gold = G["input_ids"], G["logits"]
    for bug, what in BUGS.items():
        err = float(np.abs(Model(cfg, W, bug)(ids) - gold).max())
        good = err > 1e-2
        ok &= good
        print(f"{'ok ' if good else 'BAD'} bug {bug!r} ({what}): max abs diff {err:.3e}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
