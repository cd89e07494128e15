"""Generation on CPU: decode tok/s and time-to-first-token, k31jax `Engine` vs transformers'
`kimi_linear` `generate()`, on one Kimi-Linear-shaped config, in the same run.

    .venv/bin/python benchmarks/generate.py [--batches 1 8] [--context 2048] [--new-tokens 17]

- Config: hidden 512, 12 layers (MLA at 1-indexed 4, 8, 12; KDA elsewhere), 64 experts top-4
  + 1 shared, vocab 32768, float32, random weights. Both sides build it from one HF config dict.
- k31jax: `Engine(model, max_len=context + new_tokens, prefill_chunk=--chunk)`, greedy, no stop
  ids. A warm-up `generate` compiles every program first; timings are the median of --repeats
  and exclude compilation. TTFT = prompt to first token on the host; decode tok/s = batch *
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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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


def copy_bandwidth_gbs(mb: int = 512, repeats: int = 5) -> float:
    """Memory bandwidth from a large array copy (read + write bytes / time), best of repeats."""
    a = np.ones(mb * (1 << 20) // 4, np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best / 1e9


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


def bench_k31jax(batch, context, new_tokens, repeats, chunk):
    import jax
    from flax import nnx

    import k31jax
    from k31jax.generate import Engine

    cfg = k31jax.ModelConfig.from_hf(CONFIG, dtype="float32")
    model = k31jax.K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    engine = Engine(model, max_len=context + new_tokens, prefill_chunk=chunk)
    prompts = np.random.default_rng(1).integers(3, cfg.vocab_size, (batch, context)).tolist()
    # Compile every program: a prompt of min(context, chunk) tokens runs the same [batch, width]
    # prefill program as the chunks of the full context (and the same cache / decode shapes).
    warm = [p[: min(context, chunk)] for p in prompts]
    engine.generate(warm, 2, stop_ids=frozenset())
    compile_s = engine.compile_seconds
    runs = [engine.generate(prompts, new_tokens, stop_ids=frozenset()) for _ in range(repeats)]
    decode = next(v for k, v in engine._local.items() if k[0] == "decode")
    cost = decode.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(
        ttft_s=statistics.median(r.prefill_seconds for r in runs),
        decode_tok_s=statistics.median(r.decode_tok_s for r in runs),
        compile_s=compile_s,
        xla_bytes_per_step=float(cost.get("bytes accessed", float("nan"))),
        n_params=k31jax.count_params(cfg).total,
        cfg=cfg,
        jax=jax.__version__,
    )


def bench_torch(batch, context, new_tokens, repeats, threads, experts_impl, timeout):
    py = os.environ.get("K31JAX_TORCH_PYTHON", str(ROOT / ".torchvenv" / "bin" / "python"))
    if not Path(py).exists():
        return None, f"no torch venv at {py}"
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
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--torch-repeats", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=512, help="k31jax prefill_chunk")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--torch-experts", default="grouped_mm",
                    help="transformers experts implementation (eager | grouped_mm | batched_mm)")
    ap.add_argument("--torch-timeout", type=float, default=1200, help="seconds per transformers run")
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    load_before = os.getloadavg()
    t_run = time.perf_counter()
    bw = copy_bandwidth_gbs()
    rows = []
    for b in args.batches:
        ours = bench_k31jax(b, args.context, args.new_tokens, args.repeats, args.chunk)
        theirs, err = (None, "--no-torch") if args.no_torch else bench_torch(
            b, args.context, args.new_tokens, args.torch_repeats, threads, args.torch_experts,
            args.torch_timeout)
        rows.append((b, ours, theirs, err))
    cfg = rows[0][1]["cfg"]
    print(f"# generate benchmark  {time.strftime('%Y-%m-%d')}  {platform.processor() or platform.machine()}, "
          f"{threads} CPU threads, jax {rows[0][1]['jax']}, float32, copy bandwidth {bw:.1f} GB/s, "
          f"load average {load_before[0]:.1f} before / {os.getloadavg()[0]:.1f} after, "
          f"run {time.perf_counter() - t_run:.0f} s")
    print(f"# config: Kimi Linear shape, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
          f"(MLA {[i + 1 for i in cfg.mla_layers]}), {cfg.num_experts} experts top-{cfg.num_experts_per_token}, "
          f"vocab {cfg.vocab_size}, {rows[0][1]['n_params'] / 1e6:.0f}M params; context {args.context}, "
          f"{args.new_tokens} new tokens, greedy; k31jax prefill_chunk {args.chunk}")
    hdr = (f"{'batch':>5} {'':18}{'k31jax':>11}{'transformers':>14}{'ratio':>8}")
    print(hdr)
    for b, ours, theirs, err in rows:
        t_dec = theirs["generate_decode_tok_s"] if theirs else float("nan")
        t_ttft = theirs["generate_ttft_s"] if theirs else float("nan")
        print(f"{b:>5} {'decode tok/s':18}{ours['decode_tok_s']:11.1f}{t_dec:14.1f}{ours['decode_tok_s'] / t_dec:7.2f}x")
        print(f"{b:>5} {'TTFT s':18}{ours['ttft_s']:11.2f}{t_ttft:14.2f}{t_ttft / ours['ttft_s']:7.2f}x")
    print(f"\n{'batch':>5} {'floor MB/tok':>13} {'k31jax XLA MB/tok':>18} {'floor tok/s':>12} "
          f"{'k31jax % floor':>15} {'transformers % floor':>21}")
    for b, ours, theirs, err in rows:
        floor = floor_bytes_per_step(cfg, b, args.context)
        floor_tok_s = b / (floor / (bw * 1e9))
        t_dec = theirs["generate_decode_tok_s"] if theirs else float("nan")
        print(f"{b:>5} {floor / b / 1e6:13.1f} {ours['xla_bytes_per_step'] / b / 1e6:18.1f} "
              f"{floor_tok_s:12.1f} {100 * ours['decode_tok_s'] / floor_tok_s:14.1f}% "
              f"{100 * t_dec / floor_tok_s:20.1f}%")
    print(f"# k31jax compile (excluded above): " + ", ".join(f"batch {b}: {o['compile_s']:.0f} s" for b, o, _, _ in rows))
    for b, _, theirs, err in rows:
        if theirs is None:
            print(f"# transformers batch {b} not run: {err}")
    t = next((r[2] for r in rows if r[2]), None)
    if t:
        print(f"# transformers {t['transformers']}, torch {t['torch']}, {t['threads']} threads, "
              f"experts {args.torch_experts}, "
              f"code path {t['code_path']}, params {t['n_params']:,}")


if __name__ == "__main__":
    main()
