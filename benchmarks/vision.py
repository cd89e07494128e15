"""Vision encoding on CPU: images/s and tokens per image for one 1024x1024 image at the K3 width,
k31jax (jit) next to the PyTorch peer of tests/golden/make_vision_golden.py (eager), in one run.

Both encode the same PNG end to end: K3 preprocessing (decode, resize/pad, normalise,
patchify), the MoonViT-V2 tower at K3 width (1024 wide, 12 heads x 128, MLP 4096), the 2x2
merge and the projector to 7168, in float32. The torch side runs in its own venv
($K31JAX_TORCH_PYTHON or ./.torchvenv/bin/python) as a child process that times one encode per
request, so the two sides alternate repeat by repeat (each repeat: k31jax, then torch) and see
the same machine load. Weights are random (timing only; equality is the golden test's job).

    .venv/bin/python benchmarks/vision.py [--layers 27] [--repeats 3] [--size 1024]

The full tower (--layers 27) takes minutes per image on 2 cores; --layers scales the tower
depth for a quick look (tokens per image do not depend on it). Reported: median / min / max
seconds per image over --repeats (>= 1) after one warm-up (compilation excluded), images/s from the
median, and the 1-minute load average before and after (other sessions share the cores).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

K3_WIDTH = dict(patch_size=14, hidden=1024, heads=12, qkv=1536, mlp=4096, pos_h=64, pos_w=64, text=7168, merge=2,
                projector_eps=1e-5)
K3_PROCESSOR = dict(patch_size=14, merge_kernel_size=2, in_patch_limit=65536, patch_limit_on_one_side=512,
                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], chessboard_square_size=8,
                    chessboard_white_value=255, chessboard_gray_value=180)

# The torch child: builds the peer once, then answers each "run" line with one timed encode.
TORCH_CHILD = r"""
import io, json, sys, time
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
import make_vision_golden as peer
cfg = json.loads(sys.argv[2]); png = open(sys.argv[3], "rb").read()
torch.manual_seed(0)
tower, projector = peer.Tower(cfg), peer.Projector(cfg)
with torch.no_grad():
    for p in list(tower.parameters()) + list(projector.parameters()):
        p.copy_(torch.randn_like(p) * 0.02)
def encode():
    patches, grid, tokens = peer.process(png, peer.PROCESSOR_K3)
    with torch.inference_mode():
        x = tower(torch.from_numpy(patches), [grid])
        return projector(peer.merge(x, [grid], cfg["merge"])).shape[0], tokens
print(json.dumps({"ready": True, "threads": torch.get_num_threads(), "version": torch.__version__}), flush=True)
for line in sys.stdin:
    t0 = time.perf_counter(); rows, tokens = encode(); dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "rows": rows, "tokens": tokens}), flush=True)
"""


def _png(size: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:size, :size]
    img = np.stack([xx % 256, yy % 256, (xx + yy) % 256], -1) + rng.normal(0, 10, (size, size, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _torch_python() -> str | None:
    cand = os.environ.get("K31JAX_TORCH_PYTHON") or str(ROOT / ".torchvenv" / "bin" / "python")
    return cand if Path(cand).exists() else None


def _stats(times):
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", type=int, default=1024)
    args = ap.parse_args()
    if args.repeats < 1:  # one repeat of the full tower already takes minutes on 2 shared cores
        ap.error("--repeats must be at least 1 (3 or more give a spread: median / min / max)")

    import jax

    from k31jax.config import VisionConfig
    from k31jax.vision import VisionModel, pack_images, preprocess_image
    from flax import nnx

    png = _png(args.size)
    cfg = VisionConfig(num_hidden_layers=args.layers)
    model = VisionModel(cfg, "float32", rngs=nnx.Rngs(0))
    run = nnx.jit(lambda m, x: m(x))

    def encode_jax():
        image = preprocess_image(png)
        out = run(model, pack_images([image.patches], [image.grid], cfg))
        out.block_until_ready()
        return out.shape[0], image.num_tokens

    child = None
    torch_py = _torch_python()
    if torch_py:
        png_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"k31jax_vision_bench_{os.getpid()}.png"
        png_path.write_bytes(png)
        tcfg = {**K3_WIDTH, "layers": args.layers}
        code = TORCH_CHILD.replace("peer.PROCESSOR_K3", repr(K3_PROCESSOR))
        child = subprocess.Popen([torch_py, "-c", code, str(ROOT / "tests" / "golden"), json.dumps(tcfg), str(png_path)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(child.stdout.readline())

    def encode_torch():
        child.stdin.write("run\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())

    def progress(what: str, seconds: float) -> None:  # the full tower takes minutes: show each encode
        print(f"[vision] {what}: {seconds:.1f} s (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows, tokens = encode_jax()  # warm-up: compiles
    progress("k31jax warm-up (with compile)", time.perf_counter() - t0)
    if child:
        progress("torch warm-up", encode_torch()["seconds"])
    jax_times, torch_times = [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        encode_jax()
        jax_times.append(time.perf_counter() - t0)
        progress(f"k31jax repeat {i + 1}", jax_times[-1])
        if child:
            torch_times.append(encode_torch()["seconds"])
            progress(f"torch repeat {i + 1}", torch_times[-1])
    load_after = os.getloadavg()[0]
    if child:
        child.stdin.close()
        child.wait(timeout=60)
        png_path.unlink(missing_ok=True)

    result = {"image": f"{args.size}x{args.size}", "tower_layers": args.layers, "tokens_per_image": tokens,
              "projected_rows": rows, "dtype": "float32", "repeats": args.repeats,
              "load_avg_1min_before": load_before, "load_avg_1min_after": load_after,
              "k31jax": {**_stats(jax_times), "images_per_s": 1 / statistics.median(jax_times),
                         "jax": jax.__version__, "devices": str(jax.devices())}}
    if child:
        result["torch_peer"] = {**_stats(torch_times), "images_per_s": 1 / statistics.median(torch_times),
                                "torch": info["version"], "threads": info["threads"]}
        result["k31jax_speedup"] = statistics.median(torch_times) / statistics.median(jax_times)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
