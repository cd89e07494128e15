"""The Pallas TPU (Mosaic) kernels compiled by libtpu on this CPU host at K3.1 Pro's per-device
shapes, beside the compiler's figures for the XLA path of the same op (issue #27).

The MXFP4 grouped matmul of one MoE layer, as one device of `expert=8,tensor=8` holds it: 112
local experts, gate/up `[3072/8, 3584]` fused in one launch, down `[3584, 3072/8]`, read from the
93-layer model's 92-layer stacks at a row. Rows: 128 at decode (batch 8: the worst-case receive
buffer of the expert exchange, 8 peers x 16 assignments) and 4,096 for a prefill chunk (2,048
tokens, 16 assignments each, over 8 expert shards). The compiler is deterministic: one compile
per case; only the compile times depend on the host. Needs the `tpu` extra (libtpu).

The KDA decode step of one layer, as one device of `expert=8,tensor=8` holds it at batch 8: one
row (the batch is split over `expert`) or all 8, of 96/8 = 12 heads with a 128 x 128 fp32 state
each, updated in place (donated), beside the XLA path (`ops.kda_recurrent`).

Then the whole K3.1 Pro decode step (batch 8, 4,096 tokens of context) and a 2,048-token prefill
chunk on `v5p:4x4x4` with `expert=8,tensor=8`, compiled with the kernels off (the XLA paths the
engine runs) and on (`k31jax compile --kernels pallas`: the experts held in the kernel's layout).

    python benchmarks/tpu_kernels.py --record
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib.metadata import version

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import Session, add_record_arguments, report  # noqa: E402
from compile import CASES, lines_for  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from k31jax import ModelConfig, aot  # noqa: E402
from k31jax.kernels import target_tpu  # noqa: E402
from k31jax.kernels.mxfp4_matmul import mosaic_mxfp4_gmm as mm  # noqa: E402
from k31jax.ops import Backends, grouped_matmul, kda_recurrent  # noqa: E402
from k31jax.quant import MXFP4Weight, kernel_scale_rows  # noqa: E402

MB = 1e6
TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1")
# step -> (rows in the call, rows expected in groups): at decode the buffer holds the worst case,
# a device receives its own share (16) on average
ROWS = {"decode": (128, 16), "prefill": (4096, 4096)}
EXPERT_SHARDS, TENSOR = 8, 8


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """name -> (weights in one launch, N, K) of one device's share of a layer."""
    f, d = cfg.moe_intermediate_size // TENSOR, cfg.expert_in_dim
    return {"gate/up": (2, f, d), "down": (1, d, f)}


def compile_case(topology: str, side: str, n_w: int, n: int, k: int, m: int, expected: int, layers: int,
                 experts: int):
    """(compile s, the compiler's temporaries, `aot.analyse` of the optimized HLO)."""
    mesh = Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",))
    rep = NamedSharding(mesh, P())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    x, sizes, row = spec((m, k), jnp.bfloat16), spec((experts,), jnp.int32), spec((), jnp.int32)
    if side == "kernel":
        pair = (spec((layers, experts, k // 8, n), jnp.uint32), spec((layers, experts, 1, kernel_scale_rows(k // 32), n), jnp.uint8))

        def fn(x, sizes, row, *flat):
            return mm.mxfp4_gmm_tpu(x, list(zip(flat[::2], flat[1::2])), sizes, block_m=16 if m <= 128 else 128,
                                    row=row, expected_rows=expected)
    else:  # the XLA path: the accelerator inference layout (words, scale bytes), ragged_dot
        pair = (spec((layers, experts, n, k // 8), jnp.uint32), spec((layers, experts, n, k // 32), jnp.uint8))

        def fn(x, sizes, row, *flat):
            return tuple(grouped_matmul(x, MXFP4Weight(w, s, row), sizes) for w, s in zip(flat[::2], flat[1::2]))
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(x, sizes, row, *pair * n_w).compile()
    seconds = time.perf_counter() - t0
    return seconds, compiled.memory_analysis().temp_size_in_bytes, aot.analyse(compiled.as_text())


def compile_kda(topology: str, side: str, b: int, h: int, dk: int, dv: int):
    """(compile s, the compiler's temporaries, `aot.analyse`) of one token of the KDA recurrence
    over b rows x h heads, the state donated: "kernel" is `impl="pallas"` built for a TPU (the
    Mosaic step), "xla" the op's XLA path."""
    mesh = Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",))
    rep = NamedSharding(mesh, P())

    def spec(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep)

    impl = "pallas" if side == "kernel" else "xla"
    args = (spec(b, 1, h, dk), spec(b, 1, h, dk), spec(b, 1, h, dv), spec(b, 1, h, dk), spec(b, 1, h),
            spec(b, h, dk, dv))
    t0 = time.perf_counter()
    with target_tpu():
        compiled = jax.jit(lambda *a: kda_recurrent(*a, impl=impl), donate_argnums=5).lower(*args).compile()
    seconds = time.perf_counter() - t0
    return seconds, compiled.memory_analysis().temp_size_in_bytes, aot.analyse(compiled.as_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", action="append", choices=TOPOLOGIES, help="only these (repeatable)")
    parser.add_argument("--no-steps", action="store_true", help="skip the whole decode / prefill programs")
    add_record_arguments(parser)
    args = parser.parse_args()
    if not aot.libtpu_available():
        raise SystemExit("benchmarks/tpu_kernels.py needs libtpu: pip install 'k31jax[tpu]'")
    cfg = ModelConfig.preset("k31_pro")
    layers, experts = len(cfg.moe_layers), cfg.num_experts // EXPERT_SHARDS
    session = Session()
    lines = [f"jax {jax.__version__}, libtpu {version('libtpu')}; one device's share of a K3.1 Pro MoE layer "
             f"(expert={EXPERT_SHARDS},tensor={TENSOR}: {experts} local experts, {layers}-layer stacks read at a row)"]
    for topology in args.topology or TOPOLOGIES:
        for step, (m, expected) in ROWS.items():
            chosen = aot.expected_local_experts(cfg, 8 if step == "decode" else 2048, EXPERT_SHARDS)
            for name, (n_w, n, k) in shapes(cfg).items():
                packed = n_w * n * (k // 2 + k // 32)  # one expert's codes and scale bytes
                row = [f"[{topology} {step} {name}] {m:,} rows ({expected:,} expected in groups), N {n:,}, "
                       f"K {k:,}; one expert packed {packed / MB:.2f} MB, the {chosen:.1f} expected chosen {chosen * packed / MB:.1f} MB, all "
                       f"{experts} {experts * packed / MB:.1f} MB"]
                for side in ("kernel", "xla"):
                    try:
                        sec, temp, hlo = compile_case(topology, side, n_w, n, k, m, expected, layers, experts)
                    except Exception as exc:  # noqa: BLE001 - report what the compiler said
                        row.append(f"  {side:<6} does not compile: {str(exc).splitlines()[0][:200]}")
                        continue
                    row.append(f"  {side:<6} compile {sec:5.1f} s, temporaries {temp / MB:8.1f} MB, HBM bytes "
                               f"{hlo.hbm_bytes / MB:8.1f} MB, {hlo.flops / 1e9:7.1f} GFLOP"
                               + (" (its BlockSpec estimate at the expected experts)" if side == "kernel" else ""))
                print("\n".join(row), flush=True)
                lines += row
    h, dk, dv = cfg.kda_num_heads // TENSOR, cfg.kda_head_dim, cfg.kda_head_dim
    for topology in args.topology or TOPOLOGIES:
        for b in (1, 8):
            state = b * h * dk * dv * 4
            row = [f"[{topology} kda decode step] {b} row(s) x {h} heads, state {dk} x {dv} fp32: "
                   f"{state / MB:.2f} MB read and written"]
            for side in ("kernel", "xla"):
                try:
                    sec, temp, hlo = compile_kda(topology, side, b, h, dk, dv)
                except Exception as exc:  # noqa: BLE001 - report what the compiler said
                    row.append(f"  {side:<6} does not compile: {str(exc).splitlines()[0][:200]}")
                    continue
                row.append(f"  {side:<6} compile {sec:5.1f} s, temporaries {temp / MB:6.2f} MB, HBM bytes "
                           f"{hlo.hbm_bytes / MB:6.2f} MB ({hlo.hbm_bytes / (2 * state):.2f}x the state's), "
                           f"{hlo.flops / 1e6:6.1f} MFLOP"
                           + (" (its BlockSpec estimate)" if side == "kernel" else ""))
            print("\n".join(row), flush=True)
            lines += row
    for name in () if args.no_steps else ("decode-4k", "prefill-2k"):
        step, topology, mesh, batch, context, chunk = CASES[name]
        for kernels in ("xla", "pallas"):
            r = aot.compile_program(cfg, topology, mesh, step=step, batch=batch, context=context, chunk=chunk,
                                    backends=Backends(kernels=kernels, ep="ragged"))
            row = lines_for(f"{name} kernels={kernels}", r, cfg)
            kernel = sum(b for b, op in r.hlo.traffic if "mxfp4_gmm_tpu" in op)
            if kernels == "pallas":
                chosen = aot.expected_local_experts(cfg, r.tokens, EXPERT_SHARDS)
                one = sum(n_w * n * (k // 2 + k // 32) for n_w, n, k in shapes(cfg).values())
                packed = chosen * one * layers
                row.append(f"  the MXFP4 kernel's bytes (its cost estimate, trip counts) {kernel / 1e9:.2f} GB; the "
                           f"{chosen:.1f} expected chosen local experts' packed codes and scales, {layers} layers, "
                           f"{packed / 1e9:.2f} GB: {kernel / packed:.2f}x")
            print("\n".join(row), flush=True)
            lines += row
    session.finish()
    report("tpu_kernels", "tpu_kernels", lines, session, args)


if __name__ == "__main__":
    main()
