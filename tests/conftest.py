"""Test setup: 8 fake CPU devices (before any JAX op), the session's environment, and fixtures.

Layout (tests/README.md): one folder per `k31jax` package (`tests/<package>/test_*.py`) plus
`project/` for whole-project checks; shared helpers are the `helpers` package (importable from
every folder: `pythonpath = ["tests"]`), the float64 NumPy references the `refs` package,
peer goldens in `golden/`, scripts run as subprocesses in `multiprocess/`. This file keeps only
the session's setup, hooks and fixtures.
"""

import gc
import os
import shutil
import tempfile

from helpers.processes import RUN_CACHE_VAR, TEST_XLA_FLAGS

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles far more than it runs (tiny models): LLVM at -O0 compiles XLA:CPU programs
# ~40% faster (the tiny training step: 37 s -> 23 s) and runs them ~3x slower, a net win of
# minutes. Processes the tests start get the same flag (`subprocess_env`), so both sides of
# a comparison run the same code generation.
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
# The CLI turns on JAX's persistent compilation cache for its process (`k31jax generate`);
# called in-process by a test it would stay on, writing to the user's cache, for the session.
os.environ["K31JAX_COMPILE_CACHE"] = "0"
# The CLI processes tests start (`cli_env()`) share one persistent cache for the whole run (the
# xdist workers inherit it from the controller), so `train` -> `train --resume` -> `eval` or
# two servers compile each program once per run; removed when the run ends.
_OWNS_RUN_CACHE = RUN_CACHE_VAR not in os.environ
if _OWNS_RUN_CACHE:
    os.environ[RUN_CACHE_VAR] = tempfile.mkdtemp(prefix="k31jax-test-xla-")


def pytest_sessionfinish(session, exitstatus):
    if _OWNS_RUN_CACHE:
        shutil.rmtree(os.environ[RUN_CACHE_VAR], ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from helpers.model import randomize  # noqa: E402
from k31jax import K31ForCausalLM  # noqa: E402


def _mapped_regions() -> int:
    """The process's memory mappings (Linux; 0 where /proc is absent)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 65530


# Every XLA:CPU executable holds its JIT-compiled code in memory mappings of its own (7 for
# the smallest program, thousands for a model's), and Linux caps a process at
# vm.max_map_count (65,530 by default): past it, the next compile segfaults inside
# `backend_compile_and_load`. tests/generate/test_speculative.py alone reached the cap.
_MAPS_BEFORE_CLEARING = _map_limit() // 3


def _drop_compiled_programs() -> None:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    """Each module starts with no compiled programs kept from the last."""
    yield
    _drop_compiled_programs()


@pytest.fixture(autouse=True)
def _drop_compiled_programs_when_mappings_run_high():
    """After a test, drop jit's compiled programs once the process holds more than a third of its
    allowed memory mappings, so the next test's compiles cannot hit the cap."""
    yield
    if _mapped_regions() > _MAPS_BEFORE_CLEARING:
        _drop_compiled_programs()


@pytest.fixture
def make_model():
    def make(cfg, seed=0, scale=0.05):
        return randomize(K31ForCausalLM(cfg, rngs=nnx.Rngs(seed)), seed + 1, scale)
    return make
