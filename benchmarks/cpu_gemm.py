"""XLA:CPU's matmul at decode shapes against NumPy's BLAS: what a batch-B decode step can reach.

    .venv/bin/python benchmarks/cpu_gemm.py [--rows 1 8 64] [--record]

A decode step multiplies `[B, in]` activations by every weight matrix once, so at small B it
should run at memory bandwidth. This times `x @ W` (float32, one jitted dot per call, the
weight already on the device) for the weight shapes of generate.py's config, XLA against
`numpy.matmul` (OpenBLAS) on the same arrays, alternating, and prints the weight bytes read per
second: at B = 1 both stream the weight near copy bandwidth; at B = 8 XLA:CPU's GEMM runs at a
fraction of it and of NumPy's, which bounds the batch-8 decode step of `benchmarks/generate.py`
on CPU whatever the model code does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Session, add_record_arguments, alternate, ratio, report, timed  # noqa: E402

# (name, in, out): generate.py's LM head, dense MLP, and one routed expert's matrix
SHAPES = (("lm head", 512, 32768), ("dense up", 512, 1536), ("dense down", 1536, 512), ("expert", 512, 256))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mb", type=int, default=64, help="weight bytes per call: copies of the matrix to reach it")
    add_record_arguments(ap)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    session = Session()
    rng = np.random.default_rng(0)
    lines = [f"x [B, in] @ W [in, out], float32, {jax.default_backend()}; each call multiplies by enough "
             f"distinct copies of W to read {args.mb} MB; weight GB/s, median [min, max] of {args.repeats} "
             f"alternating rounds; copy bandwidth {session.bandwidth_gbs:.1f} GB/s",
             f"{'matrix':>11} {'in x out':>12} {'B':>3}{'XLA GB/s':>24}{'NumPy GB/s':>24}{'XLA/NumPy':>11}"]
    for name, d_in, d_out in SHAPES:
        copies = max(1, args.mb * 2**20 // (4 * d_in * d_out))
        ws_np = [rng.standard_normal((d_in, d_out), np.float32) for _ in range(copies)]
        ws = [jnp.asarray(w) for w in ws_np]
        gb = copies * d_in * d_out * 4 / 1e9
        for b in args.rows:
            x_np = rng.standard_normal((b, d_in), np.float32)
            x = jnp.asarray(x_np)
            fn = jax.jit(lambda x, ws: [x @ w for w in ws])
            jax.block_until_ready(fn(x, ws))
            stats = alternate({"xla": timed(lambda fn=fn, x=x, ws=ws: fn(x, ws)),
                               "numpy": timed(lambda x=x_np, ws=ws_np: [np.matmul(x, w) for w in ws])},
                              args.repeats)
            xla, blas = (stats[side]["s"].rate(gb) for side in ("xla", "numpy"))
            lines.append(f"{name:>11} {f'{d_in}x{d_out}':>12} {b:>3}{str(xla):>24}{str(blas):>24}"
                         f"{ratio(xla, blas):>10.2f}x")
    session.finish()
    report("cpu_gemm", "cpu_gemm", lines, session, args)


if __name__ == "__main__":
    main()
