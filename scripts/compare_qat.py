"""The QAT comparison (issue #13) on held-out files, paired file by file.

    .venv/bin/python scripts/compare_qat.py --bf16 RUNS/bf16/run/final/release \
        --qat RUNS/qat/run/final/release --heldout RUNS/qat/corpus/heldout

Three models, all computed in float32 with dense attention (both runs trained dense):
- bf16: the run trained without QAT (its release: every weight stored in bf16);
- PTQ: that model with its routed experts rounded to nearest MXFP4 after training;
- QAT: the run trained with MXFP4 fake-quant (its release: experts packed MXFP4);
- and, to say how much the routed experts carry at all, the bf16 model without them (their
  down projections zeroed, so the routed branch adds nothing): rounding them cannot cost more
  than a fraction of that.

Each held-out file is evaluated alone (rows of `--seq-len` tokens). The table gives each
model's bits per byte over all files and its change against bf16; then, per file, paired
differences (PTQ - QAT, PTQ - bf16, no routed experts - bf16): the mean over files with its
standard error, and how many files each model wins. A difference is "measurable" when it
exceeds 3 standard errors. PTQ - QAT compares two trainings, so its spread holds their
run-to-run difference; the other two compare one set of weights with a change of it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from k31jax.generate import load_model
from k31jax.nn import quantize_experts
from k31jax.train import DataConfig, evaluate, with_index_topk


def per_file_bits(model, tokenizer, files: list[Path], seq_len: int, batch_size: int) -> np.ndarray:
    """(files, 2): each file's summed loss in bits and its byte count."""
    rows = []
    for f in files:
        data = DataConfig(paths=(str(f),), seq_len=seq_len, batch_size=batch_size)
        r = evaluate(model, tokenizer, data, split="all")
        rows.append((r.bits_per_byte * r.bytes, r.bytes))
    return np.asarray(rows, np.float64)


def without_routed_experts(model):
    """A copy whose routed experts output zero (the weighted sum they feed is then zero)."""
    model = nnx.clone(model)
    model.moe.w_down[...] = jnp.zeros_like(model.moe.w_down[...])
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bf16", type=Path, required=True, help="the bf16 run's release folder")
    ap.add_argument("--qat", type=Path, required=True, help="the QAT run's release folder (packed experts)")
    ap.add_argument("--heldout", type=Path, required=True, help="folder of held-out files")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()

    files = sorted(p for p in args.heldout.iterdir() if p.is_file())
    if not files:
        raise SystemExit(f"{args.heldout}: no files")
    bf16, qat = load_model(args.bf16, dtype="float32"), load_model(args.qat, dtype="float32")
    if bf16.model.config.expert_weights == "mxfp4" or qat.model.config.expert_weights != "mxfp4":
        raise SystemExit(f"expected float experts in {args.bf16} and packed MXFP4 experts in {args.qat}")

    def dense(model):
        return with_index_topk(model, args.seq_len) if model.config.use_indexer else model

    models = {"bf16": dense(bf16.model), "PTQ": dense(quantize_experts(bf16.model)), "QAT": dense(qat.model),
              "bf16, no routed experts": dense(without_routed_experts(bf16.model))}
    bits = {name: per_file_bits(m, bf16.tokenizer, files, args.seq_len, args.batch_size) for name, m in models.items()}
    n_bytes = bits["bf16"][:, 1]
    total = {name: b[:, 0].sum() / n_bytes.sum() for name, b in bits.items()}
    print(f"held out: {len(files)} files, {int(n_bytes.sum()):,} bytes; rows of {args.seq_len} tokens, float32, "
          "dense attention")
    print(f"{'model':24s} {'bits/byte':>10s} {'vs bf16':>9s}")
    for name, value in total.items():
        print(f"{name:24s} {value:10.4f} {100 * (value / total['bf16'] - 1):+8.3f}%")
    for worse, better in (("PTQ", "QAT"), ("PTQ", "bf16"), ("bf16, no routed experts", "bf16")):
        per_file = (bits[worse][:, 0] - bits[better][:, 0]) / n_bytes  # bits per byte, per file
        mean, se = per_file.mean(), per_file.std(ddof=1) / math.sqrt(len(per_file))
        print(f"{worse} - {better} per file: mean {mean:+.5f} bits/byte, standard error {se:.5f} "
              f"({mean / se:+.1f} SE); {worse} worse on {int((per_file > 0).sum())} of {len(per_file)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
