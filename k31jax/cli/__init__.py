"""The `k31jax` command line: the top layer, importing each command's module directly.

info / plan (`_paper`), convert / export / verify (`_convert`), generate / chat (`_generate`),
train / eval / plot (`_train`), serve (`_serve`), compile for a TPU slice (`_compile`).
"""

from __future__ import annotations

import argparse
import importlib.metadata

from ..distributed import backends_started, tune_host_malloc
from . import _compile, _convert, _generate, _paper, _serve, _train
from ._common import CliParser

# Commands that run a model: their XLA:CPU buffers are reused rather than faulted in anew each
# call (`tune_host_malloc`). The converter streams tensors larger than anything it keeps.
MODEL_COMMANDS = frozenset({"generate", "chat", "serve", "train", "eval"})

REGISTRARS = (_paper.register_info, _generate.register, _generate.register_chat, _convert.register,
              _paper.register_plan, _train.register, _serve.register, _compile.register)


def build_parser(prog: str = "k31jax") -> argparse.ArgumentParser:
    parser = CliParser(prog=prog, description="Kimi K3.1 Pro in JAX: run, convert, plan.")
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {importlib.metadata.version('k31jax')}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for register in REGISTRARS:
        register(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd in MODEL_COMMANDS and not backends_started():  # a fresh process, not a test calling main()
        tune_host_malloc()
    return args.func(args)

