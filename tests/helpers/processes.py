"""The environment of the processes a test starts: the `k31jax` CLI and multi-process workers.

`conftest.py` applies the same settings to the test process itself before JAX is imported."""

import os
import socket

# LLVM at -O0 for XLA:CPU: the suite compiles far more than it runs (see conftest.py).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
# Names the persistent compilation cache shared by every CLI process of one test run.
RUN_CACHE_VAR = "K31JAX_TEST_RUN_XLA_CACHE"


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a `k31jax` command a test runs as a subprocess."""
    return {**os.environ, "K31JAX_COMPILE_CACHE": os.environ[RUN_CACHE_VAR], **extra}


def subprocess_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) for a process that picks its own CPU device count: no
    inherited device-count settings, the suite's code generation flags kept."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("JAX_NUM_CPU")}
    return {**env, "XLA_FLAGS": TEST_XLA_FLAGS, "JAX_PLATFORMS": "cpu"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a test's server or coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
