"""`k31jax.distributed.tune_host_malloc`: glibc then serves large blocks from its heap (no
`mmap`, which would hand XLA:CPU fresh pages every call), only in a process whose JAX backend
has not started, and `K31JAX_HOST_MALLOC=0` turns it off."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from k31jax.distributed import backends_started, tune_host_malloc


def _has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    return bool(name) and hasattr(ctypes.CDLL(name), "mallinfo2")


pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and _has_mallinfo2()),
                                reason="glibc (>= 2.33, for mallinfo2) only")

# In a fresh process: tune (or not), hold a 64 MiB block, report glibc's mmap'd bytes.
PROBE = """
import ctypes, ctypes.util, json
import numpy as np
from k31jax.distributed import tune_host_malloc

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
tuned = tune_host_malloc()
block = np.ones(1 << 23)  # 64 MiB
info = libc.mallinfo2()
print(json.dumps({"tuned": tuned, "mmapped": info.hblkhd, "heap": info.arena}))
"""


def _probe(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_large_blocks_come_from_the_heap_once_tuned():
    tuned = _probe()
    assert tuned["tuned"] and tuned["mmapped"] < 1 << 26 <= tuned["heap"]
    default = _probe(K31JAX_HOST_MALLOC="0")
    assert not default["tuned"] and default["mmapped"] >= 1 << 26


def test_after_the_backend_started_it_changes_nothing_and_says_so():
    jnp.zeros(2).block_until_ready()
    assert backends_started()
    with pytest.warns(UserWarning, match="call it first"):
        assert tune_host_malloc() is False
