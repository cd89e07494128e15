"""PyTorch (HF transformers) baseline timer for Kimi Linear style models; prints ONE JSON line.

A standalone script for the torch venv, never imported by k31jax:

    ./.torchvenv/bin/python benchmarks/_torch_runner.py --preset tiny --batch 2 \
        --prompt-len 128 --decode-steps 32 --threads 8 [--generate]

(See tests/golden/make_kimi_linear_golden.py for how the venv is made. Keep flash-linear-attention,
causal-conv1d and triton out of it: this measures transformers' eager torch fallbacks on CPU.)

Model: `KimiLinearForCausalLM`, random init (transformers' own `_init_weights`), eval mode,
`torch.inference_mode()`, eager attention / eager experts by default.

Model config, in increasing priority:
  1. `--preset tiny` (the golden tiny model, the default) or `--preset kimi_linear_48b`
     (the real 48B config: only useful with --layers / --experts overrides; 48B fp32 = 190 GB);
  2. `--config-json PATH`: a HF `KimiLinearConfig`-style dict (a `config.json`); a multimodal
     wrapper with `text_config` is unwrapped. Keys transformers' KimiLinear does not implement
     (K3's AttnRes, latent MoE, lower-bounded / full-rank KDA gates, MLA output gate, SiTU) are
     reported under "ignored_keys" / "approximations": the timed model is Kimi-Linear-shaped;
  3. CLI overrides: --hidden --layers --experts --top-k --shared-experts --moe-intermediate
     --intermediate --vocab --kda-heads --kda-head-dim --mla-heads --kv-lora-rank --q-lora-rank.
     If --layers changes the depth, the schedule is rebuilt Kimi-style: MLA on every
     `--full-attn-every`-th layer (1-indexed) and on the last layer, KDA elsewhere.

Timings (median over --repeats after --warmup untimed runs, wall clock, perf_counter):
  * prefill: one forward over [batch, prompt_len] with use_cache=True (the cache is built, as
    in serving). prefill_tok_s = batch * prompt_len / t.
  * decode: after an (untimed) prefill, `decode_steps` cached one-token steps, greedy argmax of
    the previous logits. decode_tok_s = batch * decode_steps / t; decode_ms_per_step = t / steps.
  * --generate: `model.generate(do_sample=False)`; ttft = generate with max_new_tokens=1;
    --generate-only skips the two timings above (their keys are null); --generate-streamer
    times TTFT and the total in one generate(N) call (a streamer stamps the first new token);
    generate_decode_tok_s = batch * (N - 1) / (t(N) - ttft) with N = decode_steps + 1
    (min_new_tokens = N, so EOS never stops it early).

Output: one JSON object on stdout (everything else goes to stderr). Keys:
  "runner", "torch", "transformers", "threads", "dtype", "batch", "prompt_len", "decode_steps",
  "repeats", "warmup", "config" (the effective model knobs), "n_params", "n_params_active_approx",
  "layer_types", "code_path", "ignored_keys", "approximations",
  "prefill_s", "prefill_tok_s", "prefill_times_s",
  "decode_s", "decode_tok_s", "decode_ms_per_step", "decode_times_s",
  ["generate_ttft_s", "generate_total_s", "generate_decode_tok_s", "generate_times_s"],
  "build_s", "peak_rss_mb".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

TINY = {
    "model_type": "kimi_linear",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "moe_router_activation_func": "sigmoid",
    "num_expert_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "linear_attn_config": {
        "full_attn_layers": [4, 7],
        "kda_layers": [1, 2, 3, 5, 6],
        "num_heads": 4,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# moonshotai/Kimi-Linear-48B-A3B-Instruct (architecture.md §11).
KIMI_LINEAR_48B = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "moe_router_activation_func": "sigmoid",
    "num_expert_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
}
PRESETS = {"tiny": TINY, "kimi_linear_48b": KIMI_LINEAR_48B}

# Keys of K3-style configs that transformers' KimiLinear does not implement.
UNSUPPORTED_KEYS = (
    "attn_res_block_size",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "mla_use_output_gate",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "index_topk",
    "index_n_heads",
    "index_head_dim",
)
UNSUPPORTED_LINEAR_KEYS = ("gate_lower_bound", "use_full_rank_gate")

# HF alias -> canonical key used here (KimiLinearConfig.attribute_map, reversed where it matters).
ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def kimi_schedule(n_layers: int, every: int) -> tuple[list[int], list[int]]:
    full = sorted({i for i in range(every, n_layers + 1, every)} | {n_layers})
    kda = [i for i in range(1, n_layers + 1) if i not in full]
    return full, kda


def build_config_dict(args) -> tuple[dict, list[str], list[str]]:
    cfg = json.loads(json.dumps(PRESETS[args.preset]))
    ignored, approx = [], []
    if args.config_json:
        with open(args.config_json) as f:
            user = json.load(f)
        if "text_config" in user:
            user = user["text_config"]
        user = {ALIASES.get(k, k): v for k, v in user.items()}
        # a re-saved HF config carries derived keys; the 1-indexed lists win if both are there
        lac = dict(user.get("linear_attn_config") or {})
        if "linear_num_heads" in user:
            lac.setdefault("num_heads", user["linear_num_heads"])
        if "linear_head_dim" in user:
            lac.setdefault("head_dim", user["linear_head_dim"])
        if "linear_conv_kernel_dim" in user:
            lac.setdefault("short_conv_kernel_size", user["linear_conv_kernel_dim"])
        if "full_attn_layers" not in lac and user.get("layer_types"):
            lt = user["layer_types"]
            lac["full_attn_layers"] = [i + 1 for i, t in enumerate(lt) if t != "linear_attention"]
            lac["kda_layers"] = [i + 1 for i, t in enumerate(lt) if t == "linear_attention"]
        for k in UNSUPPORTED_LINEAR_KEYS:
            if lac.get(k) not in (None, False):
                ignored.append(f"linear_attn_config.{k}={lac[k]!r}")
            lac.pop(k, None)
        for k in UNSUPPORTED_KEYS:
            if user.get(k) not in (None, False):
                ignored.append(f"{k}={user[k]!r}")
        drop = set(UNSUPPORTED_KEYS) | {
            "layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
            "quantization_config", "architectures", "auto_map", "head_dim", "qk_head_dim", "dtype", "torch_dtype",
            "transformers_version",
        }
        for k, v in user.items():
            if k not in drop:
                cfg[k] = v
        cfg["linear_attn_config"] = {**cfg.get("linear_attn_config", {}), **lac}
    ov = {
        "hidden_size": args.hidden,
        "vocab_size": args.vocab,
        "num_experts": args.experts,
        "num_experts_per_token": args.top_k,
        "num_shared_experts": args.shared_experts,
        "moe_intermediate_size": args.moe_intermediate,
        "intermediate_size": args.intermediate,
        "num_attention_heads": args.mla_heads,
        "kv_lora_rank": args.kv_lora_rank,
    }
    for k, v in ov.items():
        if v is not None:
            cfg[k] = v
    if args.mla_heads is not None:
        cfg["num_key_value_heads"] = args.mla_heads
    if args.q_lora_rank is not None:
        cfg["q_lora_rank"] = None if args.q_lora_rank <= 0 else args.q_lora_rank
    lac = cfg["linear_attn_config"]
    if args.kda_heads is not None:
        lac["num_heads"] = args.kda_heads
    if args.kda_head_dim is not None:
        lac["head_dim"] = args.kda_head_dim
    if args.layers is not None and args.layers != cfg["num_hidden_layers"] or args.full_attn_every is not None:
        n = args.layers if args.layers is not None else cfg["num_hidden_layers"]
        cfg["num_hidden_layers"] = n
        lac["full_attn_layers"], lac["kda_layers"] = kimi_schedule(n, args.full_attn_every or 4)
    if cfg.get("hidden_act") not in ("silu", "gelu", "relu", "swish"):
        approx.append(f"hidden_act {cfg.get('hidden_act')!r} -> 'silu'")
        cfg["hidden_act"] = "silu"
    v = cfg["vocab_size"]
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(cfg.get(k), int) and cfg[k] >= v:
            approx.append(f"{k} {cfg[k]} >= vocab {v} -> {min(v - 1, {'bos_token_id': 1, 'eos_token_id': 2, 'pad_token_id': 0}[k])}")
            cfg[k] = min(v - 1, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}[k])
    return cfg, ignored, approx


def timed(fn, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        out.append(fn())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--config-json", default=None, help="HF KimiLinearConfig-style config.json")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--full-attn-every", type=int, default=None, help="rebuild the schedule: MLA every N layers + last")
    ap.add_argument("--experts", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--shared-experts", type=int)
    ap.add_argument("--moe-intermediate", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--kda-heads", type=int)
    ap.add_argument("--kda-head-dim", type=int)
    ap.add_argument("--mla-heads", type=int)
    ap.add_argument("--kv-lora-rank", type=int)
    ap.add_argument("--q-lora-rank", type=int, help="<= 0 means plain q_proj")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--generate", action="store_true", help="also time model.generate() (TTFT + decode)")
    ap.add_argument("--generate-streamer", action="store_true",
                    help="with --generate: one generate(N) per repeat, TTFT from a timestamping streamer")
    ap.add_argument("--generate-only", action="store_true",
                    help="with --generate: skip the plain prefill/decode timings (prefill_* / decode_* are null)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--attn-implementation", default="eager", help="eager | sdpa")
    ap.add_argument("--experts-implementation", default="eager", help="eager | grouped_mm | batched_mm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dump-config", action="store_true", help="print the effective config dict to stderr")
    args = ap.parse_args(argv)

    if args.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    import transformers
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)

    cfg_dict, ignored, approx = build_config_dict(args)
    if args.dump_config:
        log(json.dumps(cfg_dict, indent=1))
    t0 = time.perf_counter()
    cfg = KimiLinearConfig(**{k: v for k, v in cfg_dict.items() if k != "model_type"})
    model = KimiLinearForCausalLM._from_config(
        cfg, attn_implementation=args.attn_implementation, experts_implementation=args.experts_implementation,
        dtype=dtype,
    )
    model.eval()
    build_s = time.perf_counter() - t0

    n_params = sum(p.numel() for p in model.parameters())
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_active = n_params - expert_params + (expert_params * k // e if e else 0)

    B, P, S = args.batch, args.prompt_len, args.decode_steps
    g = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(3, cfg.vocab_size, (B, P), generator=g)

    def prefill():
        t = time.perf_counter()
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        dt = time.perf_counter() - t
        return dt, out

    def run_prefill():
        return prefill()[0]

    def run_decode():
        _, out = prefill()
        cache = out.cache
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        t = time.perf_counter()
        for _ in range(S):
            out = model(input_ids=tok, cache=cache, use_cache=True)
            cache = out.cache
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - t

    res = {}
    with torch.inference_mode():
        skip = args.generate and args.generate_only
        pre_times = [] if skip else timed(run_prefill, args.repeats, args.warmup)
        dec_times = timed(run_decode, args.repeats, args.warmup) if S > 0 and not skip else []
        if args.generate:
            attn = torch.ones_like(prompt)

            def gen(n):
                t = time.perf_counter()
                model.generate(
                    input_ids=prompt, attention_mask=attn, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                    pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_id,
                )
                return time.perf_counter() - t

            class Stamps:  # a generate() streamer that only records when each step's ids arrive
                def __init__(self):
                    self.t = []

                def put(self, value):
                    self.t.append(time.perf_counter())

                def end(self):
                    pass

            def gen_stamped():
                st = Stamps()
                t = time.perf_counter()
                model.generate(
                    input_ids=prompt, attention_mask=attn, do_sample=False, max_new_tokens=S + 1,
                    min_new_tokens=S + 1, pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_id,
                    streamer=st,
                )
                return st.t[1] - t, time.perf_counter() - t  # t[0]: the prompt, t[1]: first new token

            if args.generate_streamer:
                runs = [gen_stamped() for _ in range(args.warmup + args.repeats)][args.warmup:]
                ttft, total = [r[0] for r in runs], [r[1] for r in runs]
            else:
                ttft = timed(lambda: gen(1), args.repeats, args.warmup)
                total = timed(lambda: gen(S + 1), args.repeats, args.warmup)
            t_ttft, t_total = statistics.median(ttft), statistics.median(total)
            res.update(
                generate_ttft_s=t_ttft,
                generate_total_s=t_total,
                generate_decode_tok_s=(B * S / (t_total - t_ttft)) if S > 0 and t_total > t_ttft else None,
                generate_times_s={"ttft": ttft, "total": total},
            )

    t_pre = statistics.median(pre_times) if pre_times else None
    t_dec = statistics.median(dec_times) if dec_times else None
    lac = cfg_dict["linear_attn_config"]
    out = {
        "runner": "torch_hf_kimi_linear",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "device": "cpu",
        "batch": B,
        "prompt_len": P,
        "decode_steps": S,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "config": {
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "vocab_size": cfg.vocab_size,
            "full_attn_layers_1idx": lac.get("full_attn_layers"),
            "kda_heads": cfg.linear_num_heads,
            "kda_head_dim": cfg.linear_head_dim,
            "mla_heads": cfg.num_attention_heads,
            "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank,
            "num_experts": e,
            "top_k": k,
            "num_shared_experts": cfg.n_shared_experts,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "intermediate_size": cfg.intermediate_size,
            "source": args.config_json or f"preset:{args.preset}",
        },
        "layer_types": ["mla" if t == "full_attention" else "kda" for t in cfg.layer_types],
        "n_params": n_params,
        "n_params_active_approx": n_active,
        "code_path": {
            "fla_installed": importlib.util.find_spec("fla") is not None,
            "causal_conv1d_installed": importlib.util.find_spec("causal_conv1d") is not None,
            "attn_implementation": model.config._attn_implementation,
            "experts_implementation": model.config._experts_implementation,
        },
        "ignored_keys": ignored,
        "approximations": approx,
        "prefill_s": t_pre,
        "prefill_tok_s": B * P / t_pre if t_pre else None,
        "prefill_times_s": pre_times,
        "decode_s": t_dec,
        "decode_tok_s": (B * S / t_dec) if t_dec else None,
        "decode_ms_per_step": (1e3 * t_dec / S) if t_dec else None,
        "decode_times_s": dec_times,
        **res,
        "build_s": build_s,
        "peak_rss_mb": next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 2**20,
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
