"""What every command shares: one-line errors and exit codes (`install`, `CliParser`),
argument checks, multi-process settings and the --mesh (`cli_context`).

Exit codes: 0 done; 1 a runtime error (bad input file, damaged checkpoint, I/O error, disk
full); 2 a usage error (a bad flag or argument value, found before any model is built);
128 + N when stopped by signal N (130 SIGINT, 143 SIGTERM, 141 when the reader of stdout went
away: `k31jax info | head -1` stops quietly, as a Unix tool killed by SIGPIPE). Every failure
is one line `k31jax CMD: error: ...` on stderr; `--debug` prints the traceback before it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import jax

from ..ckpt import CheckpointError, SafetensorsError
from ..config import ConfigError
from ..ckpt import Interrupted, SourceOverlapError
from ..distributed import initialize, shard_model
from ..generate import DRAFTERS, Speculation
from ..sharding import RULE_TABLES, activate, make_mesh, parse_mesh

EXIT_ERROR, EXIT_USAGE = 1, 2


class UsageError(Exception):
    """A command-line argument that cannot work (exit code 2), found before any heavy work."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` ends each option's line with its default, `(default: 4096)`, unless there is
    nothing to show (None, False, an empty list) or the help text already speaks of it."""

    def _format_action(self, action):
        default = action.default
        shown = (action.option_strings and default is not argparse.SUPPRESS and default is not None
                 and default is not False and default != [] and "default" not in (action.help or ""))
        if shown:
            action = copy.copy(action)  # the parser keeps its own action unchanged
            action.help = f"{action.help or ''} (default: %(default)s)".lstrip()
        return super()._format_action(action)


class CliParser(argparse.ArgumentParser):
    """argparse with one-line usage errors: `k31jax CMD: error: ... (see k31jax CMD --help)`,
    exit 2 (argparse's default prints the whole usage block first), and defaults shown in
    `--help`. Subcommand parsers inherit the class (and so its formatter)."""

    def __init__(self, *args, formatter_class=DefaultsHelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(command: str, message: str, code: int, debug: bool = False) -> int:
    """Print the one error line (the traceback of the exception being handled first with
    `debug`) and return `code`."""
    if debug:
        traceback.print_exc()
    print(f"{command}: error: {message}", file=sys.stderr)
    return code


def stdout_gone() -> int:
    """The reader of stdout went away (`k31jax info | head -1`): no error line, exit 141 (128 +
    SIGPIPE, what a shell reports for a Unix tool killed by it). Python ignores SIGPIPE, so
    its writes fail instead (BrokenPipeError); stdout is pointed at /dev/null so that the
    interpreter's last flush of what is still buffered does not fail again."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: not a real file (a test's capture)
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return 128 + signal.SIGPIPE


def report(command: str, exc: BaseException, debug: bool = False, signum: int | None = None) -> int:
    """The exit code for an exception ending a command, after its one error line."""
    if isinstance(exc, BrokenPipeError):
        return stdout_gone()
    if isinstance(exc, Interrupted):
        signum = signum or signal.SIGINT
        return fail(command, f"interrupted by {signal.Signals(signum).name}: {exc}", 128 + signum, debug)
    if isinstance(exc, KeyboardInterrupt):
        return fail(command, "interrupted by SIGINT", 128 + signal.SIGINT, debug)
    if isinstance(exc, (UsageError, SourceOverlapError)):
        return fail(command, str(exc), EXIT_USAGE, debug)
    if isinstance(exc, (CheckpointError, SafetensorsError, ConfigError)):
        return fail(command, str(exc), EXIT_ERROR, debug)
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        return fail(command, f"{exc.strerror or exc}{where}", EXIT_ERROR, debug)
    if isinstance(exc, ValueError):  # the library's own checks of values (sampling, requests, data)
        return fail(command, " ".join(str(exc).split()), EXIT_ERROR, debug)
    text = " ".join(str(exc).split())  # a bug or an unexpected library error: still one line
    return fail(command, f"{type(exc).__name__}: {text} (rerun with --debug for the traceback)", EXIT_ERROR, debug)


def run_command(command: str, run: Callable, validate: Callable | None, args: argparse.Namespace) -> int:
    """`validate(args)` (usage errors, before anything is built), then `run(args)`; every
    exception becomes one line and an exit code (`report`)."""
    try:
        if validate is not None:
            validate(args)
        code = run(args)
        sys.stdout.flush()  # here, so that a reader gone away is reported by `report`
        return code
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the command line's last word
        return report(command, e, getattr(args, "debug", False))


def install(parser: argparse.ArgumentParser, command: str, run: Callable, *,
            validate: Callable | None = None) -> None:
    """Make `run(args)` the command `k31jax COMMAND`: arguments checked by `validate` first,
    a `--debug` flag, and one error line with the documented exit code for any failure."""
    if "--debug" not in parser._option_string_actions:
        parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    parser.set_defaults(func=functools.partial(run_command, f"k31jax {command}", run, validate))


def add_distributed_arguments(parser: argparse.ArgumentParser, *,
                              mesh_help: str = "run sharded on this mesh, e.g. expert=8,tensor=8") -> None:
    """`--coordinator host:port --num-processes N --process-id I [--cpu-collectives gloo]`
    and `--mesh expert=8,tensor=8`."""
    g = parser.add_argument_group("multi-process / sharding (jax.distributed)")
    g.add_argument("--coordinator", default=None, help="host:port of process 0 (jax.distributed)")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)
    g.add_argument("--local-device-ids", default=None, help="comma-separated local device ids")
    g.add_argument("--cpu-collectives", default=None, choices=["gloo", "mpi"],
                   help="cross-process collectives on CPU devices")
    g.add_argument("--num-cpu-devices", type=int, default=None, help="fake CPU devices per process")
    g.add_argument("--mesh", default=None, help=mesh_help)
    g.add_argument("--rules", default=None, help="rule table (tp, ep_tp, fsdp_ep_tp, ep_in_tp; "
                   "default: chosen from the mesh)")


def initialize_from_args(args: argparse.Namespace) -> bool:
    ids = getattr(args, "local_device_ids", None)
    return initialize(
        getattr(args, "coordinator", None), getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
        local_device_ids=[int(i) for i in ids.split(",")] if ids else None,
        cpu_collectives=getattr(args, "cpu_collectives", None),
        num_cpu_devices=getattr(args, "num_cpu_devices", None))


def mesh_from_args(args: argparse.Namespace):
    """The mesh `--mesh` asks for (None without it)."""
    spec = getattr(args, "mesh", None)
    if not spec:
        return None
    return make_mesh(spec)


class cli_context:
    """For a CLI command: `jax.distributed.initialize` from the flags, then (with --mesh) the
    mesh and its rule table stay active for the whole command, and `place(model)` puts a
    loaded model's parameters on it.

        with cli_context(args) as ctx:
            model = ctx.place(load(...))
            ...  # jitted calls trace under the mesh: constraints + expert parallelism
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.mesh = None
        self._stack = None

    def __enter__(self):
        initialize_from_args(self.args)
        self.mesh = mesh_from_args(self.args)
        self._stack = contextlib.ExitStack()
        if self.mesh is not None:
            self._stack.enter_context(activate(self.mesh, getattr(self.args, "rules", None)))
        return self

    def place(self, model):
        if self.mesh is None:
            return model
        return shard_model(model, self.mesh, getattr(self.args, "rules", None))

    def __exit__(self, *exc):
        self._stack.close()
        return False


# ---- argument checks (UsageError names the flag) --------------------------------------
def add_speculation_arguments(p) -> None:
    """--speculate / --max-draft (speculative decoding, `k31jax.generate.Speculation`)."""
    p.add_argument("--speculate", choices=DRAFTERS, default=None,
                   help="speculative decoding: 'ngram' drafts the continuation of the latest earlier "
                        "match of the last tokens (prompt lookup) and verifies it in one forward pass; "
                        "the same output as without (greedy), the same distribution (sampling)")
    p.add_argument("--max-draft", type=int, default=8, help="most tokens a row drafts per step (--speculate)")


def speculation_from(args) -> Speculation | None:
    """The `Speculation` of --speculate / --max-draft (None without --speculate)."""
    check_int("--max-draft", args.max_draft, low=1, high=64)
    return None if args.speculate is None else Speculation(args.speculate, max_draft=args.max_draft)


def check_int(flag: str, value, *, low: int | None = None, high: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if (low is not None and value < low) or (high is not None and value > high):
        want = (f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]")
        raise UsageError(f"{flag} {value}: expected an integer {want}")


def check_float(flag: str, value, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    ok = math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"<= {high}"
        want = " and ".join(x for x in (lo, hi) if x)
        raise UsageError(f"{flag} {value}: expected a finite number{' ' + want if want else ''}")


def check_mesh_args(args: argparse.Namespace) -> None:
    """The multi-process flags of `add_distributed_arguments`, and a --mesh that parses."""
    check_int("--num-processes", getattr(args, "num_processes", None), low=1, optional=True)
    check_int("--process-id", getattr(args, "process_id", None), low=0, optional=True)
    n, pid = getattr(args, "num_processes", None), getattr(args, "process_id", None)
    if n is not None and pid is not None and pid >= n:
        raise UsageError(f"--process-id {pid}: expected < --num-processes {n}")
    check_int("--num-cpu-devices", getattr(args, "num_cpu_devices", None), low=1, optional=True)
    ids = getattr(args, "local_device_ids", None)
    if ids:
        parts = ids.split(",")
        if not all(p.strip().isdigit() for p in parts):
            raise UsageError(f"--local-device-ids {ids!r}: expected comma-separated integers >= 0")
    spec = getattr(args, "mesh", None)
    if spec:
        check_mesh_spec("--mesh", spec)
    check_rules("--rules", getattr(args, "rules", None))


def check_mesh_spec(flag: str, spec: str) -> None:
    """`axis=size,...` with known axes and sizes >= 1 (parsed only: no devices needed)."""
    try:
        parse_mesh(spec)
    except (ValueError, TypeError) as e:
        shown = f"{flag}: {e}" if repr(spec) in str(e) else f"{flag} {spec!r}: {e}"
        raise UsageError(shown) from None


def check_rules(flag: str, name: str | None) -> None:
    if name is not None and name not in RULE_TABLES:
        raise UsageError(f"{flag} {name!r}: expected one of {', '.join(sorted(RULE_TABLES))}")


class StatusLine:
    """One line on stderr saying what a long wait is doing, with the seconds elapsed, redrawn
    every `interval` s by a thread (the main thread may sit in one XLA compile for minutes) and
    erased at the end; only when stderr is a terminal, so logs and pipes stay clean.

        with StatusLine("prefill (compiling on first use)") as status:
            ...
            status.set(f"generating: {n} tokens")
    """

    def __init__(self, text: str, *, stream=None, interval: float = 0.5):
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.text, self.interval = text, interval
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._redraw, daemon=True, name="k31jax-status")
        self._start = time.perf_counter()

    def set(self, text: str) -> None:
        self.text = text

    def _redraw(self) -> None:
        while not self._done.wait(self.interval):
            self.stream.write(f"\r\x1b[K[k31jax] {self.text} ({time.perf_counter() - self._start:.0f} s)")
            self.stream.flush()

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        if self.enabled:
            self._done.set()
            self._thread.join()
            self.stream.write("\r\x1b[K")  # erase the line: what follows starts clean
            self.stream.flush()
        return False


def enable_compile_cache() -> None:
    """JAX's persistent compilation cache for this process, so the next run of a command (a
    resumed training run, the next `generate`) loads its programs instead of compiling them.
    K31JAX_COMPILE_CACHE: the folder (default ~/.cache/k31jax/xla), or 0 for off."""
    where = os.environ.get("K31JAX_COMPILE_CACHE", "")
    if where == "0" or jax.config.jax_compilation_cache_dir:
        return
    path = where or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                 "k31jax", "xla")
    try:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    except (OSError, AttributeError):
        pass
