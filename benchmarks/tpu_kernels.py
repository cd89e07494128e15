"""The Pallas TPU (Mosaic) kernels compiled by libtpu on this CPU host at K3.1 Pro's per-device
shapes, beside the compiler's figures for the XLA path of the same op (issue #27).

The MXFP4 grouped matmul of one MoE layer, as one device of `expert=8,tensor=8` holds it: 112
local experts, gate/up `[3072/8, 3584]` fused in one launch, down `[3584, 3072/8]`, read from the
93-layer model's 92-layer stacks at a row. Rows: 128 at decode (batch 8: the worst-case receive
buffer of the expert exchange, 8 peers x 16 assignments) and 4,096 for a prefill chunk (2,048
tokens, 16 assignments each, over 8 expert shards). The compiler is deterministic: one compile
per case; only the compile times depend on the host. Needs the `tpu` extra (libtpu).

On tpu7x, the only generation whose MXU multiplies fp8, the kernel also with e4m3 MXU inputs
(`mxu="fp8"`, what MXFP8 activations get there). Beside them, the peer: tokamax's TPU `ragged_dot` (its Mosaic grouped matmul) on one layer's
experts in bf16 and in fp8 (it takes no packed MXFP4), same rows and widths, where tokamax is
installed (`pip install 'k31jax[peers]'`).

The activation gradient of the same grouped matmuls (training with the packed experts frozen:
LoRA or QAT of other weights), 4,096 rows: the transposed Mosaic kernel (the fused gate/up launch
sums both weights' terms into one dx) beside the XLA path's backward (`jax.vjp` of
`ops.grouped_matmul`: the layer's experts decoded to bf16, `ragged_dot`'s transpose).

The KDA decode step of one layer, as one device of `expert=8,tensor=8` holds it at batch 8: one
row (the batch is split over `expert`) or all 8, of 96/8 = 12 heads with a 128 x 128 fp32 state
each, updated in place (donated), beside the XLA path (`ops.kda_recurrent`).

The KDA chunked forward of one layer for a 2,048-token prefill chunk, as one device of
`expert=8,tensor=8` holds it: one row, 12 heads of 128 x 128, fp32 tokens, chunks of the model's
size, the state donated, beside the XLA path (`ops.kda_chunked`).

The sparse MLA attention of one layer at decode, as one device of `expert=8,tensor=8` holds it at
batch 8: one query row, 96/8 = 12 heads, top-2,048 over the 24-layer bf16 latent stacks read at a
row, at 4k and 128k tokens of context, beside the XLA path (`ops.mla_attention_sparse`). The
kernel's bytes are its bound (every tile of 16 rows a selection may touch, at most min(K, S / 16)
of them); at 128k that bound is why the op keeps the XLA gather there (`ops._mla.MAX_TILE_READ`).

The lightning indexer's decode scores + top-k of one layer as the same device holds it: one query
row of 64 index heads x 128 against the bf16 index-key stack (24 layers) read at a row, beside the
XLA path (`ops.select_topk`).

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
from k31jax.kernels.sparse_mla import latent_attention_sparse_tpu  # noqa: E402
from k31jax.ops import (Backends, absorb_query, grouped_matmul, kda_chunked, kda_recurrent,  # noqa: E402
                        mla_attention_sparse, select_topk)
from k31jax.quant import MXFP4Weight, kernel_scale_rows  # noqa: E402

MB = 1e6
TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1")
# step -> (rows in the call, rows expected in groups): at decode the buffer holds the worst case,
# a device receives its own share (16) on average
ROWS = {"decode": (128, 16), "prefill": (4096, 4096)}
EXPERT_SHARDS, TENSOR = 8, 8
# the peer's TPU grouped matmul (tokamax `ragged_dot`, its Mosaic kernel) on bf16 and fp8 weights,
# where installed (`pip install 'k31jax[peers]'`): it takes no packed MXFP4
PEERS = ("tokamax-bf16", "tokamax-fp8")


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
    if side.startswith("tokamax"):  # the peer: one layer's experts as bf16 / fp8 [E, K, N·n_w] (no stacks)
        import tokamax

        weights = spec((experts, k, n * n_w), jnp.bfloat16 if side.endswith("bf16") else jnp.float8_e4m3fn)
        t0 = time.perf_counter()
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            compiled = jax.jit(lambda x, w, g: tokamax.ragged_dot(x, w, g, preferred_element_type=jnp.float32,
                                                                  implementation="mosaic")).lower(x, weights, sizes).compile()
        return time.perf_counter() - t0, compiled.memory_analysis().temp_size_in_bytes, aot.analyse(compiled.as_text())
    if side.startswith("kernel"):  # "kernel-fp8": e4m3 MXU inputs (MXFP8 activations on a TPU7x)
        pair = (spec((layers, experts, k // 8, n), jnp.uint32), spec((layers, experts, 1, kernel_scale_rows(k // 32), n), jnp.uint8))

        def fn(x, sizes, row, *flat):
            return mm.mxfp4_gmm_tpu(x, list(zip(flat[::2], flat[1::2])), sizes, block_m=16 if m <= 128 else 128,
                                    row=row, expected_rows=expected, mxu="fp8" if side == "kernel-fp8" else "bf16")
    else:  # the XLA path: the accelerator inference layout (words, scale bytes), ragged_dot
        pair = (spec((layers, experts, n, k // 8), jnp.uint32), spec((layers, experts, n, k // 32), jnp.uint8))

        def fn(x, sizes, row, *flat):
            return tuple(grouped_matmul(x, MXFP4Weight(w, s, row), sizes) for w, s in zip(flat[::2], flat[1::2]))
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(x, sizes, row, *pair * n_w).compile()
    seconds = time.perf_counter() - t0
    return seconds, compiled.memory_analysis().temp_size_in_bytes, aot.analyse(compiled.as_text())


def compile_dx(topology: str, side: str, n_w: int, n: int, k: int, m: int, layers: int, experts: int):
    """(compile s, the compiler's temporaries, `aot.analyse`) of dx for m rows through n_w
    weights `[K -> N]` of one layer read from the stacks at a row: "kernel" the Mosaic dx launch
    on kernel-layout stacks, "xla" the VJP of the XLA grouped matmul on the inference layout."""
    mesh = Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",))
    rep = NamedSharding(mesh, P())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    dys, sizes, row = [spec((m, n), jnp.bfloat16)] * n_w, spec((experts,), jnp.int32), spec((), jnp.int32)
    if side == "kernel":
        pair = (spec((layers, experts, k // 8, n), jnp.uint32),
                spec((layers, experts, 1, kernel_scale_rows(k // 32), n), jnp.uint8))

        def fn(sizes, row, *rest):
            flat = rest[n_w:]
            return mm.mxfp4_gmm_dx_tpu(list(rest[:n_w]), list(zip(flat[::2], flat[1::2])), sizes,
                                       block_m=128, row=row, expected_rows=m)
    else:
        pair = (spec((layers, experts, n, k // 8), jnp.uint32), spec((layers, experts, n, k // 32), jnp.uint8))

        def fn(sizes, row, *rest):
            flat = rest[n_w:]
            ws = [MXFP4Weight(w, sc, row) for w, sc in zip(flat[::2], flat[1::2])]
            x = jnp.zeros((m, k), jnp.bfloat16)
            _, vjp = jax.vjp(lambda x_: tuple(grouped_matmul(x_, w, sizes) for w in ws), x)
            return vjp(tuple(rest[:n_w]))[0]
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(sizes, row, *dys, *pair * n_w).compile()
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


def compile_kda_chunk(topology: str, side: str, t: int, h: int, dk: int, dv: int, chunk: int):
    """(compile s, the compiler's temporaries, `aot.analyse`) of the chunked KDA forward over one
    row of t tokens x h heads from a donated state: "kernel" is `impl="pallas"` built for a TPU
    (the Mosaic launch), "xla" the op's XLA path."""
    mesh = Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",))
    rep = NamedSharding(mesh, P())

    def spec(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep)

    impl = "pallas" if side == "kernel" else "xla"
    args = (spec(1, t, h, dk), spec(1, t, h, dk), spec(1, t, h, dv), spec(1, t, h, dk), spec(1, t, h),
            spec(1, h, dk, dv))
    t0 = time.perf_counter()
    with target_tpu():
        compiled = jax.jit(lambda *a: kda_chunked(*a, chunk, impl=impl), donate_argnums=5).lower(*args).compile()
    seconds = time.perf_counter() - t0
    return seconds, compiled.memory_analysis().temp_size_in_bytes, aot.analyse(compiled.as_text())


def compile_sparse_mla(topology: str, side: str, cfg: ModelConfig, context: int, heads: int):
    """(compile s, the compiler's temporaries, `aot.analyse`) of one decode query's sparse MLA
    attention over the bf16 layer stacks read at a row: "kernel" is the Mosaic kernel between
    the op's query absorption and `W_UV`, "xla" the op's XLA path."""
    mesh = Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",))
    rep = NamedSharding(mesh, P())

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    r, dn, dr, dv, k = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.index_topk
    layers = len(cfg.mla_layers)
    args = (spec((1, 1, heads, dn)), spec((1, 1, heads, dr)), spec((layers, 1, context, r)),
            spec((layers, 1, context, 128)), spec((r, heads, dn)), spec((r, heads, dv)), spec((1, 1, k), jnp.int32),
            spec((1, 1, k), jnp.bool_), spec((), jnp.int32))
    scale = (dn + dr) ** -0.5

    def fn(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, valid, row):
        if side == "xla":
            return mla_attention_sparse(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, valid, scale, impl="xla", layer=row)
        # the kernel between the op's two einsums, whatever the context (the op itself keeps the XLA
        # gather where the kernel's tiles exceed `ops._mla.MAX_TILE_READ` x the selected rows)
        o = latent_attention_sparse_tpu(absorb_query(q_nope, w_uk), q_pe, c_kv, k_pe, idx, valid, row, scale=scale)
        return jnp.einsum("bthr,rhd->bthd", o, w_uv.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    t0 = time.perf_counter()
    with target_tpu(), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - t0
    return seconds, compiled.memory_analysis().temp_size_in_bytes, aot.analyse(compiled.as_text())


def compile_indexer(topology: str, side: str, cfg: ModelConfig, context: int):
    """(compile s, the compiler's temporaries, `aot.analyse`) of one decode query's indexer
    scores and top-k over the bf16 index-key stack read at a row, the query at the context's
    last position: "kernel" is `impl="pallas"` built for a TPU, "xla" the op's XLA path."""
    mesh = Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",))
    rep = NamedSharding(mesh, P())

    def spec(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    hi, di, layers = cfg.index_n_heads, cfg.index_head_dim, len(cfg.mla_layers)
    args = (spec((1, 1, hi, di)), spec((1, 1, hi)), spec((layers, 1, context, di), jnp.bfloat16),
            spec((1,), jnp.int32), spec((1, context), jnp.bool_), spec((), jnp.int32))
    impl = "pallas" if side == "kernel" else "xla"

    def fn(q, w, keys, q_pos, key_valid, row):
        return select_topk(q, w, keys, q_pos, key_valid, cfg.index_topk, impl=impl, layer=row)
    t0 = time.perf_counter()
    with target_tpu(), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - t0
    return seconds, compiled.memory_analysis().temp_size_in_bytes, aot.analyse(compiled.as_text())


def op_rows(title: str, floor: int, floor_name: str, kernel_note: str, compile_side) -> list[str]:
    """One op's block: the title, then the kernel's and the XLA path's compiler figures
    (`compile_side(side)` -> (s, temporaries, `aot.analyse`)), bytes also as a multiple of
    `floor`; printed as they come."""
    row = [title]
    for side in ("kernel", "xla"):
        try:
            sec, temp, hlo = compile_side(side)
        except Exception as exc:  # noqa: BLE001 - report what the compiler said
            row.append(f"  {side:<6} does not compile: {str(exc).splitlines()[0][:200]}")
            continue
        row.append(f"  {side:<6} compile {sec:5.1f} s, temporaries {temp / MB:7.2f} MB, HBM bytes "
                   f"{hlo.hbm_bytes / MB:7.2f} MB ({hlo.hbm_bytes / floor:.2f}x {floor_name}), "
                   f"{hlo.flops / 1e6:7.1f} MFLOP" + (f" ({kernel_note})" if side == "kernel" else ""))
    print("\n".join(row), flush=True)
    return row


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
    try:
        has_tokamax, peer = True, f"tokamax {version('tokamax')}"
    except Exception:  # noqa: BLE001 - not installed: the peer's columns are left out, and said so
        has_tokamax, peer = False, "tokamax not installed (its columns left out)"
    lines = [f"jax {jax.__version__}, libtpu {version('libtpu')}, {peer}; one device's share of a K3.1 Pro MoE layer "
             f"(expert={EXPERT_SHARDS},tensor={TENSOR}: {experts} local experts, {layers}-layer stacks read at a row)"]
    for topology in args.topology or TOPOLOGIES:
        for step, (m, expected) in ROWS.items():
            chosen = aot.expected_local_experts(cfg, 8 if step == "decode" else 2048, EXPERT_SHARDS)
            for name, (n_w, n, k) in shapes(cfg).items():
                packed = n_w * n * (k // 2 + k // 32)  # one expert's codes and scale bytes
                row = [f"[{topology} {step} {name}] {m:,} rows ({expected:,} expected in groups), N {n:,}, "
                       f"K {k:,}; one expert packed {packed / MB:.2f} MB, the {chosen:.1f} expected chosen {chosen * packed / MB:.1f} MB, all "
                       f"{experts} {experts * packed / MB:.1f} MB"]
                fp8 = ("kernel-fp8",) if topology.startswith("tpu7x") else ()  # the one MXU that takes fp8
                for side in ("kernel", *fp8, "xla", *(PEERS if has_tokamax else ())):
                    try:
                        sec, temp, hlo = compile_case(topology, side, n_w, n, k, m, expected, layers, experts)
                    except Exception as exc:  # noqa: BLE001 - report what the compiler said
                        row.append(f"  {side:<6} does not compile: {str(exc).splitlines()[0][:200]}")
                        continue
                    note = {"kernel": " (its BlockSpec estimate at the expected experts)",
                            "kernel-fp8": " (e4m3 MXU inputs; the same DMAs)",
                            "xla": ""}.get(side, f" (declares no cost estimate: counted by its operands, all "
                                                 f"{experts} experts; the {chosen:.1f} expected chosen hold "
                                                 f"{chosen * n_w * n * k * (2 if side.endswith('bf16') else 1) / MB:.1f} MB)")
                    row.append(f"  {side:<12} compile {sec:5.1f} s, temporaries {temp / MB:8.1f} MB, HBM bytes "
                               f"{hlo.hbm_bytes / MB:8.1f} MB, {hlo.flops / 1e9:7.1f} GFLOP" + note)
                print("\n".join(row), flush=True)
                lines += row
    m = ROWS["prefill"][0]
    for topology in args.topology or TOPOLOGIES:
        for name, (n_w, n, k) in shapes(cfg).items():
            floor = n_w * experts * n * (k // 2 + k // 32) + n_w * m * n * 2 + m * k * 2
            lines += op_rows(f"[{topology} {name} dx] {m:,} rows, N {n:,}, K {k:,}: all {experts} local experts "
                             f"packed, dy read and dx written once (bf16), {floor / MB:.1f} MB", floor,
                             "that floor's", "its BlockSpec estimate",
                             lambda side: compile_dx(topology, side, n_w, n, k, m, layers, experts))
    h, dk, dv = cfg.kda_num_heads // TENSOR, cfg.kda_head_dim, cfg.kda_head_dim
    for topology in args.topology or TOPOLOGIES:
        for b in (1, 8):
            state = b * h * dk * dv * 4
            lines += op_rows(f"[{topology} kda decode step] {b} row(s) x {h} heads, state {dk} x {dv} fp32: "
                             f"{state / MB:.2f} MB read and written", 2 * state, "the state's",
                             "its BlockSpec estimate", lambda side: compile_kda(topology, side, b, h, dk, dv))
    t, chunk = 2048, cfg.kda_chunk_size
    for topology in args.topology or TOPOLOGIES:
        moved = (t * h * (3 * dk + 2 * dv + 1) + 2 * h * dk * dv) * 4
        lines += op_rows(f"[{topology} kda prefill chunk] 1 row x {t:,} tokens x {h} heads of {dk} x {dv}, chunks of "
                         f"{chunk}: q, k, g, v, beta read, o written, the state read and written, fp32, "
                         f"{moved / MB:.2f} MB", moved, "the tokens' and state's", "its BlockSpec estimate",
                         lambda side: compile_kda_chunk(topology, side, t, h, dk, dv, chunk))
    heads = cfg.num_attention_heads // TENSOR
    for topology in args.topology or TOPOLOGIES:
        for context in (4096, 131072):
            selected = min(cfg.index_topk, context) * (cfg.kv_lora_rank + 128) * 2
            lines += op_rows(f"[{topology} sparse mla decode] 1 query x {heads} heads, top-{cfg.index_topk:,} of "
                             f"{context:,} tokens: the selected rows {selected / MB:.2f} MB (bf16, r "
                             f"{cfg.kv_lora_rank} + k_pe at 128 lanes)", selected, "the selected rows'",
                             "its BlockSpec bound", lambda side: compile_sparse_mla(topology, side, cfg, context, heads))
            keys = context * cfg.index_head_dim * 2
            lines += op_rows(f"[{topology} indexer decode] 1 query x {cfg.index_n_heads} index heads x "
                             f"{cfg.index_head_dim}, top-{cfg.index_topk:,} of {context:,} keys: the keys "
                             f"{keys / MB:.2f} MB (bf16)", keys, "the keys'", "its BlockSpec estimate and top-k",
                             lambda side: compile_indexer(topology, side, cfg, context))
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
