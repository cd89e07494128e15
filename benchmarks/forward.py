"""Prefill and decode tokens/s on CPU: k31jax (jit) vs transformers' `kimi_linear` (torch eager).

Both run the same Kimi-Linear-shaped config (the only family transformers implements), built
from one HF config dict, in float32, in the same run. The torch side runs in its own venv
(`benchmarks/_torch_runner.py`; see `tests/golden/make_kimi_linear_golden.py` for the venv),
found at $K31JAX_TORCH_PYTHON or ./.torchvenv/bin/python, made by scripts/make_torch_venv.sh; without it only k31jax is timed.

    .venv/bin/python benchmarks/forward.py [--batch 1] [--prompt-len 256] [--decode-steps 32] [--record [--force]]

Method (`benchmarks/_harness.py`): one warm-up per side (k31jax's compiles; torch builds its
model in each round's process and warms up there), then --repeats (>= 3) rounds alternating,
k31jax then transformers; median [min, max]; the machine and its load before and after;
`--record` writes RESULTS.md's "forward" block (refused under load unless --force, which marks
it). decode tok/s = batch * steps / time for `steps` cached one-token steps (one jitted scan).
"""

from __future__ import annotations

import argparse
import json
import os
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
sys.path.insert(0, str(ROOT / "benchmarks"))

import k31jax  # noqa: E402
from _harness import Session, add_record_arguments, alternate, ratio, report, torch_python  # noqa: E402

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


def k31jax_side(batch, prompt_len, steps):
    """(one-round callable, parameter count): both programs compiled first."""
    cfg = k31jax.ModelConfig.from_hf(CONFIG, dtype="float32")
    model = k31jax.K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, cache, tokens):
        out = nnx.merge(graphdef, state)(tokens, cache)
        return jnp.argmax(out.logits[:, -1], -1), out.cache

    @jax.jit
    def decode_n(state, cache, token):
        def body(carry, _):
            tok, c = carry
            out = nnx.merge(graphdef, state)(tok[:, None], c)
            nxt = jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32)
            return (nxt, out.cache), nxt
        (_, cache), toks = jax.lax.scan(body, (token.astype(jnp.int32), cache), None, length=steps)
        return toks, cache

    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    max_len = prompt_len + steps + 1

    def run_prefill():
        return jax.block_until_ready(prefill(state, model.init_cache(batch, max_len), tokens))

    first, cache = run_prefill()  # compile
    jax.block_until_ready(decode_n(state, cache, first))  # compile

    def one_round() -> dict[str, float]:
        t0 = time.perf_counter()
        first, cache = run_prefill()
        t1 = time.perf_counter()
        jax.block_until_ready(decode_n(state, cache, first))
        t2 = time.perf_counter()
        return {"prefill_tok_s": batch * prompt_len / (t1 - t0), "decode_tok_s": batch * steps / (t2 - t1)}

    return one_round, k31jax.count_params(cfg).total


def torch_round(batch, prompt_len, steps, threads, facts: dict) -> dict[str, float]:
    """One transformers run in the torch venv (its own process, one warm-up, one timed repeat)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(CONFIG, f)
    cmd = [torch_python(), str(ROOT / "benchmarks" / "_torch_runner.py"), "--config-json", f.name, "--batch", str(batch),
           "--prompt-len", str(prompt_len), "--decode-steps", str(steps), "--repeats", "1",
           "--threads", str(threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if proc.returncode:
        raise RuntimeError(f"transformers: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    facts.update(out)
    return {"prefill_tok_s": out["prefill_tok_s"], "decode_tok_s": out["decode_tok_s"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    add_record_arguments(ap)
    args = ap.parse_args(argv)
    if torch_python() is None:
        raise SystemExit("no torch venv: run scripts/make_torch_venv.sh or set K31JAX_TORCH_PYTHON")
    session = Session()
    ours, n_params = k31jax_side(args.batch, args.prompt_len, args.decode_steps)
    facts: dict = {}
    stats = alternate({"k31jax": ours,
                       "transformers": lambda: torch_round(args.batch, args.prompt_len, args.decode_steps,
                                                           session.cores, facts)}, args.repeats)
    session.finish()
    lines = [f"config: Kimi Linear shape, hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers, "
             f"{CONFIG['num_experts']} experts top-{CONFIG['num_experts_per_token']}, {n_params:,} params, float32; "
             f"batch {args.batch}, prompt {args.prompt_len}, {args.decode_steps} decode steps; median [min, max] of "
             f"{args.repeats} alternating rounds",
             f"{'':16}{'k31jax (jit)':>26}{'transformers':>26}{'ratio':>8}"]
    for key, label in (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s")):
        a, b = stats["k31jax"][key], stats["transformers"][key]
        lines.append(f"{label:16}{str(a):>26}{str(b):>26}{ratio(a, b):7.2f}x")
    if facts.get("n_params") not in (None, n_params):
        lines.append(f"note: parameter counts differ: k31jax {n_params:,} vs transformers {facts['n_params']:,}")
    lines.append(f"transformers {facts['transformers']}, torch {facts['torch']}, code path {facts['code_path']}")
    report("forward", "forward", lines, session, args)


if __name__ == "__main__":
    main()
