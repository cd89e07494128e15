"""`k31jax serve`: the OpenAI- / Anthropic-compatible server (`k31jax.serve`) on uvicorn.

Loads the model (a checkpoint, or the embedded default model), builds the continuous-batching
scheduler and listens at once, on 127.0.0.1 unless ``--host`` says otherwise, while its
programs compile on background threads (``Scheduler.start_warmup``, the ones the first request
needs first; ``/health`` answers 503 with what is left until they are done, and requests that
arrive meanwhile wait for the programs they need). Compiled programs go to JAX's persistent
compilation cache (``enable_compile_cache``: ``~/.cache/k31jax/xla``, ``K31JAX_COMPILE_CACHE``),
so the next start loads them. One line `k31jax serve: listening on http://HOST:PORT` goes to
stderr, then one per request (the access log) unless ``--quiet``. SIGINT / SIGTERM stop it
cleanly (exit code 130 / 143).

With ``--mesh`` (one host) the model and every jitted program run sharded on that mesh. Across
several processes or hosts (``--coordinator/--num-processes/--process-id`` and a ``--mesh`` over
all their devices), every process runs this same command: process 0 serves HTTP and broadcasts
each scheduler turn's plan, the others follow it (``k31jax.generate.ProcessSync``), so every
process steps the same batch; they compile everything before serving, so that all of them
plan their prefill calls alike.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from ..config import preset_names
from ..generate import DEFAULT_MODEL, Engine, ProcessSync, Scheduler
from ..train import load_generation_model
from ._common import (UsageError, add_distributed_arguments, add_speculation_arguments, check_int, check_mesh_args,
                      cli_context, enable_compile_cache, install, speculation_from)

# A chat completion without max_tokens stops here (`ServeSettings.default_max_tokens`, the same
# number: not imported, the server stack loads in `_run` only).
DEFAULT_MAX_TOKENS = 1024


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server (continuous batching)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ckpt", help="checkpoint folder: Orbax (from `k31jax convert`), safetensors, or a "
                                    "training run's --out (its final export, else its newest checkpoint)")
    src.add_argument("--config", default=None,
                     help=f"preset with seeded random weights instead of the embedded default model ({DEFAULT_MODEL})")
    p.add_argument("--tokenizer", default=None, help="folder with tiktoken.model (default: the checkpoint's)")
    p.add_argument("--dtype", default=None, help="parameter/activation dtype")
    p.add_argument("--lora", default=None, metavar="DIR",
                   help="a LoRA adapter folder (a LoRA run's final/adapter) applied to the model: merged into its "
                        "float weights, beside its packed routed experts")
    p.add_argument("--mxfp8-activations", action="store_true", help="round the routed experts' GEMM inputs to MXFP8 (E4M3, one scale per 32; K3.1's deployment: MXFP4 "
                        "weights, MXFP8 activations), as QAT's fake-quant does")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (no --ckpt)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer / x-api-key)")
    p.add_argument("--model-name", default=None, help="model id clients send (default: k31jax-<config> "
                   "or the checkpoint folder name)")
    p.add_argument("--max-batch", type=int, default=8, help="decode slots (concurrent requests)")
    p.add_argument("--max-len", type=int, default=4096,
                   help="context length: prompt + output tokens (default: 4096)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prefill call width")
    p.add_argument("--prefix-cache-mb", type=int, default=1024, help="session snapshot memory (0 = off)")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens a chat completion without max_tokens generates at most (default: "
                        f"{DEFAULT_MAX_TOKENS}, capped by the context; shown in /v1/models)")
    p.add_argument("--no-grammar", action="store_true",
                   help="no constrained decoding: tool calls and JSON formats as the model writes them "
                        "(default: held to the tools' strict schemas, response_format and the K3 output structure)")
    add_speculation_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no access log (one stderr line per request)")
    p.add_argument("--vision", action="store_true",
                   help="accept images with a seeded RANDOM vision tower when the model has no trained one "
                        "(the embedded default model, presets); a checkpoint's own tower loads without this")
    p.add_argument("--image-dir", default=None,
                   help="read image parts that name local files only below this folder (default: no local files)")
    add_distributed_arguments(p)
    install(p, "serve", _run, validate=_check)


def _check(args) -> None:
    check_int("--port", args.port, low=0, high=65535)
    check_int("--max-batch", args.max_batch, low=1)
    check_int("--prefill-chunk", args.prefill_chunk, low=1)
    check_int("--max-len", args.max_len, low=2)  # a one-token prompt and its one new token
    check_int("--max-queue", args.max_queue, low=1)
    check_int("--prefix-cache-mb", args.prefix_cache_mb, low=0)
    check_int("--default-max-tokens", args.default_max_tokens, low=1)
    if not args.max_body_mb > 0:
        raise UsageError(f"--max-body-mb {args.max_body_mb}: expected a number > 0")
    if args.ckpt is not None and not Path(args.ckpt).is_dir():
        raise UsageError(f"--ckpt {args.ckpt}: no such checkpoint folder")
    if args.config is not None and args.config not in preset_names():
        raise UsageError(f"--config {args.config!r}: not a preset (presets: {', '.join(preset_names())})")
    if args.image_dir is not None and not Path(args.image_dir).is_dir():
        raise UsageError(f"--image-dir {args.image_dir}: no such folder")
    check_mesh_args(args)
    if (args.num_processes or 1) > 1 and not args.mesh:
        raise UsageError(f"--num-processes {args.num_processes}: multi-process serving needs --mesh over every "
                         "process's devices (each process steps the same sharded batch)")


def _warmup_done(warm) -> None:
    if warm.error is not None:
        print(f"[k31jax] warm-up failed ({type(warm.error).__name__}: {warm.error}); requests compile what they "
              "need", file=sys.stderr, flush=True)
    elif warm.ready:
        print(f"[k31jax] warm-up done: {len(warm.done)} programs compiled or loaded from the compile cache in "
              f"{warm.seconds:.1f} s", file=sys.stderr, flush=True)


def _log_access_to_stderr() -> None:
    from ..serve import ACCESS_LOG

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("k31jax serve: %(message)s"))
    ACCESS_LOG.addHandler(handler)
    ACCESS_LOG.setLevel(logging.INFO)
    ACCESS_LOG.propagate = False


def _run(args) -> int:
    import jax
    import uvicorn  # imported here: the other commands never need the server stack

    from ..serve import ServeSettings, create_app

    enable_compile_cache()
    with cli_context(args) as ctx:
        sync = ProcessSync() if jax.process_count() > 1 else None
        if sync is not None and ctx.mesh is None:
            raise UsageError(f"{jax.process_count()} processes: multi-process serving needs --mesh over every "
                             "process's devices")
        loaded = load_generation_model(args.ckpt, config=args.config, seed=args.seed, dtype=args.dtype,
                                       tokenizer=args.tokenizer, vision=True if args.vision else None,
                                       expert_activations="mxfp8" if args.mxfp8_activations else None, lora=args.lora)
        if loaded.banner:
            print(f"[k31jax] {loaded.banner}", file=sys.stderr)
        if loaded.vision_banner:
            print(f"[k31jax] {loaded.vision_banner}", file=sys.stderr)
        engine = Engine(ctx.place(loaded.model), loaded.tokenizer, max_len=args.max_len,
                        prefill_chunk=args.prefill_chunk, vision=loaded.vision, speculation=speculation_from(args))
        loaded.model = None  # the engine holds the weights (on CPU split into per-layer rows): free the stacks
        scheduler = Scheduler(engine, max_batch=args.max_batch, max_queue=args.max_queue,
                              prefill_chunk=args.prefill_chunk,
                              prefix_cache_bytes=args.prefix_cache_mb << 20, sync=sync)
        # Two compile threads: XLA compiles one program on one core, and the two largest (the
        # full-width prefill and decode) are what the first request waits for.
        workers = min(2, os.cpu_count() or 1)
        if sync is not None:
            seconds = scheduler.warmup(workers)
            print(f"[k31jax] compiled the serving programs in {seconds:.1f} s", file=sys.stderr)
            if not sync.leader:
                print(f"k31jax serve: process {jax.process_index()} of {sync.processes} follows process 0",
                      file=sys.stderr, flush=True)
                scheduler.follow()
                return 0
        else:
            scheduler.start_warmup(workers, on_done=_warmup_done)
        name = args.model_name or (f"k31jax-{Path(args.ckpt).name}" if args.ckpt else f"k31jax-{args.config or DEFAULT_MODEL}")
        app = create_app(scheduler, ServeSettings(model_name=name, api_key=args.api_key,
                                                  max_body_bytes=int(args.max_body_mb * (1 << 20)),
                                                  image_dir=args.image_dir,
                                                  default_max_tokens=args.default_max_tokens,
                                                  access_log=not args.quiet, grammar=not args.no_grammar))
        if not args.quiet:
            _log_access_to_stderr()
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        scheduler.start()
        print(f"[k31jax] context {args.max_len} tokens; a chat completion without max_tokens generates at most "
              f"{args.default_max_tokens} (--default-max-tokens)", file=sys.stderr)
        warming = "" if sync is not None else "; warming up: requests wait for their programs, /health says when done"
        print(f"k31jax serve: listening on http://{args.host}:{args.port} (model '{name}'{warming})",
              file=sys.stderr, flush=True)
        # uvicorn shuts down gracefully on SIGINT / SIGTERM, then restores the handlers it found
        # and raises the signal again: these note it instead of killing the process, so the
        # scheduler stops (multi-host: it tells the other processes) and the process exits
        # normally, with 128 + the signal's number.
        caught: list[int] = []
        previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run()
        finally:
            scheduler.stop()
            for sig, handler in previous.items():
                if handler is not None:  # None: a handler installed outside Python
                    signal.signal(sig, handler)
    return 128 + caught[0] if caught else 0
