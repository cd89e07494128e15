"""Generation on CPU: decode tok/s and time-to-first-token, k31jax `Engine` vs transformers'
`kimi_linear` `generate()`, on one Kimi-Linear-shaped config, in the same run.

    .venv/bin/python benchmarks/generate.py [--batches 1 8] [--context 2048] [--new-tokens 17]

- Config: hidden 512, 12 layers (MLA at 1-indexed 4, 8, 12; KDA elsewhere), 64 experts top-4
  + 1 shared, vocab 32768, float32, random weights. Both sides build it from one HF config dict.
- k31jax: `Engine(model, max_len=context + new_tokens, prefill_chunk=c)`, greedy, no stop
  ids, for each c of --chunks (default: the engine's default 512, and the whole context in one
  call, as transformers' `generate()` prefills it; one engine each, the same weights). A warm-up `generate` compiles every program first; timings exclude compilation. TTFT = prompt to first token on the host; decode tok/s = batch *
  (N - 1) / (time from the first token to the last).
- transformers: `benchmarks/_torch_runner.py --generate --generate-only --generate-streamer` in
  the torch venv ($K31JAX_TORCH_PYTHON or ./.torchvenv/bin/python, made by scripts/make_torch_venv.sh), eager attention,
  experts (`--torch-experts`, default grouped_mm, its fastest CPU path here): one
  `generate(max_new_tokens=N)` per repeat; TTFT = until the streamer receives the
  first new token, decode tok/s = batch * (N - 1) / (total - TTFT).
- Bytes per decoded token: the weights and caches one decode step must read, divided by the
  batch. "floor" = the minimum (every weight matrix once, only the experts the batch routes to,
  expected under uniform routing; KDA states and the MLA latent cache up to the context),
  "k31jax XLA" = the compiled decode step's `cost_analysis()["bytes accessed"]`. The
  bandwidth floor tok/s = batch / (step floor bytes / measured copy bandwidth).
- Method (`benchmarks/_harness.py`): the two sides alternate, one warm-up each, then --repeats
  rounds; median [min, max]; load average before and after; `--record` writes RESULTS.md only
  when no other process shared the cores (`--force` records it marked as under load).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import Session, add_record_arguments, alternate, ratio, report, torch_python  # noqa: E402

CONFIG = {
    "model_type": "kimi_linear", "vocab_size": 32768, "hidden_size": 512, "num_hidden_layers": 12,
    "intermediate_size": 1536, "moe_intermediate_size": 256, "hidden_act": "silu",
    "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": None, "kv_lora_rank": 128,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12],
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11],
                           "num_heads": 8, "head_dim": 64, "short_conv_kernel_size": 4},
    "num_experts": 64, "num_experts_per_token": 4, "num_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "num_nextn_predict_layers": 0,
}


def floor_bytes_per_step(cfg, batch: int, context: int) -> int:
    """Minimum bytes one decode step reads (fp32): dense weights once, the expected distinct
    routed experts of `batch` tokens under uniform routing, the embedding rows, the caches."""
    import k31jax

    counts = k31jax.count_params(cfg)
    e, k = cfg.num_experts, cfg.num_experts_per_token
    n_moe = len(cfg.moe_layers)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    routed = n_moe * e * per_expert
    embed = cfg.vocab_size * cfg.hidden_size
    dense = counts.total - routed - embed  # everything but routed experts and the embedding
    distinct = e * (1 - (1 - k / e) ** batch)
    weights = dense + n_moe * distinct * per_expert + batch * cfg.hidden_size
    nk, nm = len(cfg.kda_layers), len(cfg.mla_layers)
    kda_state = nk * batch * cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 2  # read + write
    mla_cache = nm * batch * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return int(4 * (weights + kda_state + mla_cache))


def k31jax_side(batch, context, new_tokens, chunk):
    """(one-repeat callable, facts): the engine is built and every program compiled first."""
    import jax

    import k31jax
    from k31jax.generate import Engine

    cfg, model = k31jax_model()
    engine = Engine(model, max_len=context + new_tokens, prefill_chunk=chunk)
    prompts = np.random.default_rng(1).integers(3, cfg.vocab_size, (batch, context)).tolist()
    # Compile every program: a prompt of min(context, chunk) tokens runs the same [batch, width]
    # prefill program as the chunks of the full context (and the same cache / decode shapes).
    warm = [p[: min(context, chunk)] for p in prompts]
    engine.generate(warm, 2, stop_ids=frozenset())
    decode = engine.core.programs.programs_of("decode")[0]
    cost = decode.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost

    def run():
        r = engine.generate(prompts, new_tokens, stop_ids=frozenset())
        return {"ttft_s": r.prefill_seconds, "decode_tok_s": r.decode_tok_s}

    return run, dict(compile_s=engine.compile_seconds, xla_bytes_per_step=float(cost.get("bytes accessed", float("nan"))),
                     n_params=k31jax.count_params(cfg).total, cfg=cfg, jax=jax.__version__)


@functools.cache
def k31jax_model():
    """(config, model): one set of weights for every k31jax side."""
    from flax import nnx

    import k31jax

    cfg = k31jax.ModelConfig.from_hf(CONFIG, dtype="float32")
    return cfg, k31jax.K31ForCausalLM(cfg, rngs=nnx.Rngs(0))


def bench_torch(batch, context, new_tokens, repeats, threads, experts_impl, timeout):
    """One transformers `generate()` run in the torch venv (its own process): (metrics, error)."""
    py = torch_python()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(CONFIG, f)
    cmd = [py, str(ROOT / "benchmarks" / "_torch_runner.py"), "--config-json", f.name,
           "--batch", str(batch), "--prompt-len", str(context), "--decode-steps", str(new_tokens - 1),
           "--repeats", str(repeats), "--warmup", "0", "--threads", str(threads),
           "--generate", "--generate-only", "--generate-streamer", "--experts-implementation", experts_impl]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.unlink(f.name)
        return None, f"timed out after {timeout} s"
    os.unlink(f.name)
    if proc.returncode:
        return None, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=17)
    ap.add_argument("--repeats", type=int, default=3, help="recorded rounds, each side once per round (>= 3)")
    ap.add_argument("--chunks", type=int, nargs="+", help="k31jax prefill_chunk values (default: 512 and --context)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--torch-experts", default="grouped_mm",
                    help="transformers experts implementation (eager | grouped_mm | batched_mm)")
    ap.add_argument("--torch-timeout", type=float, default=1200, help="seconds per transformers run")
    add_record_arguments(ap)
    args = ap.parse_args()
    chunks = list(dict.fromkeys(min(c, args.context) for c in args.chunks or [512, args.context]))
    session = Session()
    if not args.no_torch and torch_python() is None:
        raise SystemExit("no torch venv: run scripts/make_torch_venv.sh, set K31JAX_TORCH_PYTHON, or pass --no-torch")
    rows = []
    for b in args.batches:
        sides, facts = {}, {}
        for c in chunks:
            sides[f"chunk {c}"], facts[c] = k31jax_side(b, args.context, args.new_tokens, c)
        if not args.no_torch:
            def theirs(b=b):
                out, err = bench_torch(b, args.context, args.new_tokens, 1, session.cores, args.torch_experts,
                                       args.torch_timeout)
                if out is None:
                    raise RuntimeError(f"transformers batch {b}: {err}")
                facts["torch"] = out
                return {"ttft_s": out["generate_ttft_s"], "decode_tok_s": out["generate_decode_tok_s"]}
            sides["transformers"] = theirs
        rows.append((b, alternate(sides, args.repeats), facts))
    session.finish()
    first = rows[0][2][chunks[0]]
    cfg = first["cfg"]
    lines = [f"config: Kimi Linear shape, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
             f"(MLA {[i + 1 for i in cfg.mla_layers]}), {cfg.num_experts} experts top-{cfg.num_experts_per_token}, "
             f"vocab {cfg.vocab_size}, {first['n_params'] / 1e6:.0f}M params, float32; context {args.context}, "
             f"{args.new_tokens} new tokens, greedy; k31jax prefill_chunk {' and '.join(map(str, chunks))}; "
             f"median [min, max] of {args.repeats} alternating rounds",
             f"{'batch':>5} {'':14}{'chunk':>6}{'k31jax':>26}{'transformers':>26}{'ratio':>8}"]
    for b, stats, _ in rows:
        theirs = stats.get("transformers")
        for key, label, better_high in (("decode_tok_s", "decode tok/s", True), ("ttft_s", "TTFT s", False)):
            t = theirs[key] if theirs else None
            for c in chunks:
                ours = stats[f"chunk {c}"][key]
                r = (ratio(ours, t) if better_high else ratio(t, ours)) if t else float("nan")
                lines.append(f"{b:>5} {label:14}{c:>6}{str(ours):>26}{str(t) if t else '-':>26}{r:7.2f}x")
    lines.append(f"{'batch':>5} {'chunk':>6} {'floor MB/tok':>13} {'k31jax XLA MB/tok':>18} {'floor tok/s':>12} "
                 f"{'k31jax % floor':>15} {'transformers % floor':>21}")
    for b, stats, facts in rows:
        floor = floor_bytes_per_step(cfg, b, args.context)
        floor_tok_s = b / (floor / (session.bandwidth_gbs * 1e9))
        t = stats.get("transformers")
        t_dec = t["decode_tok_s"].median if t else float("nan")
        for c in chunks:
            lines.append(f"{b:>5} {c:>6} {floor / b / 1e6:13.1f} {facts[c]['xla_bytes_per_step'] / b / 1e6:18.1f} "
                         f"{floor_tok_s:12.1f} {100 * stats[f'chunk {c}']['decode_tok_s'].median / floor_tok_s:14.1f}% "
                         f"{100 * t_dec / floor_tok_s:20.1f}%")
    lines.append("k31jax compile (excluded above): " + ", ".join(
        f"batch {b} chunk {c}: {f[c]['compile_s']:.0f} s" for b, _, f in rows for c in chunks))
    t = next((f["torch"] for _, _, f in rows if "torch" in f), None)
    if t:
        lines.append(f"transformers {t['transformers']}, torch {t['torch']}, {t['threads']} threads, "
                     f"experts {args.torch_experts}, code path {t['code_path']}, params {t['n_params']:,}")
    report("generate", "generate", lines, session, args)


if __name__ == "__main__":
    main()
