"""Reproduce the embedded default model (`k31jax/assets/embedded/`).

    .venv/bin/python scripts/train_embedded_model.py --out runs/embedded            # corpus + train
    .venv/bin/python scripts/train_embedded_model.py --out runs/embedded --install  # + copy into the package

1. Corpus: the `*.py` sources of the Python standard library that runs this script (PSF License
   2.0), without test suites, IDLE and tkinter demos, 1-100 KB each, in sorted path order. A
   file is held out when the SHA-256 of its relative path is 0 mod 20 (about 5%): the split
   depends on the name only. The lists, sizes and content hashes go to `corpus.json`, with
   the Python version (another version's stdlib is a different corpus).
2. Training: `k31jax train --config embedded` (byte-level tokenizer, 4.5M parameters: KDA,
   gated MLA with the lightning indexer, Block AttnRes, LatentMoE) with MXFP4 QAT on the
   routed experts; the exact command is printed and stored in `corpus.json`.
3. `--install`: the run's `final/release` (bf16, routed experts packed MXFP4) is copied into
   `k31jax/assets/embedded/` with `SHA256SUMS`, which `tests/test_embedded_model.py` checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "k31jax" / "assets" / "embedded"
SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "__pycache__", "lib2to3", "tkinter"}
MIN_BYTES, MAX_BYTES = 1_000, 100_000


def select_corpus() -> tuple[Path, list[Path], list[Path]]:
    stdlib = Path(sysconfig.get_path("stdlib"))
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not SKIP_DIRS & set(p.relative_to(stdlib).parts[:-1])
                   and MIN_BYTES <= p.stat().st_size <= MAX_BYTES)
    heldout = [p for p in files if int(hashlib.sha256(str(p.relative_to(stdlib)).encode()).hexdigest(), 16) % 20 == 0]
    held = set(heldout)
    return stdlib, [p for p in files if p not in held], heldout


def copy_split(stdlib: Path, files: list[Path], dest: Path) -> list[dict]:
    dest.mkdir(parents=True, exist_ok=True)
    rows = []
    for p in files:
        rel = str(p.relative_to(stdlib))
        data = p.read_bytes()
        (dest / rel.replace("/", "__")).write_bytes(data)
        rows.append({"path": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return rows


def sha256sums(folder: Path) -> str:
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(folder)}"
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "SHA256SUMS"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--no-qat", action="store_true", help="train the bf16 baseline (no fake-quant)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--install", action="store_true", help="copy final/release into k31jax/assets/embedded")
    ap.add_argument("--skip-train", action="store_true", help="only (re)write the corpus / install")
    args = ap.parse_args()

    stdlib, train, heldout = select_corpus()
    corpus = args.out / "corpus"
    if corpus.exists():
        shutil.rmtree(corpus)
    meta = {"python": sys.version.split()[0], "stdlib": str(stdlib), "licence": "PSF-2.0 (Python Software Foundation License)",
            "rule": f"*.py, {MIN_BYTES}-{MAX_BYTES} bytes, not under {sorted(SKIP_DIRS)}; held out: sha256(relpath) % 20 == 0",
            "train": copy_split(stdlib, train, corpus / "train"), "heldout": copy_split(stdlib, heldout, corpus / "heldout")}
    run = args.out / "run"
    cmd = [str(Path(sys.executable).parent / "k31jax"), "train", "--config", "embedded", "--data", str(corpus / "train"),
           "--out", str(run), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--warmup", str(min(50, max(1, args.steps // 10))), "--min-lr-ratio", "0.1",
           "--weight-decay", "0.1", "--clip-norm", "1.0", "--bias-update-rate", "0.01", "--holdout-fraction", "0.02",
           "--save-every", "200", "--eval-every", "200", "--eval-batches", "8", "--seed", str(args.seed),
           "--no-progress"] + ([] if args.no_qat else ["--qat"])
    # recorded with the output folder as OUT, so the line reads the same on every machine
    meta["command"] = f"scripts/train_embedded_model.py --out OUT --steps {args.steps}: " + " ".join(
        ["k31jax"] + cmd[1:]).replace(str(args.out), "OUT")
    (args.out / "corpus.json").write_text(json.dumps(meta, indent=1))
    print(f"corpus: {len(train)} training files ({sum(r['bytes'] for r in meta['train']):,} bytes), "
          f"{len(heldout)} held out ({sum(r['bytes'] for r in meta['heldout']):,} bytes) from Python {meta['python']}")
    if not args.skip_train:
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd + (["--resume"] if (run / "checkpoints").exists() else []), check=True)
    if args.install:
        release = run / "final" / "release"
        tmp = ASSET.with_name(ASSET.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(release, tmp)
        shutil.copy(args.out / "corpus.json", tmp / "corpus.json")
        (tmp / "SHA256SUMS").write_text(sha256sums(tmp))
        shutil.rmtree(ASSET, ignore_errors=True)
        os.replace(tmp, ASSET)
        print(f"installed {ASSET} ({sum(p.stat().st_size for p in ASSET.rglob('*') if p.is_file()):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
