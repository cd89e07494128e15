"""glibc malloc settings under which XLA:CPU reuses its buffers instead of faulting them in anew.

XLA:CPU allocates every call's temporaries and outputs afresh. glibc serves blocks of 32 MiB
and more with `mmap`, and serves threads other than the main one from arenas whose heaps give
pages back when a block at their top is freed; either way the next call's buffer is new
memory, which the kernel maps in 4 KiB page by page. A batch-8 MoE decode step copies ~100 MiB of
gathered expert weights, so it spends most of its time in page faults. With one arena, no
`mmap` for large blocks and a high trim threshold, a freed buffer stays mapped and the next
call reuses it. `benchmarks/RESULTS.md` ("## host_malloc") has the measured effect.

The price: freed memory up to the trim threshold stays with the process instead of going back
to the system, and every thread allocates from one arena (XLA:CPU's allocations are few and
large). That suits generation, serving and
training; the checkpoint converter, which streams tensors far larger than any buffer it keeps,
does not use it.

This is a process setting, made with `mallopt` (glibc only: a no-op on macOS or musl). Tools
written in C set the same through ``GLIBC_TUNABLES`` before the process starts; a library
cannot, hence the call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import warnings

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc's malloc.h


def backends_started() -> bool:
    """Whether JAX has created its backends (its first computation or device query ran)."""
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # private API: if it moves, assume the safe answer
        return False


def tune_host_malloc(trim_threshold: int = 1 << 30) -> bool:
    """Make glibc keep freed large blocks for reuse (see the module docstring); returns whether
    it did. It must run before JAX's first computation, since the backend's worker threads pick
    their malloc arena when they start: called later it changes nothing and warns.
    ``K31JAX_HOST_MALLOC=0`` turns it off."""
    if os.environ.get("K31JAX_HOST_MALLOC", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    if backends_started():
        warnings.warn("tune_host_malloc() after JAX's first computation changes nothing (the XLA:CPU "
                      "threads already have their malloc arenas): call it first", stacklevel=2)
        return False
    return all(mallopt(option, value) == 1 for option, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, int(trim_threshold))))
