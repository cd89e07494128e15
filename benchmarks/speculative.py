"""Speculative decoding on CPU: decode tok/s with and without `Speculation("ngram")` (prompt
lookup, issue #30), at batch 1 and 8, on a code-edit workload and on free text, in the same run.

    .venv/bin/python benchmarks/speculative.py [--record] [--new-tokens 192] [--repeats 3]

- Model: the embedded model fine-tuned to restate a snippet after a marker
  (`benchmarks/copy_model.py`, built on first use and cached under benchmarks/.cache/): an
  agent's edit of a file it was shown. The embedded model itself never restates its input.
- (a) code edit: a held-out stdlib snippet (20-40 lines, never trained on) and the marker; the
  model restates it, with the changes it makes. (b) free text: the first lines of a held-out
  file, no marker; the model writes on, and its output rarely repeats the prompt. Batch 8: eight
  different snippets / files; batch 1: the first of them.
- Both sides: `Engine(model, max_len, prefill_chunk)`, greedy, no stop ids, `--new-tokens` per
  row; the speculative engine with `Speculation("ngram")` (max_draft 8, n-grams 3-6). A warm-up
  `generate` per side compiles its programs; decode tok/s = tokens after the first / the time
  from the first token to the last (`GenerationResult.decode_tok_s`, compile excluded). Every
  repeat checks that both sides emitted the same tokens.
- Method (`benchmarks/_harness.py`): the sides alternate, one warm-up each, then --repeats
  rounds; median [min, max]; `--record` writes RESULTS.md "## speculative" only when no other
  process shared the cores.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _harness import Session, add_record_arguments, alternate, ratio, report  # noqa: E402
from copy_model import MARKER, SEQ_LEN, corpus_files, cut_snippet, ensure_copy_model  # noqa: E402

from k31jax.generate import Engine, Speculation, load_model  # noqa: E402

TARGETS = {"code edit": 2.0, "free text": 0.95}  # speedup at batch 1 the issue asks for (free text: every batch)


def workloads(tokenizer, rows: int, seed: int = 7) -> dict[str, list[list[int]]]:
    """Prompts of each workload from held-out files (one snippet / file head per file)."""
    rng = np.random.default_rng(seed)
    budget = SEQ_LEN - 1 - len(tokenizer.encode_ordinary(MARKER))
    edit, free = [], []
    for path in corpus_files("heldout"):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        snippet = next((s for s in (cut_snippet(lines, rng, tokenizer, budget // 2 - 8, min_tokens=160)
                                    for _ in range(50)) if s is not None), None)
        if snippet is None or len(lines) < 12:
            continue
        edit.append(tokenizer.encode_ordinary(snippet + MARKER))
        free.append(tokenizer.encode_ordinary("".join(lines[:12])))
        if len(edit) == rows:
            return {"code edit": edit, "free text": free}
    raise SystemExit(f"fewer than {rows} held-out files gave a snippet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    add_record_arguments(parser)
    args = parser.parse_args()
    path = ensure_copy_model()  # before the session: a first run trains for minutes
    session = Session()
    loaded = load_model(str(path))
    tok = loaded.tokenizer
    prompts = workloads(tok, max(args.batches))
    max_len = 1024
    plain = Engine(loaded.model, tok, max_len=max_len, prefill_chunk=256)
    spec = Engine(loaded.model, tok, max_len=max_len, prefill_chunk=256, speculation=Speculation("ngram"))
    lines = [f"model: {path.relative_to(ROOT)} (benchmarks/copy_model.py); {args.new_tokens} new tokens per row, "
             f"greedy; decode tok/s median [min, max] over {args.repeats} alternating repeats"]
    for name, batch_prompts in prompts.items():
        for batch in args.batches:
            rows = batch_prompts[:batch]
            outputs = {}

            def side(engine, label, rows=rows, outputs=outputs):
                def run():
                    result = engine.generate(rows, args.new_tokens, stop_ids=frozenset())
                    outputs[label] = result
                    return {"tok_s": result.decode_tok_s}
                return run

            stats = alternate({"plain": side(plain, "plain"), "ngram": side(spec, "ngram")}, args.repeats)
            same = outputs["plain"].tokens == outputs["ngram"].tokens
            s = outputs["ngram"].speculation
            speedup = ratio(stats["ngram"]["tok_s"], stats["plain"]["tok_s"])
            target = TARGETS[name] if batch == 1 or name == "free text" else None
            verdict = "" if target is None else f" (target >= {target}x: {'met' if speedup >= target else 'NOT MET'})"
            line = (f"{name}, batch {batch}: plain {stats['plain']['tok_s']} tok/s, ngram {stats['ngram']['tok_s']} "
                    f"tok/s: {speedup:.2f}x{verdict}; drafts kept {s.acceptance:.0%} ({s.accepted} of {s.drafted}), "
                    f"mean kept per verified draft {s.mean_accepted:.2f}, {s.verify_steps} verify steps; "
                    f"output identical: {'yes' if same else 'NO'}")
            print(line, flush=True)
            lines.append(line)
    session.finish()
    report("speculative", "speculative", lines, session, args)


if __name__ == "__main__":
    main()
