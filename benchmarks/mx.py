"""MX quantise / dequantise throughput: k31jax (jax.jit, CPU) vs NumPy + ml_dtypes.

Usage::

    python benchmarks/mx.py [--mib 256] [--repeats 5] [--formats e2m1,e4m3]

Input: a float32 tensor of ``--mib`` MiB (default 256 MiB = 64 Mi elements),
shaped ``[rows, 4096]``, blocks of 32 along the last axis, OCP floor rule.
Throughput (GB/s, 1 GB = 1e9 bytes) always counts the bytes of the **float32
tensor** (the quantise input, the dequantise output), so both directions are
comparable. Each timing is the median of ``--repeats`` runs after a warm-up run
(jax: compile + run, results ``jax.block_until_ready``-ed).

The NumPy baseline below implements the same algorithm (integer-bit amax, exact
power-of-two scale, clamp, ml_dtypes RNE cast; LUT/ml_dtypes decode times the
E8M0 scale); outputs are checked equal to k31jax's before timing.

``bench_expert_forward`` (packed MXFP4 vs bf16 routed experts) needs the k31jax
model pieces; it imports them lazily and prints a skip message when they are
not available yet.
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
    E2M1_VALUES,
    dequantize,
    get_format,
    mxfp4_dequantize_packed,
    mxfp4_quantize_packed,
    quantize,
)

BLOCK = 32
COLS = 4096


# ----------------------------------------------------------------------------
# NumPy + ml_dtypes baseline (same algorithm, floor rule)
# ----------------------------------------------------------------------------

_ML_DTYPES = {
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
}


def np_quantize(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """f32 [..., n] -> (codes u8 [..., n], scale u8 [..., n/32]); OCP floor rule."""
    f = get_format(fmt)
    xb = x.reshape(*x.shape[:-1], -1, BLOCK)
    amax_bits = (xb.view(np.uint32) & np.uint32(0x7FFFFFFF)).max(axis=-1)
    e = np.clip((amax_bits >> 23).astype(np.int32) - 127 - f.emax, -127, 127)
    nonfinite = amax_bits >= 0x7F800000
    scale = np.where(nonfinite, 255, e + 127).astype(np.uint8)
    inv = np.ldexp(np.float32(1), np.where(nonfinite, 0, -e)).astype(np.float32)
    y = xb * inv[..., None]  # NumPy keeps subnormals: one exact multiply
    np.clip(y, -f.max_value, f.max_value, out=y)
    codes = y.astype(_ML_DTYPES[fmt]).view(np.uint8)
    return codes.reshape(x.shape), scale


def np_dequantize(codes: np.ndarray, scale: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "e2m1":
        vals = E2M1_VALUES[codes & 0xF]
    else:
        vals = codes.view(_ML_DTYPES[fmt]).astype(np.float32)
    s = scale.astype(np.int32)
    mult = np.ldexp(np.float32(1), s - 127).astype(np.float32)
    mult[s == 255] = np.nan
    vb = vals.reshape(*codes.shape[:-1], -1, BLOCK)
    vb *= mult[..., None]
    return vb.reshape(codes.shape)


def np_dequantize_packed(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return np_dequantize(codes, scale, "e2m1")


def np_quantize_packed(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    codes, scale = np_quantize(x, "e2m1")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), scale


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------


def _median_time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # warm-up (and compile)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def bench_quant(mib: int, repeats: int, formats: list[str]) -> list[tuple]:
    rows = mib * 2**20 // 4 // COLS
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((rows, COLS), dtype=np.float32)
    x_np *= np.exp2(rng.integers(-20, 20, (rows, COLS // BLOCK, 1))).astype(np.float32).repeat(
        BLOCK, axis=2).reshape(rows, COLS)
    nbytes = x_np.nbytes
    x = jax.device_put(x_np)

    results = []
    for fmt in formats:
        q_jax = jax.jit(lambda v, fmt=fmt: quantize(v, fmt))
        dq_jax = jax.jit(lambda c, s, fmt=fmt: dequantize(c, s, fmt))
        codes, scale = jax.block_until_ready(q_jax(x))
        codes_np, scale_np = np_quantize(x_np, fmt)
        ok = _same(codes, codes_np) and _same(scale, scale_np)
        ok_dq = _same(dq_jax(codes, scale), np_dequantize(codes_np, scale_np, fmt))

        t_jq = _median_time(lambda: q_jax(x), repeats)
        t_nq = _median_time(lambda: np_quantize(x_np, fmt), repeats)
        results.append((f"quantize {fmt}", nbytes, t_jq, t_nq, ok))
        t_jd = _median_time(lambda: dq_jax(codes, scale), repeats)
        t_nd = _median_time(lambda: np_dequantize(codes_np, scale_np, fmt), repeats)
        results.append((f"dequantize {fmt} -> f32", nbytes, t_jd, t_nd, ok_dq))
        del codes, scale, codes_np, scale_np

    # Packed MXFP4 (the checkpoint / model layout).
    qp = jax.jit(lambda v: mxfp4_quantize_packed(v))
    dqp = jax.jit(lambda p, s: mxfp4_dequantize_packed(p, s, jnp.float32))
    packed, scale = jax.block_until_ready(qp(x))
    packed_np, scale_np = np_quantize_packed(x_np)
    ok = _same(packed, packed_np) and _same(scale, scale_np)
    ok_dq = _same(dqp(packed, scale), np_dequantize_packed(packed_np, scale_np))
    results.append(("mxfp4_quantize_packed", nbytes, _median_time(lambda: qp(x), repeats),
                    _median_time(lambda: np_quantize_packed(x_np), repeats), ok))
    results.append(("mxfp4_dequantize_packed -> f32", nbytes,
                    _median_time(lambda: dqp(packed, scale), repeats),
                    _median_time(lambda: np_dequantize_packed(packed_np, scale_np), repeats), ok_dq))
    return results


def print_table(results: list[tuple]) -> None:
    print(f"{'op':34s} {'k31jax GB/s':>12s} {'NumPy GB/s':>11s} {'ratio':>7s}  {'k31jax ms':>9s}"
          f" {'NumPy ms':>9s}  same")
    for name, nbytes, tj, tn, ok in results:
        print(f"{name:34s} {nbytes / tj / 1e9:12.2f} {nbytes / tn / 1e9:11.2f} {tn / tj:6.1f}x "
              f" {tj * 1e3:9.1f} {tn * 1e3:9.1f}  {'yes' if ok else 'NO'}")


# ----------------------------------------------------------------------------
# Routed-expert forward: packed MXFP4 vs bf16 experts (model integration later)
# ----------------------------------------------------------------------------


def bench_expert_forward(repeats: int) -> None:
    """Packed-MXFP4 vs bf16 routed-expert forward, once the model pieces exist.

    Expects ``k31jax.ops`` to provide a routed-expert forward that accepts
    either bf16 expert weights or packed ``(packed, scale)`` weights. Until then
    this prints a skip message.
    """
    try:
        from k31jax.ops import moe_experts_forward  # type: ignore[attr-defined]  # noqa: F401
    except Exception as exc:  # ImportError, AttributeError, or a half-written package
        print(f"\n[skip] routed-expert forward (packed MXFP4 vs bf16): k31jax model pieces "
              f"unavailable ({type(exc).__name__}: {exc})")
        return
    print("\n[todo] routed-expert forward benchmark: model pieces found; wire it up here")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--formats", default="e2m1,e4m3")
    args = ap.parse_args()
    t0 = time.perf_counter()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs); "
          f"ml_dtypes {ml_dtypes.__version__}; numpy {np.__version__}")
    print(f"input: float32 [{args.mib * 2**20 // 4 // COLS}, {COLS}] = {args.mib} MiB; "
          f"block {BLOCK} on the last axis; floor rule; GB/s counts the f32 bytes; "
          f"median of {args.repeats} after warm-up\n")
    print_table(bench_quant(args.mib, args.repeats, args.formats.split(",")))
    bench_expert_forward(args.repeats)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
