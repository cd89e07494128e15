"""Reproduce the embedded default model (`k31jax/assets/embedded/`).

    .venv/bin/python scripts/train_embedded_model.py --out runs/embedded            # corpus, tokenizer, train, distil
    .venv/bin/python scripts/train_embedded_model.py --out runs/embedded --install  # + copy into the package
    .venv/bin/python scripts/train_embedded_model.py --out runs/bf16 --no-qat       # the QAT comparison's bf16 model

1. Corpus: the `*.py` sources of the Python standard library that runs this script (PSF License
   2.0), without test suites, IDLE and tkinter demos, 1-100 KB each, in sorted path order. A
   file is held out when the SHA-256 of its relative path is 0 mod 20 (about 5%): the split
   depends on the name only. The lists, sizes and content hashes go to `corpus.json`, with
   the Python version (another version's stdlib is a different corpus).
2. Tokenizer: a byte-level BPE of `--ranks` ranks trained on the training split only
   (`k31jax.chat.train_bpe`: the K3 pre-tokenizer, then the 256 K3 special slots), written as
   `tiktoken.model`: ~2.9 bytes per token on the held-out files at 2,048 ranks.
3. Training (DeepSeek-V3.2's order for the Gated DSA layers): `k31jax train --config embedded`
   with attention dense (`--index-topk` = the row length), MXFP4 QAT on the routed experts,
   Muon; then `k31jax train --distill-indexer` trains only the lightning indexers (the model
   frozen) and exports with the preset's top-k (1/8 of the training rows). The exact commands
   are printed and stored in `corpus.json`.
4. `--install`: the distilled run's `final/release` (bf16, routed experts packed MXFP4, the
   tokenizer) is copied into `k31jax/assets/embedded/` with `SHA256SUMS`, which
   `tests/project/test_embedded_model.py` checks.
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

from k31jax.chat import train_bpe, write_tiktoken_model

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


def train_tokenizer(train: list[Path], out: Path, num_ranks: int) -> dict:
    """The BPE of the training split, as `out/tiktoken.model`; its size and hash for corpus.json."""
    out.mkdir(parents=True, exist_ok=True)
    ranks = train_bpe((p.read_text("utf-8", "surrogateescape") for p in train), num_ranks)
    write_tiktoken_model(ranks, out / "tiktoken.model")
    return {"ranks": len(ranks), "special_slots": 256, "tiktoken.model sha256":
            hashlib.sha256((out / "tiktoken.model").read_bytes()).hexdigest()}


def k31jax_train(out: Path, *flags: str) -> list[str]:
    """`k31jax train` with the settings both stages share."""
    return [str(Path(sys.executable).parent / "k31jax"), "train", "--out", str(out), "--no-progress",
            "--weight-decay", "0.1", "--clip-norm", "1.0", "--min-lr-ratio", "0.1", "--holdout-fraction", "0.02",
            *flags]


def run(cmd: list[str], out: Path) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd + (["--resume"] if (out / "checkpoints").exists() else []), check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ranks", type=int, default=2048, help="BPE ranks (the vocabulary adds 256 special slots)")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--optimizer", default="muon")
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--distill-steps", type=int, default=500)
    ap.add_argument("--distill-lr", type=float, default=4e-3)
    ap.add_argument("--no-qat", action="store_true", help="train the bf16 baseline (no fake-quant, no distillation)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--install", action="store_true", help="copy the distilled final/release into k31jax/assets/embedded")
    ap.add_argument("--skip-train", action="store_true", help="only (re)write the corpus and tokenizer / install")
    args = ap.parse_args()

    stdlib, train, heldout = select_corpus()
    corpus = args.out / "corpus"
    if corpus.exists():
        shutil.rmtree(corpus)
    meta = {"python": sys.version.split()[0], "stdlib": str(stdlib), "licence": "PSF-2.0 (Python Software Foundation License)",
            "rule": f"*.py, {MIN_BYTES}-{MAX_BYTES} bytes, not under {sorted(SKIP_DIRS)}; held out: sha256(relpath) % 20 == 0",
            "train": copy_split(stdlib, train, corpus / "train"), "heldout": copy_split(stdlib, heldout, corpus / "heldout")}
    tokenizer = args.out / "tokenizer"
    meta["tokenizer"] = train_tokenizer(train, tokenizer, args.ranks)
    run_dir, distill_dir = args.out / "run", args.out / "distill"
    shared = ["--tokenizer", str(tokenizer), "--data", str(corpus / "train"), "--seq-len", str(args.seq_len),
              "--batch-size", str(args.batch_size), "--seed", str(args.seed)]
    qat = [] if args.no_qat else ["--qat"]
    stages = [(run_dir, k31jax_train(
        run_dir, "--config", "embedded", *shared, "--index-topk", str(args.seq_len), *qat,
        "--steps", str(args.steps), "--optimizer", args.optimizer, "--lr", str(args.lr),
        "--warmup", str(min(50, max(1, args.steps // 10))), "--bias-update-rate", "0.01",
        "--save-every", "200", "--eval-every", "200", "--eval-batches", "8"))]
    if not args.no_qat:
        stages.append((distill_dir, k31jax_train(
            distill_dir, "--init", str(run_dir), *shared, "--distill-indexer", "--qat",
            "--index-topk", str(args.seq_len // 8), "--steps", str(args.distill_steps), "--lr", str(args.distill_lr),
            "--warmup", "10", "--save-every", str(args.distill_steps), "--eval-batches", "4")))
    # recorded with the output folder as OUT, so the lines read the same on every machine
    meta["command"] = [f"scripts/train_embedded_model.py --out OUT --steps {args.steps}:"] + [
        " ".join(["k31jax"] + cmd[1:]).replace(str(args.out), "OUT") for _, cmd in stages]
    (args.out / "corpus.json").write_text(json.dumps(meta, indent=1))
    print(f"corpus: {len(train)} training files ({sum(r['bytes'] for r in meta['train']):,} bytes), "
          f"{len(heldout)} held out ({sum(r['bytes'] for r in meta['heldout']):,} bytes) from Python {meta['python']}; "
          f"BPE of {meta['tokenizer']['ranks']:,} ranks")
    if not args.skip_train:
        for out, cmd in stages:
            run(cmd, out)
    if args.install:
        release = distill_dir / "final" / "release"
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
