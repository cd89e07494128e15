"""The one benchmark method every script in `benchmarks/` follows (issue #16).

- `Session`: what the machine was doing. The date, CPU, core count, jax version, a measured
  copy bandwidth, the load average before and after, and the CPU that *other* processes used
  meanwhile (machine busy time from /proc/stat minus this process tree's). `loaded` is True
  when other processes took more than a tenth of the cores: they then shared the cores, and a
  ratio taken that way is not a result (a 12.6x measured under load 3-6 was 1.9x on a quiet
  machine). The load average alone cannot tell: a benchmark that keeps every core busy itself
  sits at a load of about the core count. Without /proc, `loaded` is load > cores.
- `alternate(sides, repeats)`: the sides (k31jax and its peer) run in turn, one repeat each,
  after one warm-up each, so a change in machine load hits both alike.
- `Stats`: median, minimum and maximum of the repeats; `ratio` divides medians.
- Importing it applies `k31jax.distributed.tune_host_malloc` (as the `k31jax` commands that
  run models do) before JAX starts; `K31JAX_HOST_MALLOC=0` measures glibc's defaults. The
  header says which.
- `add_record_arguments(parser)` / `report(benchmark, name, lines, session, args)`: the
  `--record` / `--force` flags, and printing the header and lines, recording them when asked.
- `record(benchmark, lines, session, part=...)`: writes the run's block into the benchmark's
  section of `benchmarks/RESULTS.md` in place (the layout: `_results.py`), with the command
  that produced it. It refuses when the session was loaded, unless `force=True`, and then the
  block says in bold that it was measured under load.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from _results import block, block_key, put_block
from k31jax.distributed import tune_host_malloc

HOST_MALLOC = tune_host_malloc()  # before anything starts JAX's backend
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def torch_python() -> str | None:
    """The torch venv's interpreter for the peer side ($K31JAX_TORCH_PYTHON, else ./.torchvenv,
    made by scripts/make_torch_venv.sh), or None when there is none."""
    py = os.environ.get("K31JAX_TORCH_PYTHON") or str(RESULTS.parents[1] / ".torchvenv" / "bin" / "python")
    return py if Path(py).exists() else None


def copy_bandwidth_gbs(mb: int = 512, repeats: int = 5) -> float:
    """Memory bandwidth from a large array copy (read + write bytes / time), best of repeats."""
    a = np.ones(mb * (1 << 20) // 4, np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best / 1e9


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine_busy_ticks() -> int | None:
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return user + nice + system + irq + softirq + steal


def _stat_fields(pid: int | str) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # fields from the 3rd (state) on


def _tree_ticks() -> int | None:
    """CPU ticks of this process, its reaped children and its live descendants (a peer side
    running in a child process is part of the benchmark, not other load)."""
    try:
        own = _stat_fields("self")
        total = sum(int(v) for v in own[11:15])  # utime, stime, cutime, cstime
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    parents[int(entry)] = int(_stat_fields(entry)[1])
                except (OSError, IndexError, ValueError):
                    continue  # exited meanwhile
    except OSError:
        return None
    tree, grew = {os.getpid()}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    for pid in tree - {os.getpid()}:
        try:
            total += sum(int(v) for v in _stat_fields(pid)[11:13])
        except (OSError, IndexError, ValueError):
            continue
    return total


class OtherCPU:
    """Cores' worth of CPU that processes outside this one's tree use between `start()` and
    `stop()` (accumulating over several intervals); None where /proc is missing."""

    def __init__(self):
        self.ticks, self.seconds, self._mark = 0, 0.0, None

    def start(self) -> None:
        self._mark = (_machine_busy_ticks(), _tree_ticks(), time.perf_counter())

    def stop(self) -> None:
        busy0, own0, t0 = self._mark
        busy1, own1 = _machine_busy_ticks(), _tree_ticks()
        if None not in (busy0, own0, busy1, own1):
            self.ticks += max(0, (busy1 - busy0) - (own1 - own0))
            self.seconds += time.perf_counter() - t0

    def cores(self) -> float | None:
        if not self.seconds:
            return None
        return self.ticks / os.sysconf("SC_CLK_TCK") / self.seconds


@dataclasses.dataclass
class Session:
    """The machine during one benchmark run; `finish()` takes the closing load average."""

    cores: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    cpu: str = dataclasses.field(default_factory=_cpu_name)
    date: str = dataclasses.field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M"))
    load_before: float = dataclasses.field(default_factory=lambda: os.getloadavg()[0])
    load_after: float | None = None
    bandwidth_gbs: float = dataclasses.field(default_factory=copy_bandwidth_gbs)
    started: float = dataclasses.field(default_factory=time.perf_counter)
    other: OtherCPU = dataclasses.field(default_factory=OtherCPU)

    def __post_init__(self):
        self.other.start()

    def finish(self) -> Session:
        if self.load_after is None:
            self.other.stop()
        self.load_after = os.getloadavg()[0]
        return self

    @property
    def loaded(self) -> bool:
        other = self.other.cores()
        if other is not None:
            return other > 0.1 * self.cores
        return max(self.load_before, self.load_after if self.load_after is not None else 0.0) > self.cores

    def header(self) -> str:
        import jax

        after = f"{self.load_after:.1f}" if self.load_after is not None else "?"
        other = self.other.cores()
        other_text = "" if other is None else f", other processes {other:.2f} cores"
        mark = f"  **UNDER LOAD (other processes shared the {self.cores} cores): not a result**" if self.loaded else ""
        return (f"{self.date}, {self.cpu}, {self.cores} cores, jax {jax.__version__}, copy bandwidth "
                f"{self.bandwidth_gbs:.1f} GB/s, load average {self.load_before:.1f} before / {after} after"
                f"{other_text}, host malloc {'tuned' if HOST_MALLOC else 'default'}, "
                f"{time.perf_counter() - self.started:.0f} s{mark}")


@dataclasses.dataclass(frozen=True)
class Stats:
    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("Stats.of: no values")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def __str__(self) -> str:
        return f"{self.median:.4g} [{self.low:.4g}, {self.high:.4g}]"

    def rate(self, amount: float) -> Stats:
        """`amount` per unit of these times: at the median time [at the slowest, at the fastest]."""
        return Stats(amount / self.median, amount / self.high, amount / self.low, self.n)


def ratio(numerator: Stats, denominator: Stats) -> float:
    return numerator.median / denominator.median


def timed(call: Callable[[], object]) -> Callable[[], dict[str, float]]:
    """A side for `alternate` that times one `call()` until its results are ready: {"s": seconds}."""
    import jax

    def run() -> dict[str, float]:
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        return {"s": time.perf_counter() - t0}
    return run


def alternate(sides: dict[str, Callable[[], dict[str, float]]], repeats: int, *,
              warmup: int = 1) -> dict[str, dict[str, Stats]]:
    """Each side returns a dict of measurements per call; the sides run in turn, `warmup`
    unrecorded calls each first, then `repeats` (>= 3) recorded rounds, every other round in
    reverse order (A B, B A, ...: a side is not always the one that runs right after another).
    Returns each side's `Stats` per measurement name."""
    if repeats < 3:
        raise ValueError(f"repeats={repeats}: the benchmark method needs at least 3")
    for _ in range(warmup):
        for run in sides.values():
            run()
    seen: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
    for round_ in range(repeats):
        order = list(sides.items())
        for name, run in (order if round_ % 2 == 0 else order[::-1]):
            for key, value in run().items():
                seen[name].setdefault(key, []).append(float(value))
    return {name: {key: Stats.of(v) for key, v in values.items()} for name, values in seen.items()}


def add_record_arguments(parser) -> None:
    """`--record` and `--force`, the two flags `report` reads."""
    parser.add_argument("--record", action="store_true", help="write the result into benchmarks/RESULTS.md")
    parser.add_argument("--force", action="store_true", help="with --record: record even under load (marked)")


def report(benchmark: str, name: str, lines: Sequence[str], session: Session, args, *,
           part: str | None = None) -> None:
    """Print the session's header and `lines`; with `args.record`, write them into RESULTS.md
    (`record`, which refuses a loaded session unless `args.force`)."""
    print(f"# {name} benchmark  " + session.header())
    print("\n".join(lines))
    if args.record:
        record(benchmark, lines, session, part=part, force=args.force)


def running_command() -> str:
    """This script's command line as a reader would rerun it, without `--record` / `--force`
    (they do not change the figures)."""
    return shlex.join([f"benchmarks/{Path(sys.argv[0]).name}",
                       *(a for a in sys.argv[1:] if a not in ("--record", "--force"))])


def record(benchmark: str, lines: Sequence[str], session: Session, *, part: str | None = None,
           force: bool = False, results: Path = RESULTS, command: str | None = None) -> bool:
    """Put `lines` as block `benchmark` (`benchmark_part` for one part of a script that records
    several) into the section `## benchmark` of RESULTS.md, replacing that block's last run and
    keeping the section's text (`_results.put_block`). The block's first line names the
    command (default: the running one) and the session. Returns False, writing nothing, when
    the session was loaded and `force` is off."""
    if session.load_after is None:
        session.finish()
    if session.loaded and not force:
        print(f"# not recorded in {results.name}: other processes shared the {session.cores} cores "
              f"({session.header()}); rerun on a quiet machine, or --force to record it marked")
        return False
    key = block_key(benchmark, part)
    written = block(key, [f"`{key}` (`{command or running_command()}`): {session.header()}", "",
                          "```", *lines, "```"])
    text = results.read_text() if results.exists() else "# Benchmark results\n"
    text = put_block(text, benchmark, key, written, name=str(results))
    tmp = results.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, results)
    return True
