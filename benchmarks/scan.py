"""The layer stack as a scan vs unrolled: compile time and step time, prefill and decode
(issue #16: "scan without a step-time tax"), on one of two shapes:
- `--shape narrow-k3` (default): the 93-layer K3 schedule at tiny widths (where compile time
  and per-layer overheads show);
- `--shape wide`: the 331M Kimi-Linear-shaped config of `generate.py` (12 layers, hidden
  512: where the bytes of each layer's weights show).

    .venv/bin/python benchmarks/scan.py [--shape narrow-k3|wide] [--batch 1] [--prompt 256]
        [--decode-steps 16] [--repeats 3] [--forms scanned rows unrolled] [--record]

Three forms of the same model, the same weights and the same numbers:
- scanned:  the stacks as stored, `lax.scan` over the repeated layer groups (the default;
            what training and accelerators run);
- unrolled: the same stacks, every layer unrolled (`scan_layers=False`);
- rows:     the stacks split into per-layer arrays (`k31jax.nn.unstack_layers`), every layer
            unrolled: what the engine runs on CPU, where XLA copies each row it takes from a
            stack before a matmul reads it.
Each form compiles a prefill program (`[batch, prompt]` into an empty cache) and a decode
step (one token); compile = lower + compile, timed once. Step times: the forms alternate
(`_harness.alternate`), one warm-up each, then --repeats rounds; a round is one prefill call
and --decode-steps decode steps. Checked: the forms' logits agree.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import Session, add_record_arguments, alternate, report  # noqa: E402


def wide():
    """`generate.py`'s config: hidden 512, 12 layers, 64 experts top-4, vocab 32768, 331M."""
    from generate import CONFIG

    from k31jax import ModelConfig

    return ModelConfig.from_hf(CONFIG, dtype="float32")


def narrow_k3(dtype: str = "float32"):
    """The `tiny` widths on K3's 93-layer schedule (69 KDA + 24 MLA, AttnRes blocks of 12)."""
    from k31jax import ModelConfig

    k3 = ModelConfig.preset("k3")
    return ModelConfig.preset("tiny", dtype=dtype, num_hidden_layers=k3.num_hidden_layers,
                              layer_types=k3.layer_types, attn_res_block_size=k3.attn_res_block_size)


FORMS = ("scanned", "rows", "unrolled")


def build(cfg, batch: int, prompt: int, decode_steps: int, names=FORMS):
    """{form: (compile seconds of prefill, of decode, one-round callable, logits of one round)}."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from k31jax import K31ForCausalLM
    from k31jax.nn import unstack_layers

    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    max_len = prompt + decode_steps + 1
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, prompt)), jnp.int32)
    token = tokens[:, -1:]
    forms = {}
    for name in names:
        weights = unstack_layers(state) if name == "rows" else state
        scan = name == "scanned"
        def call(w, t, cache, scan=scan):
            out = nnx.merge(graphdef, w)(t, cache, scan_layers=scan)
            return out.logits, out.cache

        jitted = jax.jit(call, donate_argnums=2)
        cache = model.init_cache(batch, max_len)
        t0 = time.perf_counter()
        prefill = jitted.lower(weights, tokens, cache).compile()
        t1 = time.perf_counter()
        decode = jitted.lower(weights, token, cache).compile()
        t2 = time.perf_counter()
        print(f"# {name}: compiled prefill in {t1 - t0:.1f} s, decode in {t2 - t1:.1f} s", file=sys.stderr, flush=True)

        def one_round(weights=weights, prefill=prefill, decode=decode):
            cache = model.init_cache(batch, max_len)
            jax.block_until_ready(cache)
            start = time.perf_counter()
            logits, cache = prefill(weights, tokens, cache)
            jax.block_until_ready(logits)
            mid = time.perf_counter()
            for _ in range(decode_steps):
                logits, cache = decode(weights, token, cache)
            jax.block_until_ready(logits)
            end = time.perf_counter()
            return {"prefill_ms": 1e3 * (mid - start), "decode_ms": 1e3 * (end - mid) / decode_steps}, logits

        forms[name] = (t1 - t0, t2 - t1, one_round)
    return forms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("narrow-k3", "wide"), default="narrow-k3")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS),
                    help="which forms to build (the unrolled ones compile for minutes at 93 layers)")
    add_record_arguments(ap)
    args = ap.parse_args()
    import jax

    session = Session()
    cfg = narrow_k3() if args.shape == "narrow-k3" else wide()
    if "scanned" not in args.forms:
        ap.error("--forms must include scanned (the reference of every ratio)")
    forms = build(cfg, args.batch, args.prompt, args.decode_steps, args.forms)
    last = {}

    def side(name):
        def run():
            times, logits = forms[name][2]()
            last[name] = np.asarray(logits)
            return times
        return run

    stats = alternate({name: side(name) for name in forms}, args.repeats)
    session.finish()
    ref = last["scanned"]
    agree = max(float(np.max(np.abs(v - ref))) for v in last.values()) / float(np.max(np.abs(ref)))
    shape = "tiny widths on the K3 schedule" if args.shape == "narrow-k3" else "generate.py's Kimi Linear shape"
    lines = [f"config: {shape}, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
             f"({len(cfg.kda_layers)} KDA + {len(cfg.mla_layers)} MLA), {cfg.num_experts} experts top-"
             f"{cfg.num_experts_per_token}, float32, {jax.default_backend()}; prefill [{args.batch}, {args.prompt}], "
             f"decode batch {args.batch}; median [min, max] of {args.repeats} alternating rounds",
             f"{'form':>9} {'compile prefill s':>18} {'compile decode s':>17} {'prefill ms':>26} {'decode ms/step':>26}"]
    for name, (c_pre, c_dec, _) in forms.items():
        s = stats[name]
        lines.append(f"{name:>9} {c_pre:18.1f} {c_dec:17.1f} {str(s['prefill_ms']):>26} {str(s['decode_ms']):>26}")
    base = stats["scanned"]
    for name in [n for n in forms if n != "scanned"]:
        s = stats[name]
        lines.append(f"scanned / {name}: prefill step {base['prefill_ms'].median / s['prefill_ms'].median:.2f}x, "
                     f"decode step {base['decode_ms'].median / s['decode_ms'].median:.2f}x, compile "
                     f"{(forms['scanned'][0] + forms['scanned'][1]) / (forms[name][0] + forms[name][1]):.2f}x "
                     f"(time ratios: > 1 means the scan is slower)")
    lines.append(f"logits of the {len(forms)} forms agree to {agree:.1e} (relative to the largest)")
    report("scan", "scan", lines, session, args, part=None if args.shape == "narrow-k3" else "wide")


if __name__ == "__main__":
    main()
