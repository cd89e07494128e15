"""Float64 NumPy references for the MoonViT-V2 tower, merge and projector.

Written from the specification, vision.md §1-§4 (and checkpoint_format.md §3.7 for the tensor
shapes); weights are taken in the release layout (torch `[out, in]` matrices, the Conv2d
kernel `[D, 3, p, p]`), images one at a time, so nothing here shares code or layout with k31jax.
"""

import math

import numpy as np

from .common import rms_norm


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def gelu_tanh(x):
    """torch gelu(approximate='tanh')."""
    x = _f64(x)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf(x):
    x = _f64(x)
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def conv_patch_embed(image, weight):
    """Conv2d(3 -> D, kernel p, stride p, no bias) on one `[3, H, W]` image, flattened row-major
    over the `(H/p, W/p)` output grid: `[h*w, D]`."""
    image, weight = _f64(image), _f64(weight)
    d, c, p, _ = weight.shape
    h, w = image.shape[1] // p, image.shape[2] // p
    out = np.zeros((h, w, d))
    for i in range(h):
        for j in range(w):
            window = image[:, i * p:(i + 1) * p, j * p:(j + 1) * p]
            out[i, j] = np.tensordot(weight, window, axes=([1, 2, 3], [0, 1, 2]))
    return out.reshape(h * w, d)


def resize_bilinear(table, out_h, out_w):
    """torch F.interpolate(mode='bilinear', align_corners=False, antialias=False) of a
    `[Hin, Win, D]` table to `[out_h, out_w, D]`, one output pixel at a time."""
    table = _f64(table)
    hin, win, _ = table.shape

    def source(o, n_in, n_out):
        s = max((o + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = int(math.floor(s))
        i1 = min(i0 + 1, n_in - 1)
        return i0, i1, s - i0

    out = np.zeros((out_h, out_w, table.shape[2]))
    for y in range(out_h):
        y0, y1, fy = source(y, hin, out_h)
        for x in range(out_w):
            x0, x1, fx = source(x, win, out_w)
            out[y, x] = ((1 - fy) * ((1 - fx) * table[y0, x0] + fx * table[y0, x1])
                         + fy * ((1 - fx) * table[y1, x0] + fx * table[y1, x1]))
    return out


def rope_2d(x, grid_h, grid_w, theta=10000.0):
    """Rotate `[h*w, H, hd]` (row-major patches) by the 2-D RoPE: pair m = (x[2m], x[2m+1])
    as the complex number x[2m] + i x[2m+1], times exp(i angle_m), angles
    `[col f_0, row f_0, col f_1, row f_1, ...]`, `f_i = theta^(-4i/hd)`."""
    x = _f64(x)
    hd = x.shape[-1]
    freqs = theta ** (-4.0 * np.arange(hd // 4) / hd)
    out = np.empty_like(x)
    for n in range(grid_h * grid_w):
        row, col = divmod(n, grid_w)
        angles = np.empty(hd // 2)
        angles[0::2] = col * freqs
        angles[1::2] = row * freqs
        z = (x[n, :, 0::2] + 1j * x[n, :, 1::2]) * np.exp(1j * angles)
        out[n, :, 0::2] = z.real
        out[n, :, 1::2] = z.imag
    return out


def attention(q, k, v):
    """Full, non-causal softmax attention of one image, scale hd^-1/2: `[n, H, hd]`."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    logits = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    logits -= logits.max(-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


def block(x, p, grid_h, grid_w, num_heads, eps):
    """One pre-norm block of one image; `p` holds the release tensors of `blocks.{j}.`."""
    x = _f64(x)
    n = x.shape[0]
    qkv = rms_norm(x, p["norm0.weight"], eps) @ _f64(p["wqkv.weight"]).T
    e = qkv.shape[1] // 3
    q, k, v = (qkv[:, i * e:(i + 1) * e].reshape(n, num_heads, -1) for i in range(3))
    q, k = rope_2d(q, grid_h, grid_w), rope_2d(k, grid_h, grid_w)
    x = x + attention(q, k, v).reshape(n, e) @ _f64(p["wo.weight"]).T
    h = rms_norm(x, p["norm1.weight"], eps) @ _f64(p["mlp.fc0.weight"]).T
    return x + gelu_tanh(h) @ _f64(p["mlp.fc1.weight"]).T


def tower(image, weights, cfg):
    """The tower on one normalised `[3, H, W]` image; `weights` by release name without the
    `vision_tower.` prefix; `cfg` a dict with num_layers, num_heads, patch_size, eps."""
    p = cfg["patch_size"]
    h, w = image.shape[1] // p, image.shape[2] // p
    x = conv_patch_embed(image, weights["patch_embed.proj.weight"])
    x = x + resize_bilinear(weights["patch_embed.pos_emb.weight"], h, w).reshape(h * w, -1)
    for j in range(cfg["num_layers"]):
        prefix = f"encoder.blocks.{j}."
        blk = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        x = block(x, blk, h, w, cfg["num_heads"], cfg["eps"])
    return rms_norm(x, weights["encoder.final_layernorm.weight"], cfg["eps"])


def merge_2x2(features, grid_h, grid_w):
    """Each merged token = its 2x2 patches' features concatenated (TL, TR, BL, BR), tokens
    row-major over `(h/2, w/2)`."""
    features = _f64(features).reshape(grid_h, grid_w, -1)
    out = []
    for i in range(grid_h // 2):
        for j in range(grid_w // 2):
            out.append(np.concatenate([features[2 * i, 2 * j], features[2 * i, 2 * j + 1],
                                       features[2 * i + 1, 2 * j], features[2 * i + 1, 2 * j + 1]]))
    return np.stack(out)


def projector(merged, weights, eps):
    """patchmergerv2 with release weights (`proj.0.weight`, `proj.2.weight`, `post_norm.weight`)."""
    h = gelu_erf(_f64(merged) @ _f64(weights["proj.0.weight"]).T)
    return rms_norm(h @ _f64(weights["proj.2.weight"]).T, weights["post_norm.weight"], eps)


def navit_size(width, height, patch_size=14, merge=2, in_patch_limit=65536, side_limit=512):
    """vision.md §4 step 1 and 4: (new_w, new_h, padded_w, padded_h, llm_tokens)."""
    scale = min(1.0, math.sqrt(in_patch_limit / (max(1, width // patch_size) * max(1, height // patch_size))),
                side_limit * patch_size / width, side_limit * patch_size / height)
    new_w = min(max(1, int(width * scale)), side_limit * patch_size)
    new_h = min(max(1, int(height * scale)), side_limit * patch_size)
    f = merge * patch_size
    pw, ph = -(-new_w // f) * f, -(-new_h // f) * f
    return new_w, new_h, pw, ph, (pw // f) * (ph // f)
