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


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    """XLA:CPU compiles crashed (SIGSEGV / SIGABRT inside `backend_compile_and_load`) late in a
    full-suite process, after thousands of programs had been compiled and kept alive by jit's
    caches; dropping them after each test module keeps the process's JIT memory bounded."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def make_model():
    def make(cfg, seed=0, scale=0.05):
        return randomize(K31ForCausalLM(cfg, rngs=nnx.Rngs(seed)), seed + 1, scale)
    return make
