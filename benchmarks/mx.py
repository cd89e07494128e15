"""MX quantise / dequantise throughput: k31jax (jax.jit, CPU) vs NumPy + ml_dtypes.

Usage::

    python benchmarks/mx.py [--mib 256] [--repeats 5]

Input: a float32 tensor of ``--mib`` MiB (default 256 MiB = 64 Mi elements),
shaped ``[rows, 4096]``, blocks of 32 along the last axis, OCP floor rule.
Throughput (GB/s, 1 GB = 1e9 bytes) always counts the bytes of the **float32
tensor** (the quantise input, the dequantise output), so both directions are
comparable; the bf16 row counts the same f32-equivalent bytes. Every timing is
the median of ``--repeats`` runs after one warm-up run (jax: compile + run;
results are ``jax.block_until_ready``-ed).

Two modes:

* ``fresh``: plain calls, each allocating its outputs (how the API is called).
* ``reuse``: outputs written into preallocated buffers: for jax a donated
  buffer of the output's shape (``donate_argnums`` + ``keep_unused=True``), for
  NumPy ``out=`` arguments. This removes the first-touch page faults of the
  fresh outputs. Those dominate "fresh" for 256 MiB f32 outputs on this kind of
  machine: XLA's buffers come from glibc malloc on 4 KiB pages, whereas NumPy
  asks for transparent huge pages. ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
  gives XLA huge pages as well (``--thp`` re-runs the script with it set).

The NumPy baseline below implements the same algorithm (integer-bit amax, exact
power-of-two scale, clamp, ml_dtypes RNE cast; LUT / ml_dtypes decode times the
E8M0 scale), whole-array vectorised; its outputs are checked equal to k31jax's.

``bench_expert_forward`` times the routed experts with packed MXFP4 weights
(dequantised inside the jitted graph) against bf16 weights holding the same values.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from k31jax.quant import (  # noqa: E402
    dequantize,
    mxfp4_dequantize_packed,
    mxfp4_quantize_packed,
    quantize,
)

BLOCK = 32
COLS = 4096
THP_TUNABLE = "glibc.malloc.hugetlb=1"

# ----------------------------------------------------------------------------
# NumPy + ml_dtypes baseline (same algorithm, floor rule)
# ----------------------------------------------------------------------------

# name -> (emax_elem, max_elem, ml_dtypes element type)
_NP_FMT = {
    "e2m1": (2, 6.0, ml_dtypes.float4_e2m1fn),
    "e4m3": (8, 448.0, ml_dtypes.float8_e4m3fn),
}
_E2M1_LUT256 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0] * 16,
    np.float32,
)  # indexed by the whole byte: the high nibble is ignored


def np_scales(x: np.ndarray, fmt: str, tmp_u32: np.ndarray):
    """(scale bytes [r, nb], multiplier 2**-e [r, nb]) from the f32 bits of x."""
    emax, _, _ = _NP_FMT[fmt]
    r, n = x.shape
    absbits = np.bitwise_and(x.view(np.uint32), np.uint32(0x7FFFFFFF), out=tmp_u32)
    amax_bits = absbits.reshape(r, n // BLOCK, BLOCK).max(axis=-1)
    e = np.clip((amax_bits >> 23).astype(np.int32) - 127 - emax, -127, 127)
    nonfinite = amax_bits >= 0x7F800000
    scale = np.where(nonfinite, 255, e + 127).astype(np.uint8)
    inv = np.ldexp(np.float32(1), np.where(nonfinite, 0, -e)).astype(np.float32)
    return scale, inv


def np_quantize(x: np.ndarray, fmt: str, out=None) -> tuple[np.ndarray, np.ndarray]:
    """f32 [r, n] -> (codes u8 [r, n], scale u8 [r, n/32]). ``out = (codes, scale, tmp f32)``."""
    _, maxv, mldt = _NP_FMT[fmt]
    r, n = x.shape
    codes, scale_out, tmp = out if out is not None else (
        np.empty(x.shape, np.uint8), np.empty((r, n // BLOCK), np.uint8), np.empty(x.shape, np.float32))
    scale, inv = np_scales(x, fmt, tmp.view(np.uint32))
    scale_out[...] = scale
    y = tmp.reshape(r, n // BLOCK, BLOCK)
    np.multiply(x.reshape(y.shape), inv[..., None], out=y)  # NumPy keeps subnormals: one exact multiply
    np.clip(y, -maxv, maxv, out=y)
    np.copyto(codes.view(mldt), tmp, casting="unsafe")  # ml_dtypes RNE cast
    return codes, scale_out


def np_pack(codes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    out = np.left_shift(pairs[..., 1], 4, out=out)
    return np.bitwise_or(out, pairs[..., 0], out=out)


def np_quantize_packed(x: np.ndarray, out=None) -> tuple[np.ndarray, np.ndarray]:
    """``out = (packed, scale, codes tmp, f32 tmp)``."""
    packed, scale, codes, tmp = out if out is not None else (None, None, None, None)
    codes, scale = np_quantize(x, "e2m1", None if out is None else (codes, scale, tmp))
    return np_pack(codes, packed), scale


def np_dequantize(codes: np.ndarray, scale: np.ndarray, fmt: str, out=None) -> np.ndarray:
    """codes u8 [r, n] + scale [r, n/32] -> f32 [r, n], written into ``out`` if given."""
    r, n = codes.shape
    out = np.empty(codes.shape, np.float32) if out is None else out
    if fmt == "e2m1":
        np.take(_E2M1_LUT256, codes, out=out)
    else:
        np.copyto(out, codes.view(_NP_FMT[fmt][2]), casting="unsafe")
    s = scale.astype(np.int32)
    mult = np.ldexp(np.float32(1), s - 127).astype(np.float32)
    mult[s == 255] = np.nan
    vb = out.reshape(r, n // BLOCK, BLOCK)
    np.multiply(vb, mult[..., None], out=vb)
    return out


def np_dequantize_packed(packed: np.ndarray, scale: np.ndarray, out=None, codes=None) -> np.ndarray:
    r, m = packed.shape
    codes = np.empty((r, m, 2), np.uint8) if codes is None else codes.reshape(r, m, 2)
    np.bitwise_and(packed, 0xF, out=codes[..., 0])
    np.right_shift(packed, 4, out=codes[..., 1])
    return np_dequantize(codes.reshape(r, 2 * m), scale, "e2m1", out)


def np_dequantize_packed_bf16(packed, scale, out=None, tmp=None, codes=None) -> np.ndarray:
    f32 = np_dequantize_packed(packed, scale, tmp, codes)
    out = np.empty(f32.shape, ml_dtypes.bfloat16) if out is None else out
    np.copyto(out, f32, casting="unsafe")
    return out


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------


def _median(step, state, repeats: int) -> float:
    """Median seconds of ``state = step(state)`` after one warm-up call."""
    state = jax.block_until_ready(step(state))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = jax.block_until_ready(step(state))
        ts.append(time.perf_counter() - t0)
    del state
    return statistics.median(ts)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16:
        return bool(np.array_equal(a.astype(np.float32), b.astype(np.float32), equal_nan=True))
    return bool(np.array_equal(a, b))


def _jit_into(fn, n_out: int):
    """jit of ``(out buffers..., *args) -> fn(*args)`` writing into the donated buffers."""
    return jax.jit(lambda *a: fn(*a[n_out:]), donate_argnums=tuple(range(n_out)), keep_unused=True)


def make_input(mib: int) -> np.ndarray:
    rows = mib * 2**20 // 4 // COLS
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, COLS), dtype=np.float32)
    blk = x.reshape(rows, COLS // BLOCK, BLOCK)
    blk *= np.exp2(rng.integers(-20, 20, (rows, COLS // BLOCK, 1))).astype(np.float32)
    return x


def bench_quant(mib: int, repeats: int) -> list[tuple]:
    x_np = make_input(mib)
    nbytes = x_np.nbytes
    r, n = x_np.shape
    x = jax.device_put(x_np)
    f32_tmp = np.empty_like(x_np)
    u8_tmp = np.empty(x_np.shape, np.uint8)
    results = []

    def row(name, jax_fn, jax_args, jax_out_shapes, np_fn, np_args, np_out_bufs):
        """Times fresh and reuse variants of one op and checks jax == numpy."""
        fresh = jax.jit(jax_fn)
        into = _jit_into(jax_fn, len(jax_out_shapes))
        want = np_fn(*np_args)
        got = fresh(*jax_args)
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        ok = all(_same(g, w) for g, w in zip(got, want))
        del got, want
        t_jf = _median(lambda _: fresh(*jax_args), None, repeats)
        t_nf = _median(lambda _: np_fn(*np_args), None, repeats)
        bufs = tuple(jnp.zeros(s, d) for s, d in jax_out_shapes)
        t_jr = _median(lambda b: into(*(b if isinstance(b, tuple) else (b,)), *jax_args), bufs, repeats)
        t_nr = _median(lambda _: np_fn(*np_args, np_out_bufs), None, repeats)
        results.append((name, nbytes, t_jf, t_nf, t_jr, t_nr, ok))

    scale_shape = (r, n // BLOCK)
    for fmt in ("e2m1", "e4m3"):
        row(f"quantize {fmt}", lambda v, fmt=fmt: quantize(v, fmt), (x,),
            [((r, n), jnp.uint8), (scale_shape, jnp.uint8)],
            lambda v, out=None, fmt=fmt: np_quantize(v, fmt, out), (x_np,),
            (np.empty((r, n), np.uint8), np.empty(scale_shape, np.uint8), f32_tmp))
    packed_out = np.empty((r, n // 2), np.uint8)
    row("mxfp4_quantize_packed", lambda v: mxfp4_quantize_packed(v), (x,),
        [((r, n // 2), jnp.uint8), (scale_shape, jnp.uint8)],
        np_quantize_packed, (x_np,),
        (packed_out, np.empty(scale_shape, np.uint8), u8_tmp, f32_tmp))

    for fmt in ("e2m1", "e4m3"):
        codes_np, scale_np = np_quantize(x_np, fmt)
        codes, scale = jax.device_put(codes_np), jax.device_put(scale_np)
        row(f"dequantize {fmt} -> f32", lambda c, s, fmt=fmt: dequantize(c, s, fmt), (codes, scale),
            [((r, n), jnp.float32)],
            lambda c, s, out=None, fmt=fmt: np_dequantize(c, s, fmt, out), (codes_np, scale_np), f32_tmp)
        del codes, scale, codes_np, scale_np

    packed_np, scale_np = np_quantize_packed(x_np)
    packed, scale = jax.device_put(packed_np), jax.device_put(scale_np)
    row("mxfp4_dequantize_packed -> f32", lambda p, s: mxfp4_dequantize_packed(p, s, jnp.float32),
        (packed, scale), [((r, n), jnp.float32)],
        lambda p, s, out=None: np_dequantize_packed(p, s, out, None if out is None else u8_tmp), (packed_np, scale_np), f32_tmp)
    bf16_out = np.empty((r, n), ml_dtypes.bfloat16)
    row("mxfp4_dequantize_packed -> bf16", lambda p, s: mxfp4_dequantize_packed(p, s, jnp.bfloat16),
        (packed, scale), [((r, n), jnp.bfloat16)],
        lambda p, s, out=None: np_dequantize_packed_bf16(
            p, s, out, *((None, None) if out is None else (f32_tmp, u8_tmp))),
        (packed_np, scale_np), bf16_out)
    return results


def print_table(results: list[tuple]) -> None:
    print(f"{'':33s} {'---------- fresh outputs ----------':>36s}   {'------- reused output buffers ------':>36s}")
    print(f"{'op':33s} {'k31jax GB/s':>12s} {'NumPy GB/s':>11s} {'ratio':>8s}   "
          f"{'k31jax GB/s':>12s} {'NumPy GB/s':>11s} {'ratio':>8s}   equal")
    for name, nb, tjf, tnf, tjr, tnr, ok in results:
        print(f"{name:33s} {nb / tjf / 1e9:12.2f} {nb / tnf / 1e9:11.2f} {tnf / tjf:7.1f}x   "
              f"{nb / tjr / 1e9:12.2f} {nb / tnr / 1e9:11.2f} {tnr / tjr:7.1f}x   {'yes' if ok else 'NO'}")


# ----------------------------------------------------------------------------
# Routed-expert forward: packed MXFP4 vs bf16 experts (model integration later)
# ----------------------------------------------------------------------------


def bench_expert_forward(repeats: int) -> None:
    """Routed-expert forward time: packed MXFP4 (dequantised in-graph) vs bf16 weights.

    A decode-like step (few tokens, "gather" impl: reads only the chosen experts) and a
    prefill-like one ("blocked" impl, the CPU default for many tokens), same weights (bf16 = exact dequant).
    """
    from k31jax.ops import MXFP4Weight, routed_experts
    from k31jax.quant import mxfp4_dequantize_packed, mxfp4_quantize_packed

    e, k, ell, inter = 64, 4, 1024, 512
    rng = np.random.default_rng(0)
    shapes = {"w_gate": (e, inter, ell), "w_up": (e, inter, ell), "w_down": (e, ell, inter)}
    packed = {n: MXFP4Weight(*mxfp4_quantize_packed(jnp.asarray(rng.standard_normal(s) * 0.02, jnp.float32)))
              for n, s in shapes.items()}
    dense = {n: mxfp4_dequantize_packed(w.packed, w.scale, dtype=jnp.bfloat16) for n, w in packed.items()}
    nbytes = lambda ws: sum(int(np.prod(a.shape)) * a.dtype.itemsize for w in ws.values()
                            for a in (w if isinstance(w, tuple) else (w,)))
    print(f"\nrouted-expert forward: {e} experts [{inter} x {ell}] x3, top-{k}, bf16 activations; "
          f"weights {nbytes(dense) / 2**20:.0f} MiB bf16 vs {nbytes(packed) / 2**20:.0f} MiB packed")
    print(f"{'tokens':>8} {'impl':>7} {'bf16 ms':>9} {'mxfp4 ms':>9} {'mxfp4/bf16':>11}  equal")
    for n_tok, impl in ((4, "gather"), (512, "blocked")):
        x = jnp.asarray(rng.standard_normal((n_tok, ell)), jnp.bfloat16)
        idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n_tok)]), jnp.int32)
        w = jnp.full((n_tok, k), 1.0 / k, jnp.float32)
        fn = jax.jit(lambda x, ws: routed_experts(x, idx, w, ws["w_gate"], ws["w_up"], ws["w_down"], impl=impl))
        times = {}
        outs = {}
        for name, ws in (("bf16", dense), ("mxfp4", packed)):
            outs[name] = jax.block_until_ready(fn(x, ws))
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, ws))
                ts.append(time.perf_counter() - t0)
            times[name] = statistics.median(ts)
        same = bool(jnp.array_equal(outs["bf16"], outs["mxfp4"]))
        print(f"{n_tok:>8} {impl:>7} {1e3 * times['bf16']:9.2f} {1e3 * times['mxfp4']:9.2f} "
              f"{times['mxfp4'] / times['bf16']:10.2f}x  {'yes' if same else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the float32 tensor in MiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--thp", action="store_true",
                    help=f"re-run with GLIBC_TUNABLES={THP_TUNABLE} (huge pages for XLA's buffers)")
    args = ap.parse_args()
    if args.thp and THP_TUNABLE not in os.environ.get("GLIBC_TUNABLES", ""):
        env = dict(os.environ, GLIBC_TUNABLES=THP_TUNABLE)
        argv = [a for a in sys.argv if a != "--thp"]
        os.execve(sys.executable, [sys.executable, *argv], env)
    t0 = time.perf_counter()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs); "
          f"ml_dtypes {ml_dtypes.__version__}; numpy {np.__version__}; "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')}")
    print(f"input: float32 [{args.mib * 2**20 // 4 // COLS}, {COLS}] = {args.mib} MiB; block {BLOCK} "
          f"on the last axis; floor rule; GB/s counts the f32 tensor's bytes; median of "
          f"{args.repeats} after a warm-up\n")
    print_table(bench_quant(args.mib, args.repeats))
    bench_expert_forward(args.repeats)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
