"""A copy-capable small model for the speculative-decoding benchmark's code-edit workload.

    .venv/bin/python benchmarks/copy_model.py [--out benchmarks/.cache/copy_model] [--steps 200] [--seed 0]

Why: the code-edit workload prompts with a Python snippet and a marker and expects the model
to restate the snippet (possibly with small edits) -- the case where drafting from the prompt
pays off. The embedded model (`load_model()`, 7.8M params, Python stdlib sources) was never
trained to restate its input: after a file, a separator and the file's first lines, greedy
decoding derails instead of continuing the copy. This script fine-tunes it to restate.

- Data (`build_data`): snippets of 20-40 whole lines cut from the embedded corpus's TRAIN
  files (`corpus.json` "train", under its "stdlib" folder), each written as one text
  document ``snippet + MARKER + edited snippet``, where the edited copy carries 1-2 small edits
  (an identifier renamed everywhere, one integer changed, one short string changed). Sized
  so a document plus its [EOS] fits one 512-token training row with the embedded tokenizer.
  Seeded (`numpy.random.default_rng`) and deterministic.
- Training: `k31jax train --init embedded --qat --seq-len 512` (the embedded model's routed
  experts are MXFP4, trained with QAT; with --qat the export packs them to MXFP4 again). The
  result is `OUT/run/final/release` (release safetensors, tokenizer copied in), which
  `load_model(path)` loads; `copy_model_path()` returns it. Skipped when that folder exists.
- `evaluate`: on snippets cut from HELD-OUT files (`corpus.json` "heldout"), prompt = snippet +
  MARKER, greedy `Engine.generate` of 200 tokens; copy accuracy = share of generated tokens
  equal to the snippet's own tokens at the same position (the snippet tokenized as it follows
  the marker), plus the copied prefix length and wall time.
"""

from __future__ import annotations

import argparse
import builtins
import json
import keyword
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / ".cache" / "copy_model"
MARKER = "\n# --- restated, edited ---\n"
SEQ_LEN = 512
DEFAULT_STEPS = 200
DEFAULT_DOCS = 3000

_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
_INT = re.compile(r"(?<![\w.])\d+(?![\w.])")
_STRING = re.compile(r"""(['"])([A-Za-z_][A-Za-z0-9_ ]{0,24})\1""")
_RESERVED = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins)) | {"self", "cls"}
_WORDS = ("item", "value", "node", "result", "data", "count", "key", "buf", "obj", "entry", "name",
          "index", "total", "state", "token", "path", "size", "limit", "other", "target")


# ---- data --------------------------------------------------------------------------------
def corpus() -> dict:
    """The embedded model's corpus record (train / held-out file lists, the stdlib folder)."""
    from k31jax.generate import embedded_model_dir
    return json.loads((embedded_model_dir() / "corpus.json").read_text())


def corpus_files(split: str) -> list[Path]:
    """The embedded corpus's files of `split` ("train" or "heldout"), in corpus order."""
    c = corpus()
    return [Path(c["stdlib"]) / entry["path"] for entry in c[split]]


def embedded_tokenizer():
    """The embedded model's tokenizer (without loading its weights)."""
    from k31jax.generate import embedded_model_dir, load_tokenizer
    vocab = json.loads((embedded_model_dir() / "config.json").read_text())["text_config"]["vocab_size"]
    return load_tokenizer(embedded_model_dir(), vocab)


def _rename(text: str, rng: np.random.Generator) -> str | None:
    names = sorted({m.group() for m in _IDENT.finditer(text)} - _RESERVED)
    names = [n for n in names if len(n) >= 3 and not n.startswith("__")]
    if not names:
        return None
    old = names[rng.integers(len(names))]
    word = _WORDS[rng.integers(len(_WORDS))]
    new = (f"{old}_{word}", f"new_{old}", word, f"{word}_{old}")[rng.integers(4)]
    if re.search(rf"\b{re.escape(new)}\b", text):
        return None
    return re.sub(rf"\b{re.escape(old)}\b", new, text)


def _change_number(text: str, rng: np.random.Generator) -> str | None:
    hits = list(_INT.finditer(text))
    if not hits:
        return None
    m = hits[rng.integers(len(hits))]
    old = int(m.group())
    new = old + int(rng.choice([-2, -1, 1, 2, 10])) if old > 2 else int(rng.integers(3, 100))
    return text[:m.start()] + str(new) + text[m.end():]


def _change_string(text: str, rng: np.random.Generator) -> str | None:
    hits = list(_STRING.finditer(text))
    if not hits:
        return None
    m = hits[rng.integers(len(hits))]
    word = _WORDS[rng.integers(len(_WORDS))]
    new = word if word != m.group(2) else word + "s"
    return text[:m.start(2)] + new + text[m.end(2):]


_EDITS = (_rename, _change_number, _change_string)


def edit_snippet(text: str, rng: np.random.Generator) -> str:
    """`text` with 1-2 small edits (rename an identifier everywhere, change one integer, change
    one short string literal), kinds drawn at random; unchanged only if none applies."""
    wanted = int(rng.integers(1, 3))
    done = 0
    for kind in rng.permutation(len(_EDITS)):
        edited = _EDITS[kind](text, rng)
        if edited is not None and edited != text:
            text, done = edited, done + 1
            if done == wanted:
                break
    return text


def cut_snippet(lines: list[str], rng: np.random.Generator, tokenizer, max_tokens: int,
                min_tokens: int = 64, min_lines: int = 20, max_lines: int = 40) -> str | None:
    """20-40 whole lines from a random start, trailing lines dropped until the snippet has at
    most `max_tokens` tokens; None when fewer than 8 lines or `min_tokens` tokens remain."""
    if len(lines) < min_lines:
        return None
    n = int(rng.integers(min_lines, max_lines + 1))
    start = int(rng.integers(0, max(1, len(lines) - n + 1)))
    chunk = lines[start:start + n]
    while chunk and not chunk[-1].strip():
        chunk.pop()
    while len(chunk) >= 8:
        text = "".join(chunk)
        size = len(tokenizer.encode_ordinary(text))
        if size <= max_tokens:
            return text if size >= min_tokens else None
        chunk.pop()
    return None


def edit_pairs(files: list[Path], n: int, seed: int, tokenizer, seq_len: int = SEQ_LEN
               ) -> list[tuple[str, str]]:
    """`n` (snippet, edited snippet) pairs from `files`, each pair's document
    ``snippet + MARKER + edited`` plus [EOS] at most `seq_len` tokens. Deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    texts = [f.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True) for f in files]
    budget = seq_len - 1 - len(tokenizer.encode_ordinary(MARKER))
    pairs: list[tuple[str, str]] = []
    while len(pairs) < n:
        lines = texts[rng.integers(len(texts))]
        snippet = cut_snippet(lines, rng, tokenizer, max_tokens=budget // 2 - 8)
        if snippet is None:
            continue
        snippet = snippet if snippet.endswith("\n") else snippet + "\n"
        edited = edit_snippet(snippet, rng)
        if len(tokenizer.encode_ordinary(snippet + MARKER + edited)) <= seq_len - 1:
            pairs.append((snippet, edited))
    return pairs


def build_data(folder: Path, n: int = DEFAULT_DOCS, seed: int = 0, tokenizer=None) -> Path:
    """Write `n` documents ``snippet + MARKER + edited`` from the TRAIN files as
    ``folder/doc_00000.txt``...; returns `folder`. Rewrites nothing when already complete."""
    folder = Path(folder)
    done = folder / ".complete"
    if done.exists() and done.read_text() == f"{n} {seed}":
        return folder
    tokenizer = tokenizer or embedded_tokenizer()
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("doc_*.txt"):
        old.unlink()
    for i, (snippet, edited) in enumerate(edit_pairs(corpus_files("train"), n, seed, tokenizer)):
        (folder / f"doc_{i:05d}.txt").write_text(snippet + MARKER + edited, encoding="utf-8")
    done.write_text(f"{n} {seed}")
    return folder


# ---- training ----------------------------------------------------------------------------
def copy_model_path(out: Path = DEFAULT_OUT) -> Path:
    """The fine-tuned model's folder, for `k31jax.generate.load_model(path)`."""
    return Path(out) / "run" / "final" / "release"


def train_command(data: Path, run: Path, steps: int, seed: int, lr: float, batch_size: int) -> list[str]:
    return [str(ROOT / ".venv" / "bin" / "k31jax"), "train", "--init", "embedded", "--data", str(data),
            "--out", str(run), "--steps", str(steps), "--qat", "--seq-len", str(SEQ_LEN),
            "--batch-size", str(batch_size), "--lr", str(lr), "--seed", str(seed),
            "--holdout-fraction", "0", "--save-every", str(steps), "--keep", "1",
            "--log-every", "10", "--no-progress"]


def ensure_copy_model(out: Path = DEFAULT_OUT, *, steps: int = DEFAULT_STEPS, seed: int = 0,
                      lr: float = 1e-3, batch_size: int = 8, docs: int = DEFAULT_DOCS) -> Path:
    """The copy model's folder, building the data and fine-tuning when it is not there yet."""
    out = Path(out)
    final = copy_model_path(out)
    if (final / "config.json").exists():
        return final
    run = out / "run"
    if run.exists():
        raise FileExistsError(f"{run} exists without a finished export; delete it to train again")
    data = build_data(out / "data", docs, seed)
    cmd = train_command(data, run, steps, seed, lr, batch_size)
    print("+", " ".join(cmd), file=sys.stderr)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    (out / "train_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return final


# ---- evaluation --------------------------------------------------------------------------
def evaluate(model, tokenizer, *, files: int = 8, new_tokens: int = 200, seed: int = 1234) -> dict:
    """Copy accuracy on snippets from `files` HELD-OUT corpus files: prompt = snippet + MARKER,
    greedy generation of `new_tokens`; per snippet, the share of the first min(new_tokens,
    snippet tokens) generated tokens equal to the snippet's tokens at the same position."""
    from k31jax.generate import Engine

    rng = np.random.default_rng(seed)
    budget = SEQ_LEN - 1 - len(tokenizer.encode_ordinary(MARKER))
    engine = Engine(model, tokenizer, max_len=2048, prefill_chunk=256)
    rows = []
    t0 = time.perf_counter()
    for path in corpus_files("heldout")[:files]:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        snippet = None
        for _ in range(50):
            snippet = cut_snippet(lines, rng, tokenizer, max_tokens=budget // 2 - 8, min_tokens=120)
            if snippet is not None:
                break
        if snippet is None:
            continue
        prompt = tokenizer.encode_ordinary(snippet + MARKER)
        joint = tokenizer.encode_ordinary(snippet + MARKER + snippet)
        ref = joint[len(prompt):] if joint[:len(prompt)] == prompt else tokenizer.encode_ordinary(snippet)
        out = engine.generate([prompt], new_tokens, stop_ids=frozenset()).tokens[0]
        n = min(len(out), len(ref))
        same = [a == b for a, b in zip(out[:n], ref[:n])]
        prefix = next((i for i, s in enumerate(same) if not s), n)
        rows.append({"file": str(path.relative_to(corpus()["stdlib"])), "scored": n,
                     "accuracy": sum(same) / n, "copied_prefix": prefix})
    wall = time.perf_counter() - t0
    scored = sum(r["scored"] for r in rows)
    return {"copy_accuracy": sum(r["accuracy"] * r["scored"] for r in rows) / scored,
            "mean_copied_prefix": float(np.mean([r["copied_prefix"] for r in rows])),
            "wall_seconds": wall, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--docs", type=int, default=DEFAULT_DOCS, help="training documents to write")
    p.add_argument("--eval-files", type=int, default=8, help="held-out files to evaluate on (0: skip)")
    p.add_argument("--baseline", action="store_true", help="evaluate the embedded model instead")
    args = p.parse_args(argv)

    from k31jax.generate import load_model
    if args.baseline:
        loaded = load_model()
    else:
        loaded = load_model(ensure_copy_model(args.out, steps=args.steps, seed=args.seed, lr=args.lr,
                                              batch_size=args.batch_size, docs=args.docs))
    if args.eval_files:
        result = evaluate(loaded.model, loaded.tokenizer, files=args.eval_files)
        for row in result["rows"]:
            print(f"  {row['file']:40s} accuracy {row['accuracy']:.3f} over {row['scored']} tokens, "
                  f"copied prefix {row['copied_prefix']}")
        print(f"{loaded.source}: copy accuracy {result['copy_accuracy']:.3f}, mean copied prefix "
              f"{result['mean_copied_prefix']:.1f} tokens, evaluation {result['wall_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
