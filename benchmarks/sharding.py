"""Sharding micro-benchmarks on 8 fake CPU devices (same run, ratios are what to read).

1. One LatentMoE layer (the model's own code) on an `expert=8` mesh: the expert-parallel
   shard_map (tokens exchanged with a dense all_to_all, local ragged_dot) vs `Backends(ep="off")`,
   which leaves the expert-sharded weights to the SPMD partitioner (the naive path: it
   all-gathers the experts to every device). Median step time after a warm-up.
2. Compile time of a 93-layer-deep narrow model (the K3 layer schedule, tiny widths) on an
   `expert=4,tensor=2` mesh: the scanned stack vs the unrolled one (lower + compile, from
   abstract sharded inputs, nothing allocated).

    .venv/bin/python benchmarks/sharding.py [--tokens 2048] [--experts 64] [--repeats 5] [--skip-compile] [--record]

Method (`benchmarks/_harness.py`): the two MoE paths alternate, one warm-up each, then
--repeats rounds, median [min, max]; the compiles (minutes for the unrolled stack) run once
each. `--record` writes RESULTS.md's section `sharding` only on a quiet machine (block
`sharding`; with --skip-compile, `sharding_moe`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Session, add_record_arguments, alternate, report, timed  # noqa: E402
from k31jax import Backends, ModelConfig, distributed, sharding  # noqa: E402
from k31jax.nn import LatentMoE  # noqa: E402


def bench_moe(tokens: int, experts: int, repeats: int) -> dict:
    cfg = ModelConfig.preset("tiny", dtype="float32", hidden_size=256, num_experts=experts,
                             num_experts_per_token=4, moe_intermediate_size=256, routed_expert_hidden_size=128)
    mesh = sharding.make_mesh(expert=8)
    moe = distributed.shard_model(LatentMoE(cfg, rngs=nnx.Rngs(0)), mesh)
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((8, tokens // 8, cfg.hidden_size)),
                                   jnp.float32), jax.NamedSharding(mesh, jax.P("expert")))
    with sharding.activate(mesh):
        steps = {name: nnx.jit(lambda m, x, ep=ep: m(x, backends=Backends(ep=ep)).output)
                 for name, ep in (("ep_shard_map", "dense"), ("naive_allgather", "off"))}
        stats = alternate({name: timed(lambda step=step: step(moe, x)) for name, step in steps.items()}, repeats)
        a, b = (steps[name](moe, x) for name in ("ep_shard_map", "naive_allgather"))
    out = {name: stats[name]["s"] for name in steps}
    out["max_rel_diff"] = float(jnp.abs(a - b).max() / jnp.abs(b).max())
    out["config"] = (f"{tokens} tokens, {experts} experts top-4, latent {cfg.expert_in_dim}, "
                     f"expert width {cfg.moe_intermediate_size}, hidden {cfg.hidden_size}, f32")
    return out


def bench_compile() -> dict:
    k3 = ModelConfig.preset("k3")
    cfg = ModelConfig.preset("tiny", dtype="float32", num_hidden_layers=k3.num_hidden_layers,
                             layer_types=k3.layer_types, attn_res_block_size=k3.attn_res_block_size)
    mesh = sharding.make_mesh(expert=4, tensor=2)
    graphdef, state = distributed.abstract_state(cfg, mesh)
    tokens = jax.ShapeDtypeStruct((4, 32), jnp.int32, sharding=jax.NamedSharding(mesh, jax.P()))
    out = {"layers": cfg.num_hidden_layers, "kda": len(cfg.kda_layers), "mla": len(cfg.mla_layers)}
    with sharding.activate(mesh):
        for name, scan in (("scanned", True), ("unrolled", False)):
            f = jax.jit(lambda st, t, scan=scan: nnx.merge(graphdef, st)(t, None, scan_layers=scan).logits)
            t0 = time.perf_counter()
            lowered = f.lower(state, tokens)
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            out[name] = (t1 - t0, t2 - t1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-compile", action="store_true")
    add_record_arguments(p)
    args = p.parse_args(argv)
    session = Session()
    m = bench_moe(args.tokens, args.experts, args.repeats)
    ms = lambda t: f"{t.median * 1e3:.1f} [{t.low * 1e3:.1f}, {t.high * 1e3:.1f}] ms"
    lines = [f"{len(jax.devices())} fake {jax.devices()[0].platform} devices; median [min, max] of "
             f"{args.repeats} alternating rounds after a warm-up each",
             f"MoE layer step on expert=8 ({m['config']})",
             f"  EP shard_map (dense all_to_all exchange):      {ms(m['ep_shard_map'])}",
             f"  naive (the partitioner all-gathers the experts): {ms(m['naive_allgather'])}",
             f"naive / EP = {m['naive_allgather'].median / m['ep_shard_map'].median:.2f}x; outputs agree to "
             f"{m['max_rel_diff']:.1e} (rel)"]
    if not args.skip_compile:
        c = bench_compile()
        lines += [f"compile (timed once each), {c['layers']}-layer narrow model (K3 schedule: {c['kda']} KDA + "
                  f"{c['mla']} MLA, tiny widths), prefill [4, 32] on expert=4,tensor=2"]
        for name in ("scanned", "unrolled"):
            lo, co = c[name]
            lines.append(f"  {name:>8}: lower {lo:.1f} s, compile {co:.1f} s, total {lo + co:.1f} s")
        lines.append(f"unrolled / scanned = {sum(c['unrolled']) / sum(c['scanned']):.1f}x")
    session.finish()
    report("sharding", "sharding", lines, session, args, part="moe" if args.skip_compile else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
