"""`k31jax convert` and `k31jax export` subcommands (registered into `k31jax.cli`)."""

from __future__ import annotations

import sys


def _quiet_logs() -> None:
    """Orbax and absl log every save at INFO/WARNING; the progress bar says enough."""
    import logging

    for name in ("absl", "orbax", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass


def _cmd_convert(args) -> int:
    from k31jax.ckpt import CheckpointError, SafetensorsError
    from k31jax.config import ConfigError

    from ._convert import convert

    _quiet_logs()
    if not args.dry_run and args.dst is None:
        print("k31jax convert: DST is required (or pass --dry-run)", file=sys.stderr)
        return 2
    try:
        convert(args.src, args.dst, dtype=args.dtype, expert_weights=args.expert_weights,
                no_indexer=args.no_indexer, init_missing_indexer=args.init_missing_indexer,
                vision=not args.no_vision, dry_run=args.dry_run, verify=args.verify, overwrite=args.overwrite,
                progress=False if args.no_progress else True,
                max_call_bytes=int(args.max_call_gb * (1 << 30)))
    except (CheckpointError, SafetensorsError, ConfigError) as e:
        print(f"k31jax convert: error: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_export(args) -> int:
    from k31jax.ckpt import CheckpointError, SafetensorsError
    from k31jax.config import ConfigError

    from ._export import export

    _quiet_logs()
    try:
        export(args.ckpt, args.out, overwrite=args.overwrite, progress=False if args.no_progress else True)
    except (CheckpointError, SafetensorsError, ConfigError) as e:
        print(f"k31jax export: error: {e}", file=sys.stderr)
        return 1
    return 0


def register(sub) -> None:
    c = sub.add_parser(
        "convert", help="release safetensors folder -> k31jax Orbax checkpoint (streamed, verified)",
        description="Convert a release-layout folder (config.json, model.safetensors.index.json + shards, or "
                    "model.safetensors) into an Orbax checkpoint, layer by layer with bounded memory. Routed "
                    "MXFP4 experts are copied verbatim into stacked [E, out, in/2] + [E, out, in/32] uint8 leaves.")
    c.add_argument("src", help="release folder")
    c.add_argument("dst", nargs="?", help="output checkpoint folder (written atomically)")
    c.add_argument("--dry-run", action="store_true", help="read headers only: print the target tree and check that "
                   "every source tensor is used exactly once and every parameter is filled")
    c.add_argument("--verify", action="store_true", help="re-read the written checkpoint and compare it bytewise "
                   "with the source before publishing it")
    c.add_argument("--dtype", default=None, help="stored dtype of the non-expert weights (default: as stored in the "
                   "release, bf16; the f32 tensors stay f32)")
    c.add_argument("--expert-weights", choices=("mxfp4", "bf16"), default=None,
                   help="routed experts: mxfp4 = packed bytes (default for an MXFP4 release), bf16 = decoded while "
                        "streaming (for runs without MXFP4 kernels)")
    c.add_argument("--no-indexer", action="store_true", help="K3.1: drop / do not expect lightning-indexer tensors "
                   "and load the MLA layers as dense gated MLA")
    c.add_argument("--init-missing-indexer", action="store_true", help="K3.1 config without indexer weights: "
                   "initialise a fresh indexer (train it before using index_topk < context)")
    c.add_argument("--no-vision", action="store_true", help="drop vision_tower.* / mm_projector.*")
    c.add_argument("--overwrite", action="store_true", help="replace an existing DST (after the new one is complete)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--max-call-gb", type=float, default=0.25, help="GiB per Orbax write call (bounds memory: "
                   "whole layers packed together, a larger layer split between its leaves)")
    c.set_defaults(func=_cmd_convert)

    e = sub.add_parser("export", help="k31jax Orbax checkpoint -> release safetensors layout (byte-exact)",
                       description="Write a converted checkpoint back in the release layout; with the layout "
                                   "recorded at conversion every tensor is reproduced bytewise.")
    e.add_argument("ckpt", help="converted checkpoint folder (DST of `k31jax convert`)")
    e.add_argument("out", help="output release folder (written atomically)")
    e.add_argument("--overwrite", action="store_true")
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(func=_cmd_export)
