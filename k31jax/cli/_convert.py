"""`k31jax convert`, `k31jax export` and `k31jax verify` (also `python convert/convert.py`,
`python convert/export.py`).

Exit codes: 0 done, 1 runtime error (bad input, damaged checkpoint, DST refused or locked,
disk full, I/O error, `--strict` and a NaN / Inf), 2 usage (bad flags, no DST, DST
overlapping SRC), 130 SIGINT, 143 SIGTERM. Every failure is one `k31jax <cmd>: error: ...`
line on stderr (the traceback too with --debug). SIGINT / SIGTERM stop the run at its next
safe point (after the write call in flight): the temporary folder is removed and DST is
untouched.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading

from ..ckpt import STORE_DTYPES, convert, export, verify_checkpoint
from ._common import UsageError, check_float, install, report


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


def _stoppable(command: str, work):
    """`work(args, stop)` as a command: quiet logs, SIGINT / SIGTERM as a stop request, and
    the signal's exit code (128 + N) when it stopped the run."""
    def run(args) -> int:
        stop = threading.Event()
        with _quiet_logs(args.debug), _stop_on_signals(stop) as received:
            try:
                return work(args, stop)
            except Exception as e:  # noqa: BLE001 - every failure: one line, its exit code
                return report(command, e, args.debug, received[0] if received else None)
    return run


def _check_convert_args(args) -> None:
    if not args.dry_run and args.dst is None:
        raise UsageError("DST is required (or pass --dry-run)")
    check_float("--max-call-gb", args.max_call_gb, low=0, low_open=True, high=1 << 20)


def _convert(args, stop) -> int:
    result = convert(args.src, args.dst, dtype=args.dtype, expert_weights=args.expert_weights,
                     no_indexer=args.no_indexer, init_missing_indexer=args.init_missing_indexer,
                     vision=not args.no_vision, dry_run=args.dry_run, verify=args.verify, strict=args.strict,
                     overwrite=args.overwrite, progress=False if args.no_progress else True,
                     max_call_bytes=max(1, int(args.max_call_gb * (1 << 30))), stop=stop)
    if args.dry_run:
        return 0
    bad = result.nonfinite
    if bad:
        for f in bad:
            print(f"k31jax convert: warning: non-finite values in {f.describe()}", file=sys.stderr)
    count = sum(f.count for f in bad)
    found = f"{count:,} in {len(bad)} tensors (listed on stderr)" if bad else "none"
    print(f"converted {result.src} -> {result.dst}: {result.tensors:,} tensors, {result.manifest_files:,} files "
          f"with checksums; non-finite values: {found}{'; verified against the source' if result.verified else ''}")
    return 0


def _export(args, stop) -> int:
    export(args.ckpt, args.out, overwrite=args.overwrite, progress=False if args.no_progress else True, stop=stop)
    return 0


def _verify(args, stop) -> int:
    result = verify_checkpoint(args.ckpt, args.source, progress=False if args.no_progress else True, stop=stop)
    print(result.line())
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
    c.add_argument("--verify", action="store_true", help="re-read the written checkpoint and compare its values "
                   "with the source before publishing it (fails if --dtype changed any value)")
    c.add_argument("--strict", action="store_true", help="fail on any NaN / Inf in the converted values (without "
                   "it they are counted and listed)")
    c.add_argument("--dtype", default=None, choices=STORE_DTYPES, help="stored dtype of the non-expert weights "
                   "(default: as stored in the release, bf16; the f32 tensors stay f32)")
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
    install(c, "convert", _stoppable("k31jax convert", _convert), validate=_check_convert_args)

    e = sub.add_parser("export", help="k31jax Orbax checkpoint -> release safetensors layout (byte-exact)",
                       description="Write a converted checkpoint back in the release layout; with the layout "
                                   "recorded at conversion every tensor is reproduced bytewise.")
    e.add_argument("ckpt", help="converted checkpoint folder (DST of `k31jax convert`)")
    e.add_argument("out", help="output release folder (written atomically)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing OUT that k31jax export wrote, or an "
                   "empty folder (after the new one is complete); anything else is never replaced")
    e.add_argument("--no-progress", action="store_true")
    e.add_argument("--debug", action="store_true", help="print the traceback of an error, and Orbax's logs")
    install(e, "export", _stoppable("k31jax export", _export))

    v = sub.add_parser("verify", help="check a converted checkpoint: every stored byte against its checksums, "
                                      "and with --source the round trip to the release",
                       description="Check every file of a converted checkpoint against its manifest (byte counts "
                                   "and XXH3-128 checksums written by `k31jax convert`); with --source also restore "
                                   "every stored leaf and compare it with the release tensors it came from. "
                                   "Read-only. Exit 0: intact; 1: damaged or different (the line names the file, "
                                   "leaf or tensor); 2: usage.")
    v.add_argument("ckpt", help="converted checkpoint folder (DST of `k31jax convert`)")
    v.add_argument("--source", default=None, help="the release folder it was converted from (round trip check)")
    v.add_argument("--no-progress", action="store_true")
    v.add_argument("--debug", action="store_true", help="print the traceback of an error, and Orbax's logs")
    install(v, "verify", _stoppable("k31jax verify", _verify))
