"""Training metrics: one JSON line per logged step, TensorBoard event files (tensorboardX), a
tqdm progress bar with tokens/s, loss and ETA (saying "compiling ..." while the first step
compiles), and `plot_metrics` for loss curves."""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
from tensorboardX import SummaryWriter
from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"


def _scalar(value) -> float | None:
    arr = np.asarray(value)
    return float(arr) if arr.ndim == 0 else None


@contextlib.contextmanager
def compiling_note(bar: tqdm) -> Iterator[None]:
    """While the body runs (a jitted step's first call: tracing and XLA compilation, minutes for
    a training step on a small CPU), `bar` reads "compiling ... N s", updated every second
    from a helper thread, since the bar itself cannot move until the step returns."""
    if bar.disable:
        yield
        return
    previous, start, done = bar.desc, time.perf_counter(), threading.Event()

    def tick():
        while not done.wait(1.0):
            bar.set_description_str(f"compiling ... {time.perf_counter() - start:.0f} s")

    bar.set_description_str("compiling ...")
    ticker = threading.Thread(target=tick, name="k31jax-compiling-note", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.set_description_str(previous)


class MetricsLog:
    """Appends `{"step": N, ...}` lines to `out/metrics.jsonl` and scalars to `out/tb/`.

    Array metrics (per-layer router statistics) go to the JSON line as lists and to
    TensorBoard as one scalar per layer. On resume, lines beyond the resumed step are dropped
    first, so the file holds one line per step however often a run was interrupted.

    ``writes=False`` (every process of a multi-process run but process 0): nothing is written
    and no bar is drawn, so one run folder gets one metrics file and one set of event files."""

    def __init__(self, out: str | os.PathLike, *, resume_step: int = 0, progress_total: int | None = None,
                 progress: bool = True, writes: bool = True):
        self.path = Path(out) / METRICS_FILE
        self.writes = writes
        self._file = self._tb = None
        if writes:
            if self.path.exists():
                kept = [line for line in self.path.read_text().splitlines()
                        if line.strip() and json.loads(line)["step"] <= resume_step]
                self.path.write_text("".join(line + "\n" for line in kept))
            self._file = self.path.open("a")
            self._tb = SummaryWriter(str(Path(out) / "tb"), purge_step=resume_step + 1 if resume_step else None)
        self._bar = tqdm(total=progress_total, initial=resume_step, unit="step", dynamic_ncols=True,
                         disable=not (progress and writes))

    def write(self, step: int, metrics: Mapping[str, object]) -> None:
        if not self.writes:
            return
        row: dict[str, object] = {"step": step}
        for key, value in metrics.items():
            scalar = _scalar(value)
            if scalar is not None:
                row[key] = scalar
                self._tb.add_scalar(key, scalar, step)
            else:
                values = np.asarray(value).tolist()
                row[key] = values
                if np.asarray(value).ndim == 1:
                    for i, v in enumerate(values):
                        self._tb.add_scalar(f"{key}/{i}", v, step)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def compiling(self) -> contextlib.AbstractContextManager[None]:
        """`compiling_note` on this log's progress bar."""
        return compiling_note(self._bar)

    def progress(self, steps: int, postfix: Mapping[str, float]) -> None:
        self._bar.update(steps)
        self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)

    def close(self) -> None:
        self._bar.close()
        if self.writes:
            self._tb.close()
            self._file.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a run's `metrics.jsonl` (a run folder or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.exists():
        raise FileNotFoundError(f"{p}: no metrics file (expected a training run's --out folder or its {METRICS_FILE})")
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not a JSON line ({e})") from None
    return rows


def plot_metrics(runs: Sequence[str | os.PathLike], out: str | os.PathLike, *,
                 keys: Sequence[str] = ("loss", "eval_loss"), labels: Sequence[str] | None = None) -> Path:
    """Loss curves of one or more runs, one panel per key, saved as an image (PNG, SVG, PDF)."""
    import matplotlib  # heavy, and only `k31jax plot` needs it

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    data = [read_metrics(r) for r in runs]
    names = list(labels) if labels else [Path(r).name or str(r) for r in runs]
    present = [k for k in keys if any(k in row for rows in data for row in rows)]
    if not present:
        raise ValueError(f"none of the keys {list(keys)} appear in {list(map(str, runs))}")
    fig, axes = plt.subplots(1, len(present), figsize=(6 * len(present), 4), squeeze=False)
    for ax, key in zip(axes[0], present):
        for rows, name in zip(data, names):
            pts = [(row["step"], row[key]) for row in rows if key in row and math.isfinite(row[key])]
            if pts:
                ax.plot(*zip(*pts), label=name, marker="o" if len(pts) < 30 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = Path(out)
    tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, out)
    return out
