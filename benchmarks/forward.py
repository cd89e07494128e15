"""Prefill and decode tokens/s on CPU: k31jax (jit) vs transformers' `kimi_linear` (torch eager).

Both run the same Kimi-Linear-shaped config (the only family transformers implements), built
from one HF config dict, in float32, in the same run. The torch side runs in its own venv
(`benchmarks/_torch_runner.py`; see `tests/golden/make_kimi_linear_golden.py` for the venv),
found at $K31JAX_TORCH_PYTHON or ./.torchvenv/bin/python, made by scripts/make_torch_venv.sh; without it only k31jax is timed.

    .venv/bin/python benchmarks/forward.py [--batch 1] [--prompt-len 256] [--decode-steps 32]

Timing: median of --repeats after a warm-up (compilation excluded for k31jax, as torch eager
has none). decode tok/s = batch * steps / time for `steps` cached one-token steps.
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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import k31jax  # noqa: E402

# A small Kimi Linear: 8 layers (MLA at 0-indexed 3 and 7), hidden 256, 32 experts top-4.
CONFIG = {
    "model_type": "kimi_linear", "vocab_size": 2048, "hidden_size": 256, "num_hidden_layers": 8,
    "intermediate_size": 768, "moe_intermediate_size": 128, "hidden_act": "silu",
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 64,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7],
                           "num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4},
    "num_experts": 32, "num_experts_per_token": 4, "num_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "num_nextn_predict_layers": 0,
}


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_k31jax(batch, prompt_len, steps, repeats):
    cfg = k31jax.ModelConfig.from_hf(CONFIG, dtype="float32")
    model = k31jax.K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, cache, tokens):
        logits, cache = nnx.merge(graphdef, state)(tokens, cache)
        return jnp.argmax(logits[:, -1], -1), cache

    @jax.jit
    def decode_n(state, cache, token):
        def body(carry, _):
            tok, c = carry
            logits, c = nnx.merge(graphdef, state)(tok[:, None], c)
            nxt = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
            return (nxt, c), nxt
        (_, cache), toks = jax.lax.scan(body, (token.astype(jnp.int32), cache), None, length=steps)
        return toks, cache

    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    max_len = prompt_len + steps + 1

    def run_prefill():
        out = prefill(state, k31jax.init_cache(cfg, batch, max_len), tokens)
        jax.block_until_ready(out)
        return out

    first, cache = run_prefill()  # compile
    jax.block_until_ready(decode_n(state, cache, first))  # compile
    t_prefill = _median_time(run_prefill, repeats)
    first, cache = run_prefill()
    t_decode = _median_time(lambda: jax.block_until_ready(decode_n(state, cache, first)), repeats)
    return dict(prefill_tok_s=batch * prompt_len / t_prefill, decode_tok_s=batch * steps / t_decode,
                decode_ms_per_step=1e3 * t_decode / steps,
                n_params=k31jax.count_params(cfg).total)


def bench_torch(batch, prompt_len, steps, repeats, threads):
    py = os.environ.get("K31JAX_TORCH_PYTHON", str(ROOT / ".torchvenv" / "bin" / "python"))
    if not Path(py).exists():
        return None, f"no torch venv at {py}"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(CONFIG, f)
    cmd = [py, str(ROOT / "benchmarks" / "_torch_runner.py"), "--config-json", f.name, "--batch", str(batch),
           "--prompt-len", str(prompt_len), "--decode-steps", str(steps), "--repeats", str(repeats),
           "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    os.unlink(f.name)
    if proc.returncode:
        return None, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), None


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    print(f"# forward benchmark  {time.strftime('%Y-%m-%d')}  {platform.processor() or platform.machine()}, "
          f"{threads} CPU threads, jax {jax.__version__}, float32")
    print(f"# config: Kimi Linear shape, hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers, "
          f"{CONFIG['num_experts']} experts top-{CONFIG['num_experts_per_token']}; batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.decode_steps} decode steps")
    ours = bench_k31jax(args.batch, args.prompt_len, args.decode_steps, args.repeats)
    theirs, err = bench_torch(args.batch, args.prompt_len, args.decode_steps, args.repeats, threads)
    if theirs is not None and theirs.get("n_params") not in (None, ours["n_params"]):
        print(f"# note: parameter counts differ: k31jax {ours['n_params']:,} vs torch {theirs['n_params']:,}")
    print(f"{'':24}{'k31jax (jit)':>14}{'transformers':>14}{'ratio':>8}")
    for key, label in (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s")):
        t = theirs[key] if theirs else float("nan")
        print(f"{label:24}{ours[key]:14.1f}{t:14.1f}{ours[key] / t:8.2f}x")
    if theirs is None:
        print(f"# transformers not run: {err}")
    else:
        print(f"# transformers {theirs['transformers']}, torch {theirs['torch']}, code path {theirs['code_path']}")


if __name__ == "__main__":
    main()
