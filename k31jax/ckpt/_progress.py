"""Progress of the converter's byte streams (convert, export, verify): a tqdm bar on stderr, and
`human_bytes` for the summary lines."""

from __future__ import annotations

import sys

from tqdm import tqdm

# done / total, bytes per second and ETA; the postfix names the layer group in flight
_BAR_FORMAT = "{desc} [{bar:28}] {percentage:5.1f}%  {n_fmt}B/{total_fmt}B  {rate_fmt}  ETA {remaining}{postfix}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def progress_bar(total: int, what: str, *, enabled: bool) -> tqdm:
    """A bar over `total` bytes; `set_postfix_str(group)` names what is in flight. Disabled:
    updates do nothing. On a terminal it redraws five times a second; into a file or pipe (a
    log) at most every 30 s, and once at the end."""
    tty = sys.stderr.isatty()
    return tqdm(total=max(int(total), 1), desc=what, unit="B", unit_scale=True, unit_divisor=1000,
                disable=not enabled, file=sys.stderr, dynamic_ncols=True, mininterval=0.2 if tty else 30.0,
                bar_format=_BAR_FORMAT)
