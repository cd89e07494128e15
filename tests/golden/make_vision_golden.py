"""Golden outputs of a tiny MoonViT-V2 + patch-merger projector and of the K3 image processor,
from an independent PyTorch implementation (a peer for tests/vision/test_vision_golden.py).

The peer is written here from the public MoonViT sources as read for understanding (vLLM's
`kimi_k25_vit.py` MoonViT3d modules and projector, the K3 release's `media_utils.py` image
processor as carried by SGLang), in their idiom, not from k31jax:
- patch embedding: `nn.Conv2d(3, D, p, stride=p, bias=False)` on `[N, 3, p, p]` patches;
- position table: `F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear")`
  (align_corners=False, no antialias), skipped when the grid is the table's size;
- 2-D RoPE: a complex `torch.polar` table over a 512 x 512 grid, `[x f_i, y f_i]` interleaved,
  applied with `torch.view_as_complex` on adjacent pairs;
- blocks: `nn.RMSNorm(D)` (no eps: float32's), `wqkv` split as (3, heads, head_dim), per-image
  `F.scaled_dot_product_attention` over `cu_seqlens`, `wo`, then `fc1(gelu_tanh(fc0(.)))`;
- `sd2_tpool` merge by view/permute, projector `Linear -> GELU (erf) -> Linear -> RMSNorm(eps)`;
- processor: `navit_resize_image`'s sizes, PIL bicubic resize, the chessboard fill after
  resize (float32 alpha, uint8 truncation), zero padding right/bottom, `(x/255 - mean) / std`,
  `navit_patchify`.

Run with the torch venv from the repository root (a few seconds on CPU):

    ./.torchvenv/bin/python tests/golden/make_vision_golden.py [--out tests/golden/vision_tiny.npz]

The .npz holds: the two test images as PNG bytes (`image_0`, `image_1`: an RGB 100x70 and an
RGBA 60x130), the processor settings, the tiny tower config (`config_json`), the weights by
release name (`w:<name>`, float32), and the outputs: `pixel_values` [N, 3, 14, 14], `grid_thws`
[2, 3], `num_tokens` [2], `tower` [N, D], `merged` [M, 4D], `projected` [M, text].
"""

from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

HERE = Path(__file__).resolve().parent
CONFIG = dict(patch_size=14, hidden=32, heads=2, qkv=32, mlp=64, layers=2, pos_h=7, pos_w=9, text=24, merge=2,
              projector_eps=1e-5)
PROCESSOR = dict(patch_size=14, merge_kernel_size=2, in_patch_limit=48, patch_limit_on_one_side=12,
                 image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], chessboard_square_size=8,
                 chessboard_white_value=255, chessboard_gray_value=180)


# ------------------------------------------------------------------------------- processor
def resize_config(width, height, c):
    s1 = math.sqrt(c["in_patch_limit"] / (max(1.0, width // c["patch_size"]) * max(1.0, height // c["patch_size"])))
    s2 = c["patch_limit_on_one_side"] * c["patch_size"] / width
    s3 = c["patch_limit_on_one_side"] * c["patch_size"] / height
    scale = min(1.0, s1, s2, s3)
    cap = c["patch_limit_on_one_side"] * c["patch_size"]
    new_w, new_h = min(max(1, int(width * scale)), cap), min(max(1, int(height * scale)), cap)
    factor = c["merge_kernel_size"] * c["patch_size"]
    pad_w, pad_h = (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
    return new_w, new_h, pad_w, pad_h, ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)


def fill_background(image: Image.Image, c) -> Image.Image:
    if image.mode == "RGB":
        return image
    rgba = np.array(image.convert("RGBA"))
    h, w = rgba.shape[:2]
    s = c["chessboard_square_size"]
    bg = np.full((h, w, 3), c["chessboard_white_value"], np.uint8)
    for y in range(0, h, s):
        for x in range(0, w, s):
            if (y // s + x // s) % 2 == 1:
                bg[y:y + s, x:x + s] = c["chessboard_gray_value"]
    alpha = np.repeat((rgba[:, :, 3].astype(np.float32) / 255.0)[..., None], 3, axis=2)
    return Image.fromarray((alpha * rgba[:, :, :3] + (1 - alpha) * bg).astype(np.uint8))


def process(png: bytes, c):
    image = Image.open(io.BytesIO(png))
    new_w, new_h, pad_w, pad_h, tokens = resize_config(image.width, image.height, c)
    image = fill_background(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC), c)
    pixels = np.pad(np.asarray(image), ((0, pad_h), (0, pad_w), (0, 0)), constant_values=0)[None]
    x = (pixels / 255.0).astype(np.float32)
    x -= np.array(c["image_mean"])
    x *= 1.0 / np.array(c["image_std"])
    t, hh, ww, ch = x.shape
    p = c["patch_size"]
    patches = x.reshape(t, hh // p, p, ww // p, p, ch).transpose(0, 1, 3, 5, 2, 4).reshape(-1, ch, p, p)
    return patches, [t, hh // p, ww // p], tokens


# ------------------------------------------------------------------------------- tower
class Rope2D:
    def __init__(self, head_dim, max_h=512, max_w=512, theta=10000.0):
        n = max_h * max_w
        flat = torch.arange(n).float()
        xs, ys = flat % max_w, flat // max_w
        freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 4)[: head_dim // 4].float() / head_dim))
        xc = torch.polar(torch.ones(n, head_dim // 4), torch.outer(xs, freqs))
        yc = torch.polar(torch.ones(n, head_dim // 4), torch.outer(ys, freqs))
        self.table = torch.stack([xc, yc], dim=-1).reshape(max_h, max_w, head_dim // 2)

    def for_grids(self, grids):
        return torch.cat([self.table[:h, :w].reshape(-1, self.table.shape[-1]).repeat(t, 1) for t, h, w in grids])


def rotate(x, freqs):  # x [N, H, hd], freqs [N, hd/2] complex
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * freqs[:, None, :]).flatten(-2).type_as(x)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c["hidden"]
        self.heads, self.hd = c["heads"], c["qkv"] // c["heads"]
        self.norm0, self.norm1 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.wqkv = nn.Linear(d, 3 * c["qkv"], bias=False)
        self.wo = nn.Linear(c["qkv"], d, bias=False)
        self.mlp = nn.ModuleDict({"fc0": nn.Linear(d, c["mlp"], bias=False), "fc1": nn.Linear(c["mlp"], d, bias=False)})

    def forward(self, x, cu_seqlens, freqs):
        n = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(n, 3, self.heads, self.hd).unbind(1)
        q, k = rotate(q, freqs), rotate(k, freqs)
        outs = []
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1))
            outs.append(o.transpose(0, 1).reshape(b - a, -1))
        x = x + self.wo(torch.cat(outs))
        return x + self.mlp["fc1"](F.gelu(self.mlp["fc0"](self.norm1(x)), approximate="tanh"))


class Tower(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, p = c["hidden"], c["patch_size"]
        self.patch_embed = nn.ModuleDict({"proj": nn.Conv2d(3, d, p, stride=p, bias=False)})
        self.patch_embed.pos_emb = nn.Module()
        self.patch_embed.pos_emb.weight = nn.Parameter(torch.empty(c["pos_h"], c["pos_w"], d))
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList([Block(c) for _ in range(c["layers"])])
        self.encoder.final_layernorm = nn.RMSNorm(d)
        self.rope = Rope2D(c["qkv"] // c["heads"])

    def forward(self, pixels, grids):
        x = self.patch_embed["proj"](pixels).flatten(1)
        table = self.patch_embed.pos_emb.weight
        pos = []
        for t, h, w in grids:
            if (h, w) == tuple(table.shape[:2]):
                pe = table.flatten(0, 1)
            else:
                pe = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear")[0]
                pe = pe.permute(1, 2, 0).flatten(0, 1)
            pos.append(pe.repeat(t, 1))
        x = x + torch.cat(pos)
        lengths = torch.tensor([t * h * w for t, h, w in grids])
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        freqs = self.rope.for_grids(grids)
        for block in self.encoder.blocks:
            x = block(x, cu, freqs)
        return self.encoder.final_layernorm(x)


def merge(x, grids, k=2):
    out = []
    for seq, (t, h, w) in zip(x.split([t * h * w for t, h, w in grids]), grids):
        v = seq.view(t, h // k, k, w // k, k, -1).mean(0)
        out.append(v.permute(0, 2, 1, 3, 4).reshape((h // k) * (w // k), -1))
    return torch.cat(out)


class Projector(nn.Module):
    def __init__(self, c):
        super().__init__()
        m = c["hidden"] * c["merge"] ** 2
        self.proj = nn.Sequential(nn.Linear(m, m, bias=False), nn.GELU(), nn.Linear(m, c["text"], bias=False))
        self.post_norm = nn.RMSNorm(c["text"], eps=c["projector_eps"])

    def forward(self, x):
        return self.post_norm(self.proj(x))


# ------------------------------------------------------------------------------- inputs
def test_images(seed):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:70, :100]
    rgb = np.stack([xx * 2.5, yy * 3.6, (xx + yy) * 1.5], -1) + rng.normal(0, 12, (70, 100, 3))
    yy, xx = np.mgrid[:130, :60]
    rgba = np.stack([200 - yy, xx * 4, 120 + 0 * xx, (xx * 4 + yy) % 256], -1) + rng.normal(0, 8, (130, 60, 4))
    pngs = []
    for array in (rgb, rgba):
        buf = io.BytesIO()
        Image.fromarray(np.clip(array, 0, 255).astype(np.uint8)).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    return pngs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "vision_tiny.npz")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    tower, projector = Tower(CONFIG), Projector(CONFIG)
    weights = {}
    with torch.no_grad():
        for prefix, module in (("vision_tower.", tower), ("mm_projector.", projector)):
            for name, p in module.named_parameters():
                if name.endswith("norm0.weight") or name.endswith("norm1.weight") or "layernorm" in name \
                        or "post_norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif "pos_emb" in name:
                    p.copy_(torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) / math.sqrt(p[0].numel()))
                weights[prefix + name] = p.detach().numpy().copy()

    pngs = test_images(args.seed)
    processed = [process(png, PROCESSOR) for png in pngs]
    pixels = torch.from_numpy(np.concatenate([p for p, _, _ in processed]))
    grids = [g for _, g, _ in processed]
    with torch.inference_mode():
        out_tower = tower(pixels, grids)
        out_merged = merge(out_tower, grids, CONFIG["merge"])
        out_projected = projector(out_merged)
    payload = {f"w:{k}": v.astype(np.float32) for k, v in weights.items()}
    payload.update(
        image_0=np.frombuffer(pngs[0], np.uint8), image_1=np.frombuffer(pngs[1], np.uint8),
        config_json=np.array(json.dumps({"tower": CONFIG, "processor": PROCESSOR})),
        pixel_values=pixels.numpy(), grid_thws=np.array(grids), num_tokens=np.array([t for _, _, t in processed]),
        tower=out_tower.numpy(), merged=out_merged.numpy(), projected=out_projected.numpy())
    tmp = args.out.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **payload)
    tmp.replace(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes): grids {grids}, tokens "
          f"{[t for _, _, t in processed]}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
