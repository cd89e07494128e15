"""MX quantise / dequantise throughput: k31jax (jax.jit, CPU) vs NumPy + ml_dtypes.

Usage::

    python benchmarks/mx.py [--mib 256] [--repeats 5] [--thp] [--record]

Input: a float32 tensor of ``--mib`` MiB (default 256 MiB = 64 Mi elements),
shaped ``[rows, 4096]``, blocks of 32 along the last axis, OCP floor rule.
Throughput (GB/s, 1 GB = 1e9 bytes) always counts the bytes of the **float32
tensor** (the quantise input, the dequantise output), so both directions are
comparable; the bf16 row counts the same f32-equivalent bytes. Method
(`benchmarks/_harness.py`): k31jax and NumPy alternate, one warm-up each (jax:
compile + run; results ``jax.block_until_ready``-ed), then ``--repeats`` rounds;
median [slowest, fastest]; ``--record`` writes RESULTS.md only on a quiet machine.

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
(dequantised inside the jitted graph) against bf16 weights holding the same values,
at decode token counts (4-64) and 512, the two alternating.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from _harness import Session, Stats, add_record_arguments, alternate, report, timed  # noqa: E402
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
        fresh_stats = alternate({"k31jax": timed(lambda: fresh(*jax_args)),
                                 "numpy": timed(lambda: np_fn(*np_args))}, repeats)
        bufs = [tuple(jnp.zeros(s, d) for s, d in jax_out_shapes)]

        def jax_into():  # the outputs are the next call's donated buffers
            out = into(*bufs[0], *jax_args)
            bufs[0] = out if isinstance(out, tuple) else (out,)
            return out

        reuse_stats = alternate({"k31jax": timed(jax_into),
                                 "numpy": timed(lambda: np_fn(*np_args, np_out_bufs))}, repeats)
        t_jf, t_nf = fresh_stats["k31jax"]["s"], fresh_stats["numpy"]["s"]
        t_jr, t_nr = reuse_stats["k31jax"]["s"], reuse_stats["numpy"]["s"]
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


def _gbs(nbytes: int, t: Stats) -> str:
    """GB/s at the median time [at the slowest, at the fastest]."""
    r = t.rate(nbytes / 1e9)
    return f"{r.median:.2f} [{r.low:.2f}, {r.high:.2f}]"


def table(results: list[tuple]) -> list[str]:
    lines = [f"{'op':33s} {'k31jax GB/s':>20s} {'NumPy GB/s':>20s} {'ratio':>7s}   {'mode':6s} equal"]
    for name, nb, tjf, tnf, tjr, tnr, ok in results:
        for mode, tj, tn in (("fresh", tjf, tnf), ("reuse", tjr, tnr)):
            lines.append(f"{name if mode == 'fresh' else '':33s} {_gbs(nb, tj):>20s} {_gbs(nb, tn):>20s} "
                         f"{tn.median / tj.median:6.1f}x   {mode:6s} {'yes' if ok else 'NO'}")
    return lines


# ----------------------------------------------------------------------------
# Routed-expert forward: packed MXFP4 vs bf16 experts (model integration later)
# ----------------------------------------------------------------------------


EXPERT_TOKENS = (4, 8, 16, 64, 512)


def bench_expert_forward(repeats: int) -> list[str]:
    """Routed-expert forward time: packed MXFP4 (dequantised in-graph) vs bf16 weights holding
    the same values, at decode token counts (4-64) and one prefill-like count (512), each with
    the form `routed_experts(form="auto")` picks (the model's choice), the two sides alternating.
    """
    from k31jax.ops import MXFP4Weight, routed_experts

    e, k, ell, inter = 64, 4, 1024, 512
    rng = np.random.default_rng(0)
    shapes = {"w_gate": (e, inter, ell), "w_up": (e, inter, ell), "w_down": (e, ell, inter)}
    packed = {n: MXFP4Weight(*mxfp4_quantize_packed(jnp.asarray(rng.standard_normal(s) * 0.02, jnp.float32)))
              for n, s in shapes.items()}
    dense = {n: mxfp4_dequantize_packed(w.packed, w.scale, dtype=jnp.bfloat16) for n, w in packed.items()}
    nbytes = lambda ws: sum(int(np.prod(a.shape)) * a.dtype.itemsize for w in ws.values()
                            for a in (w if isinstance(w, tuple) else (w,)))
    lines = [f"routed-expert forward: {e} experts [{inter} x {ell}] x3, top-{k}, bf16 activations; "
             f"weights {nbytes(dense) / 2**20:.0f} MiB bf16 vs {nbytes(packed) / 2**20:.0f} MiB packed; "
             f"form as routed_experts(form='auto') picks it",
             f"{'tokens':>8} {'impl':>8} {'bf16 ms':>26} {'mxfp4 ms':>26} {'bf16/mxfp4':>11}  equal"]
    for n_tok in EXPERT_TOKENS:
        impl = "gather" if n_tok * k < e else "blocked"  # routed_experts' "auto" on CPU at these sizes
        x = jnp.asarray(rng.standard_normal((n_tok, ell)), jnp.bfloat16)
        idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n_tok)]), jnp.int32)
        w = jnp.full((n_tok, k), 1.0 / k, jnp.float32)
        fn = jax.jit(lambda x, ws: routed_experts(x, idx, w, ws["w_gate"], ws["w_up"], ws["w_down"]))
        same = bool(jnp.array_equal(fn(x, dense), fn(x, packed)))
        stats = alternate({"bf16": timed(lambda: fn(x, dense)), "mxfp4": timed(lambda: fn(x, packed))}, repeats)
        b16, mx = stats["bf16"]["s"], stats["mxfp4"]["s"]
        ms = lambda t: f"{1e3 * t.median:.2f} [{1e3 * t.low:.2f}, {1e3 * t.high:.2f}]"
        lines.append(f"{n_tok:>8} {impl:>8} {ms(b16):>26} {ms(mx):>26} {b16.median / mx.median:10.2f}x  "
                     f"{'yes' if same else 'NO'}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the float32 tensor in MiB")
    ap.add_argument("--repeats", type=int, default=5, help="recorded rounds, each side once per round (>= 3)")
    add_record_arguments(ap)
    ap.add_argument("--thp", action="store_true",
                    help=f"re-run with GLIBC_TUNABLES={THP_TUNABLE} (huge pages for XLA's buffers)")
    args = ap.parse_args()
    if args.thp and THP_TUNABLE not in os.environ.get("GLIBC_TUNABLES", ""):
        env = dict(os.environ, GLIBC_TUNABLES=THP_TUNABLE)
        argv = [a for a in sys.argv if a != "--thp"]
        os.execve(sys.executable, [sys.executable, *argv], env)
    session = Session()
    lines = [f"ml_dtypes {ml_dtypes.__version__}; numpy {np.__version__}; "
             f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')}",
             f"input: float32 [{args.mib * 2**20 // 4 // COLS}, {COLS}] = {args.mib} MiB; block {BLOCK} on the last "
             f"axis; floor rule; GB/s counts the f32 tensor's bytes, at the median [slowest, fastest] time of "
             f"{args.repeats} alternating rounds after a warm-up; fresh = new outputs, reuse = donated buffers",
             *table(bench_quant(args.mib, args.repeats)), "", *bench_expert_forward(args.repeats)]
    session.finish()
    report("mx", "mx", lines, session, args)


if __name__ == "__main__":
    main()
