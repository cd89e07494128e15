"""`k31jax generate`: text generation from a checkpoint or the embedded default model."""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_MODEL = "tiny"


def _load(args):
    import jax.numpy as jnp
    from flax import nnx

    from .. import K31ForCausalLM, ModelConfig, load_hf_weights
    from ..chat import ByteTokenizer, KimiTokenizer

    if args.ckpt:
        ckpt = Path(args.ckpt)
        model = load_hf_weights(ckpt, dtype=args.dtype)
        tok = (KimiTokenizer.from_dir(ckpt) if (ckpt / "tiktoken.model").exists()
               else ByteTokenizer(model.config.vocab_size))
        return model, tok
    cfg = ModelConfig.preset(args.config)
    if args.dtype:
        cfg = cfg.replace(dtype=str(jnp.dtype(args.dtype)))
    print(f"[k31jax] no --ckpt: using the embedded default model '{args.config}' with SEEDED RANDOM "
          f"weights (seed {args.seed}); its text is meaningless until trained weights ship.",
          file=sys.stderr)
    return K31ForCausalLM(cfg, rngs=nnx.Rngs(args.seed)), ByteTokenizer(cfg.vocab_size)


def _cmd_generate(args) -> int:
    from . import Engine, SamplingParams

    model, tok = _load(args)
    prompt = tok.encode(args.prompt)
    if tok.bos_id is not None:
        prompt = [tok.bos_id] + prompt
    engine = Engine(model, max_len=args.max_len)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    stops = frozenset(tok.stop_ids)
    if args.stream:
        dec = tok.stream_decoder()
        for step in engine.stream([prompt], args.max_new_tokens, params, stops):
            t = int(step[0])
            if t in stops:
                break
            print(dec.step(t), end="", flush=True)
        print(dec.flush())
        return 0
    result = engine.generate([prompt], args.max_new_tokens, params, stops)
    out = [t for t in result.tokens[0] if t not in stops]
    print(tok.decode(out))
    print(f"[k31jax] prompt {result.prompt_tokens} tok, prefill {result.prefill_tok_s:,.1f} tok/s "
          f"(incl. compile), decode {result.decode_tok_s:,.1f} tok/s over {result.decode_steps} steps",
          file=sys.stderr)
    return 0


def register(sub) -> None:
    gen = sub.add_parser("generate", help="generate text")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--ckpt", help="checkpoint folder (config.json + safetensors)")
    src.add_argument("--config", default=DEFAULT_MODEL, help="preset for random weights (default: tiny)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-len", type=int, default=1024, help="cache length")
    gen.add_argument("--dtype", default=None, help="override parameter/activation dtype")
    gen.add_argument("--stream", action="store_true")
    gen.set_defaults(func=_cmd_generate)
