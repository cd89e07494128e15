"""A dependency-free progress bar: bytes done, bytes/s and ETA, on one updating line on a
terminal, or a plain line every few percent when the output is not a terminal."""

from __future__ import annotations

import sys
import time


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _clock(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """`update(n, label)` adds `n` bytes. Disabled instances do nothing."""

    def __init__(self, total: int, what: str = "convert", *, enabled: bool = True, stream=None,
                 width: int = 28, min_interval: float = 0.2):
        self.total, self.what, self.enabled = max(int(total), 1), what, enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width, self.min_interval = width, min_interval
        self.done, self.start = 0, time.perf_counter()
        self._last, self._last_pct = 0.0, -100.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def rate(self) -> float:
        return self.done / max(self.elapsed, 1e-9)

    def line(self, label: str = "") -> str:
        frac = min(self.done / self.total, 1.0)
        fill = int(frac * self.width)
        rate = self.rate()
        eta = (self.total - self.done) / rate if rate > 0 else 0
        return (f"{self.what} [{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:5.1f}%  "
                f"{human_bytes(self.done)}/{human_bytes(self.total)}  {human_bytes(rate)}/s  "
                f"ETA {_clock(eta)}  {label}")

    def update(self, n: int, label: str = "") -> None:
        self.done += int(n)
        if not self.enabled:
            return
        now = time.perf_counter()
        pct = 100 * self.done / self.total
        if self.tty:
            if now - self._last >= self.min_interval or self.done >= self.total:
                self.stream.write("\r" + self.line(label).ljust(110))
                self.stream.flush()
                self._last = now
        elif pct - self._last_pct >= 10 or self.done >= self.total:
            self.stream.write(self.line(label) + "\n")
            self.stream.flush()
            self._last_pct = pct

    def close(self, message: str = "") -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line().ljust(110) + "\n")
        if message:
            self.stream.write(message + "\n")
        self.stream.flush()
