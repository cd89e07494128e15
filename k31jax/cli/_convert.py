"""`k31jax convert` and `k31jax export` (also `python convert/convert.py`, `python convert/export.py`).

Exit codes: 0 done, 1 runtime error (bad input, DST refused or locked, disk full, I/O
error), 2 usage (bad flags, no DST, DST overlapping SRC), 130 SIGINT, 143 SIGTERM. Every
failure is one `k31jax <cmd>: error: ...` line on stderr (the traceback too with --debug).
SIGINT / SIGTERM stop the run at its next safe point (after the write call in flight): the
temporary folder is removed and DST is untouched.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import traceback

from ..ckpt import CheckpointError, SafetensorsError
from ..config import ConfigError
from ..conversion import Interrupted, SourceOverlapError, convert, export

EXIT_ERROR, EXIT_USAGE = 1, 2


@contextlib.contextmanager
def _quiet_logs(debug: bool):
    """Orbax and absl log every save at INFO/WARNING, and a failed save's errors again from each
    of its threads and tasks; the progress bar and the one error line say enough (all of it
    with --debug). The previous levels are restored afterwards."""
    level = logging.WARNING if debug else logging.CRITICAL
    loggers = [logging.getLogger(name) for name in ("absl", "orbax", "asyncio", "jax._src.xla_bridge")]
    previous = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:  # absl comes with orbax, which is imported only when a conversion runs
        from absl import logging as absl_logging
    except ImportError:
        absl_logging = None
    if absl_logging is not None:
        verbosity = absl_logging.get_verbosity()
        absl_logging.set_verbosity(absl_logging.WARNING if debug else absl_logging.FATAL)
    try:
        yield
    finally:
        for lg, old in zip(loggers, previous):
            lg.setLevel(old)
        if absl_logging is not None:
            absl_logging.set_verbosity(verbosity)


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event):
    """SIGINT / SIGTERM set `stop` (the run stops at its next safe point) instead of raising
    wherever the main thread happens to be; yields the list of signals received. Only the main
    thread can install handlers: elsewhere the defaults stay."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _run(command: str, args, work) -> int:
    """Run `work(stop)` and turn every way it can end into an exit code and at most one line."""
    stop = threading.Event()

    def fail(message: str, code: int) -> int:
        if args.debug:
            traceback.print_exc()
        print(f"{command}: error: {message}", file=sys.stderr)
        return code

    with _quiet_logs(args.debug), _stop_on_signals(stop) as received:
        try:
            work(stop)
        except Interrupted as e:
            signum = received[0] if received else signal.SIGINT
            return fail(f"interrupted by {signal.Signals(signum).name}: {e}", 128 + signum)
        except SourceOverlapError as e:
            return fail(str(e), EXIT_USAGE)
        except (CheckpointError, SafetensorsError, ConfigError) as e:
            return fail(str(e), EXIT_ERROR)
        except OSError as e:
            return fail(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}", EXIT_ERROR)
        except Exception as e:  # noqa: BLE001 - a bug or an unexpected library error: still one line
            text = " ".join(str(e).split())
            return fail(f"{type(e).__name__}: {text} (rerun with --debug for the traceback)", EXIT_ERROR)
    return 0


def _cmd_convert(args) -> int:
    if not args.dry_run and args.dst is None:
        print("k31jax convert: error: DST is required (or pass --dry-run)", file=sys.stderr)
        return EXIT_USAGE
    return _run("k31jax convert", args, lambda stop: convert(
        args.src, args.dst, dtype=args.dtype, expert_weights=args.expert_weights, no_indexer=args.no_indexer,
        init_missing_indexer=args.init_missing_indexer, vision=not args.no_vision, dry_run=args.dry_run,
        verify=args.verify, overwrite=args.overwrite, progress=False if args.no_progress else True,
        max_call_bytes=int(args.max_call_gb * (1 << 30)), stop=stop))


def _cmd_export(args) -> int:
    return _run("k31jax export", args, lambda stop: export(
        args.ckpt, args.out, overwrite=args.overwrite, progress=False if args.no_progress else True, stop=stop))


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
    c.add_argument("--overwrite", action="store_true", help="replace an existing DST that is a k31jax checkpoint or "
                   "an empty folder (after the new one is complete); anything else is never replaced")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--max-call-gb", type=float, default=0.25, help="GiB per Orbax write call (bounds memory: "
                   "whole layers packed together, a larger layer split between its leaves)")
    c.add_argument("--debug", action="store_true", help="print the traceback of an error, and Orbax's logs")
    c.set_defaults(func=_cmd_convert)

    e = sub.add_parser("export", help="k31jax Orbax checkpoint -> release safetensors layout (byte-exact)",
                       description="Write a converted checkpoint back in the release layout; with the layout "
                                   "recorded at conversion every tensor is reproduced bytewise.")
    e.add_argument("ckpt", help="converted checkpoint folder (DST of `k31jax convert`)")
    e.add_argument("out", help="output release folder (written atomically)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing OUT that k31jax export wrote, or an "
                   "empty folder (after the new one is complete); anything else is never replaced")
    e.add_argument("--no-progress", action="store_true")
    e.add_argument("--debug", action="store_true", help="print the traceback of an error, and Orbax's logs")
    e.set_defaults(func=_cmd_export)
