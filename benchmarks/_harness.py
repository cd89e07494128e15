"""The one benchmark method every script in `benchmarks/` follows (issue #16).

- `Session`: what the machine was doing. The date, CPU, core count, jax version, a measured
  copy bandwidth, and the load average before and after. `loaded` is True when either load
  average exceeds the core count: other processes then share the cores, and a ratio taken that
  way is not a result (a 12.6x measured under load 3-6 was 1.9x on a quiet machine).
- `alternate(sides, repeats)`: the sides (k31jax and its peer) run in turn, one repeat each,
  after one warm-up each, so a change in machine load hits both alike.
- `Stats`: median, minimum and maximum of the repeats; `ratio` divides medians.
- `record(section, lines, session)`: writes a block into `benchmarks/RESULTS.md`, replacing the
  block of the same section. It refuses when the session was loaded, unless `force=True`, and
  then the block says in bold that it was measured under load.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


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

    def finish(self) -> Session:
        self.load_after = os.getloadavg()[0]
        return self

    @property
    def loaded(self) -> bool:
        return max(self.load_before, self.load_after if self.load_after is not None else 0.0) > self.cores

    def header(self) -> str:
        import jax

        after = f"{self.load_after:.1f}" if self.load_after is not None else "?"
        mark = f"  **UNDER LOAD (> {self.cores} cores): not a result**" if self.loaded else ""
        return (f"{self.date}, {self.cpu}, {self.cores} cores, jax {jax.__version__}, copy bandwidth "
                f"{self.bandwidth_gbs:.1f} GB/s, load average {self.load_before:.1f} before / {after} after, "
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


def ratio(numerator: Stats, denominator: Stats) -> float:
    return numerator.median / denominator.median


def alternate(sides: dict[str, Callable[[], dict[str, float]]], repeats: int, *,
              warmup: int = 1) -> dict[str, dict[str, Stats]]:
    """Each side returns a dict of measurements per call; the sides run in turn, `warmup`
    unrecorded calls each first, then `repeats` (>= 3) recorded rounds. Returns each side's
    `Stats` per measurement name."""
    if repeats < 3:
        raise ValueError(f"repeats={repeats}: the benchmark method needs at least 3")
    for _ in range(warmup):
        for run in sides.values():
            run()
    seen: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            for key, value in run().items():
                seen[name].setdefault(key, []).append(float(value))
    return {name: {key: Stats.of(v) for key, v in values.items()} for name, values in seen.items()}


def record(section: str, lines: Sequence[str], session: Session, *, force: bool = False,
           results: Path = RESULTS) -> bool:
    """Put `lines` under a `<!-- bench:section -->` block of RESULTS.md (replacing an older
    one). Returns False, writing nothing, when the session was loaded and `force` is off."""
    if session.load_after is None:
        session.finish()
    if session.loaded and not force:
        print(f"# not recorded in {results.name}: load average {session.load_before:.1f} / {session.load_after:.1f} "
              f"exceeds {session.cores} cores (rerun on a quiet machine, or --force to record it marked)")
        return False
    begin, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    block = "\n".join([begin, f"`{section}`: {session.header()}", "", "```", *lines, "```", end])
    text = results.read_text() if results.exists() else "# Benchmark results\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    tmp = results.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, results)
    return True
