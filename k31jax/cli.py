"""The `k31jax` command line. Each subcommand lives next to its code and registers itself:
`info` here, `generate` and `chat` in `k31jax.generate`, `convert` / `export` in `convert/`."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# (module, attribute) of each subcommand registrar; modules are imported only to register.
REGISTRARS = [
    ("k31jax.cli", "register_info"),
    ("k31jax.generate._cli", "register"),
    ("convert._cli", "register"),
    ("k31jax.generate._cli", "register_chat"),
    ("k31jax.sharding._plan", "register"),
]


def _cmd_info(args) -> int:
    from . import ModelConfig, count_params

    cfg = ModelConfig.from_hf(args.config) if Path(args.config).exists() else ModelConfig.preset(args.config)
    counts = count_params(cfg)
    print(f"{args.config}: {cfg.num_hidden_layers} layers ({len(cfg.kda_layers)} KDA, "
          f"{len(cfg.mla_layers)} MLA{' + lightning indexer' if cfg.use_indexer else ''}), "
          f"{cfg.num_experts} experts top-{cfg.num_experts_per_token}, hidden {cfg.hidden_size}")
    print(counts.table())
    return 0


def register_info(sub) -> None:
    info = sub.add_parser("info", help="parameter counts and bytes of a config, on paper")
    info.add_argument("--config", default="k31_pro", help="preset name or path to a config.json")
    info.set_defaults(func=_cmd_info)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="k31jax", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for module, attr in REGISTRARS:
        getattr(importlib.import_module(module), attr)(sub)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
