"""Row-block size of the CPU "blocked" routed-expert path: time per block size and token count.

    .venv/bin/python benchmarks/moe_blocks.py [--tokens 64 512 1024 2048 4096 16384] [--record]

`grouped_matmul_blocked` pads each expert's rows to a multiple of the block and runs one
batched matmul of the blocks against their experts' gathered weights. Small blocks waste
less padding; large ones gather fewer weight copies and run larger matmuls. This measures
the forward of one expert matrix (generate.py's shape: 64 experts [256 x 512], top-4,
float32, routing from Gaussian logits) for each block size, alternating between them, and
prints which block `k31jax.ops.blocked_rows` picks for that token count beside the fastest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Session, add_record_arguments, alternate, report, timed  # noqa: E402

BLOCKS = (32, 64, 128, 256)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 1024, 2048, 4096, 16384])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    add_record_arguments(ap)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from k31jax.ops import blocked_rows, grouped_matmul_blocked, permute

    session = Session()
    rng = np.random.default_rng(0)
    e, k = args.experts, args.top_k
    w = jnp.asarray(rng.standard_normal((e, args.inter, args.hidden), np.float32) * 0.02)
    lines = [f"one expert matrix: {e} experts [{args.inter} x {args.hidden}], top-{k}, float32, "
             f"{jax.default_backend()}; seconds, median [min, max] of {args.repeats} alternating rounds",
             f"{'tokens':>7} {'rows/expert':>11} " + "".join(f"{f'block {b}':>30}" for b in BLOCKS)
             + f"{'fastest':>9}{'picked':>8}{'picked/fastest':>16}"]
    for n in args.tokens:
        x = jnp.asarray(rng.standard_normal((n, args.hidden), np.float32))
        idx = jnp.asarray(np.argsort(-rng.standard_normal((n, e)), axis=1)[:, :k], jnp.int32)
        xs, _, sizes = permute(x, idx, e)
        sides = {}
        for b in BLOCKS:
            fn = jax.jit(lambda xs, w, s, b=b: grouped_matmul_blocked(xs, w, s, block=b))
            jax.block_until_ready(fn(xs, w, sizes))  # compile outside the timed rounds
            sides[b] = timed(lambda fn=fn: fn(xs, w, sizes))
        stats = alternate(sides, args.repeats)
        medians = {b: stats[b]["s"].median for b in BLOCKS}
        fastest = min(medians, key=medians.get)
        picked = blocked_rows(n * k, e)
        lines.append(f"{n:>7} {n * k / e:>11.0f} " + "".join(f"{str(stats[b]['s']):>30}" for b in BLOCKS)
                     + f"{fastest:>9}{picked:>8}{medians[picked] / medians[fastest]:>15.2f}x")
    session.finish()
    report("moe_blocks", "moe_blocks", lines, session, args)


if __name__ == "__main__":
    main()
