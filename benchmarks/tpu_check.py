"""The Pallas TPU (Mosaic) kernels run against their XLA paths on a TPU: the check a kernel must
pass before `ops._impl.VERIFIED_ON_TPU` lets "auto" pick it (issue #27).

    python benchmarks/tpu_check.py [--reps 5]

On a TPU backend each op runs compiled twice, `impl="pallas"` (the Mosaic kernel) and
`impl="xla"`, at one device's K3.1 Pro shapes (expert=8,tensor=8: 112 local experts, 12 KDA
heads, 12 MLA heads, 64 index heads): the kernel's output against the XLA path's (relative error
under the op's tolerance; for the top-k, the selections equal as sets), then both timed,
alternating, `--reps` times after a warm-up (median and spread). The lines to paste into
`VERIFIED_ON_TPU` are printed for the kernels that passed, with the jax and libtpu versions and
the device kind.

Anywhere else it is a dry run: the Mosaic bodies in TPU interpret mode (`impl="interpret_tpu"`)
on tiny shapes, which checks this script, not a TPU (its timings mean nothing and it prints no
`VERIFIED_ON_TPU` line).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version

import jax
import jax.numpy as jnp
import numpy as np

from k31jax.ops import grouped_matmul, kda_chunked, kda_recurrent, mla_attention_sparse, select_topk
from k31jax.quant import MXFP4Weight


def case_shapes(on_tpu: bool) -> dict:
    if on_tpu:  # one device of expert=8,tensor=8 (benchmarks/tpu_kernels.py)
        return dict(e=112, d=3584, f=384, rows=128, kda_t=2048, kda_h=12, dk=128, mla_h=12, r=512, dr=64,
                    dn=128, s=4096, top=2048, hi=64, di=128, layers=24)
    # the dry run: s = 2 x top so the sparse MLA kernel runs (its tiles at most 2x the selection)
    return dict(e=6, d=256, f=128, rows=24, kda_t=40, kda_h=2, dk=16, mla_h=2, r=32, dr=16, dn=16, s=32, top=16,
                hi=4, di=16, layers=3)


def cases(sh: dict, impl: str) -> list:
    """(name, the kernel's `KERNELS` name, fn(*args, impl), args, tolerance; None: a selection)."""
    ks = iter(jax.random.split(jax.random.key(0), 32))
    out = []

    def u8(shape, lo=0, hi=256):
        return jax.random.randint(next(ks), shape, lo, hi).astype(jnp.uint8)

    e, d, f, m = sh["e"], sh["d"], sh["f"], sh["rows"]
    w_up = MXFP4Weight(u8((e, f, d // 2)), u8((e, f, d // 32), 118, 127))
    w_down = MXFP4Weight(u8((e, d, f // 2)), u8((e, d, f // 32), 118, 127))
    sizes = jnp.bincount(jax.random.randint(next(ks), (m,), 0, e), length=e).astype(jnp.int32)
    x = jax.random.normal(next(ks), (m, d), jnp.bfloat16)
    h = jax.random.normal(next(ks), (m, f), jnp.bfloat16)
    out.append(("mxfp4 up", "mxfp4_gmm", lambda a, i: grouped_matmul(a, w_up, sizes, impl=i), (x,), 2e-2))
    out.append(("mxfp4 down", "mxfp4_gmm", lambda a, i: grouped_matmul(a, w_down, sizes, impl=i), (h,), 2e-2))
    out.append(("mxfp4 up dx", "mxfp4_gmm", lambda a, i: jax.grad(
        lambda v: jnp.sum(grouped_matmul(v, w_up, sizes, impl=i).astype(jnp.float32) ** 2))(a), (x,), 2e-2))

    b, t, kh, dk = 1, sh["kda_t"], sh["kda_h"], sh["dk"]
    q = jax.random.normal(next(ks), (b, t, kh, dk))
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    k = jax.random.normal(next(ks), (b, t, kh, dk))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(next(ks), (b, t, kh, dk))
    g = -jnp.exp(jax.random.uniform(next(ks), (b, t, kh, dk), minval=-4, maxval=0))
    beta = jax.nn.sigmoid(jax.random.normal(next(ks), (b, t, kh)))
    s0 = jax.random.normal(next(ks), (b, kh, dk, dk)) * 0.1
    out.append(("kda chunked", "kda_chunk", lambda *a: kda_chunked(*a[:-1], 64 if t >= 64 else 16, impl=a[-1]),
                (q, k, v, g, beta, s0), 1e-4))
    out.append(("kda decode step", "kda_step", lambda *a: kda_recurrent(*a[:-1], impl=a[-1]),
                tuple(z[:, :1] for z in (q, k, v, g, beta)) + (s0,), 1e-5))

    hm, r, dr, dn, s, top, layers = sh["mla_h"], sh["r"], sh["dr"], sh["dn"], sh["s"], sh["top"], sh["layers"]
    bf = jnp.bfloat16
    qn = jax.random.normal(next(ks), (1, 1, hm, dn), bf)
    qp = jax.random.normal(next(ks), (1, 1, hm, dr), bf)
    ckv = jax.random.normal(next(ks), (layers, 1, s, r), bf)
    kpe = jax.random.normal(next(ks), (layers, 1, s, dr), bf)
    w_uk = (jax.random.normal(next(ks), (r, hm, dn)) * r ** -0.5).astype(bf)
    w_uv = (jax.random.normal(next(ks), (r, hm, dn)) * r ** -0.5).astype(bf)
    idx = jax.lax.top_k(jax.random.uniform(next(ks), (1, 1, s)), top)[1].astype(jnp.int32)
    valid = jnp.ones((1, 1, top), bool)
    scale = (dn + dr) ** -0.5
    out.append(("sparse mla decode", "sparse_mla", lambda *a: mla_attention_sparse(*a[:-2], scale, impl=a[-1], layer=a[-2]),
                (qn, qp, ckv, kpe, w_uk, w_uv, idx, valid, jnp.int32(layers - 1)), 2e-2))

    hi, di = sh["hi"], sh["di"]
    qi = jax.random.normal(next(ks), (1, 1, hi, di))
    wi = jax.random.normal(next(ks), (1, 1, hi))
    keys = jax.random.normal(next(ks), (layers, 1, s, di), bf)
    key_valid = jnp.ones((1, s), bool)
    pos = jnp.array([s - 1], jnp.int32)
    out.append(("indexer top-k", "indexer_topk", lambda *a: select_topk(*a[:-2], top, impl=a[-1], layer=a[-2]),
                (qi, wi, keys, pos, key_valid, jnp.int32(1)), None))
    return out


def relative_error(a, b) -> float:
    a, b = (np.asarray(z, np.float64) for z in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def agreement(got, want) -> bool:
    """The kernel's top-k selection equals the XLA path's as a set, row by row."""
    (gi, gv), (wi, wv) = got, want
    gi, gv, wi, wv = (np.asarray(z).reshape(-1, np.asarray(z).shape[-1]) for z in (gi, gv, wi, wv))
    return all(set(a[m]) == set(c[n]) for a, m, c, n in zip(gi, gv, wi, wv))


def timed(fn, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    on_tpu = jax.default_backend() == "tpu"
    impl = "pallas" if on_tpu else "interpret_tpu"
    try:
        libtpu = version("libtpu")
    except PackageNotFoundError:
        libtpu = "not installed"
    kind = jax.devices()[0].device_kind
    print(f"jax {jax.__version__}, libtpu {libtpu}, {kind}: "
          + ("the Mosaic kernels compiled" if on_tpu else "DRY RUN (TPU interpret mode, tiny shapes; not a TPU check)"))
    passed = {}  # kernel -> whether every case of it passed
    for name, kernel_name, fn, fn_args, tol in cases(case_shapes(on_tpu), impl):
        kernel = jax.jit(lambda *a, fn=fn: fn(*a, impl))
        xla = jax.jit(lambda *a, fn=fn: fn(*a, "xla"))
        try:
            got, want = kernel(*fn_args), xla(*fn_args)
        except Exception as exc:  # noqa: BLE001 - report what failed, go on with the others
            print(f"  {name:<18} FAILED to run: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            passed[kernel_name] = False
            continue
        if tol is None:
            ok, detail = agreement(got, want), "selections equal as sets"
        else:
            err = max(relative_error(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            ok, detail = bool(np.isfinite(err) and err < tol), f"relative error {err:.2e} (tolerance {tol:g})"
        times = {"kernel": [], "xla": []}
        for _ in range(args.reps):  # both sides alternating, after the warm-up above
            times["kernel"].append(timed(kernel, fn_args))
            times["xla"].append(timed(xla, fn_args))
        med = {side: statistics.median(v) * 1e3 for side, v in times.items()}
        spread = {side: (min(v) * 1e3, max(v) * 1e3) for side, v in times.items()}
        print(f"  {name:<18} {'ok  ' if ok else 'FAIL'} {detail}; kernel {med['kernel']:.3f} ms "
              f"[{spread['kernel'][0]:.3f}, {spread['kernel'][1]:.3f}], xla {med['xla']:.3f} ms "
              f"[{spread['xla'][0]:.3f}, {spread['xla'][1]:.3f}] (median [min, max] of {args.reps})")
        passed[kernel_name] = passed.get(kernel_name, True) and ok
    for kernel_name in (k for k, ok in passed.items() if ok and on_tpu):
        print(f'VERIFIED_ON_TPU["{kernel_name}"] = "jax {jax.__version__}, libtpu {libtpu}, {kind}"')
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
