"""Vision encoding on CPU: images/s and tokens per image for one 1024x1024 image at the K3 width,
k31jax (jit) next to the PyTorch peer of tests/golden/make_vision_golden.py (eager), in one run.

Both encode the same PNG end to end: K3 preprocessing (decode, resize/pad, normalise,
patchify), the MoonViT-V2 tower at K3 width (1024 wide, 12 heads x 128, MLP 4096), the 2x2
merge and the projector to 7168, in float32. The torch side runs in its own venv
($K31JAX_TORCH_PYTHON or ./.torchvenv/bin/python) as a child process that times one encode per
request, so the two sides alternate repeat by repeat (each repeat: k31jax, then torch) and see
the same machine load. Weights are random (timing only; equality is the golden test's job).

    .venv/bin/python benchmarks/vision.py [--layers 27] [--repeats 3] [--size 1024] [--record [--force]]

The full tower (--layers 27) takes minutes per image on 2 cores; --layers scales the tower
depth for a quick look (tokens per image do not depend on it). Method (`benchmarks/_harness.py`):
one warm-up per side (k31jax's compiles), then --repeats (>= 3) rounds alternating; seconds per
image median [min, max], images/s from the median, the machine and its load before and after;
`--record` writes RESULTS.md's "vision" block (refused under load unless --force, which marks it).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import Session, add_record_arguments, alternate, ratio, record, torch_python  # noqa: E402

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", type=int, default=1024)
    add_record_arguments(ap)
    args = ap.parse_args(argv)

    import jax
    from flax import nnx

    from k31jax.config import VisionConfig
    from k31jax.vision import VisionModel, pack_images, preprocess_image

    torch_py = torch_python()
    if torch_py is None:
        sys.exit("vision.py: the torch peer needs ./.torchvenv (or $K31JAX_TORCH_PYTHON): a ratio needs both sides")
    session = Session()
    png = _png(args.size)
    cfg = VisionConfig(num_hidden_layers=args.layers)
    model = VisionModel(cfg, "float32", rngs=nnx.Rngs(0))
    run = nnx.jit(lambda m, x: m(x))
    shape: dict[str, int] = {}

    def encode_jax() -> dict[str, float]:
        t0 = time.perf_counter()
        image = preprocess_image(png)
        out = run(model, pack_images([image.patches], [image.grid], cfg))
        out.block_until_ready()
        seconds = time.perf_counter() - t0
        shape.update(rows=out.shape[0], tokens=image.num_tokens)
        _progress("k31jax", seconds)
        return {"seconds": seconds}

    png_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"k31jax_vision_bench_{os.getpid()}.png"
    png_path.write_bytes(png)
    code = TORCH_CHILD.replace("peer.PROCESSOR_K3", repr(K3_PROCESSOR))
    child = subprocess.Popen([torch_py, "-c", code, str(ROOT / "tests" / "golden"),
                              json.dumps({**K3_WIDTH, "layers": args.layers}), str(png_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = json.loads(child.stdout.readline())

    def encode_torch() -> dict[str, float]:
        child.stdin.write("run\n")
        child.stdin.flush()
        answer = json.loads(child.stdout.readline())
        if answer["tokens"] != shape["tokens"] or answer["rows"] != shape["rows"]:
            raise RuntimeError(f"torch encoded {answer['rows']} rows / {answer['tokens']} tokens, "
                               f"k31jax {shape['rows']} / {shape['tokens']}")
        _progress("torch", answer["seconds"])
        return {"seconds": answer["seconds"]}

    try:  # one warm-up each (k31jax's compiles), then the sides in turn
        stats = alternate({"k31jax": encode_jax, "torch": encode_torch}, args.repeats)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
        png_path.unlink(missing_ok=True)
    session.finish()
    ours, peer = stats["k31jax"]["seconds"], stats["torch"]["seconds"]
    lines = [
        f"one {args.size}x{args.size} PNG end to end (K3 preprocessing, tower of {args.layers} blocks at K3 width, "
        f"2x2 merge, projector to {K3_WIDTH['text']}), float32, random weights",
        f"tokens per image {shape['tokens']}, projected rows {shape['rows']}",
        f"{'':34}{'seconds per image':>26}{'images/s':>12}",
        f"{'k31jax (jit, jax ' + jax.__version__ + ')':34}{str(ours):>26}{1 / ours.median:>12.4f}",
        f"{'torch ' + info['version'] + ' eager, ' + str(info['threads']) + ' threads':34}{str(peer):>26}"
        f"{1 / peer.median:>12.4f}",
        f"k31jax speed-up (ratio of medians): {ratio(peer, ours):.2f}x; {args.repeats} rounds alternating after "
        f"one warm-up each (compile excluded)",
    ]
    for line in lines:
        print(line)
    print(f"# {session.header()}")
    if args.record:
        record("vision", lines, session, force=args.force)


def _progress(side: str, seconds: float) -> None:  # the full tower takes minutes: show each encode
    print(f"[vision] {side}: {seconds:.1f} s (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
