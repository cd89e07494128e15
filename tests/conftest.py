"""Test setup: 8 fake CPU devices (before any JAX op) and shared fixtures."""

import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles far more than it runs (tiny models): LLVM at -O0 compiles XLA:CPU programs
# ~40% faster (the tiny training step: 37 s -> 23 s) and runs them ~3x slower, a net win of
# minutes. Processes the tests start get the same flag (`subprocess_env`), so both sides of
# a comparison run the same code generation.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
# The CLI turns on JAX's persistent compilation cache for its process (`k31jax generate`);
# called in-process by a test it would stay on, writing to the user's cache, for the session.
os.environ["K31JAX_COMPILE_CACHE"] = "0"
# The CLI processes tests start (`cli_env()`) share one persistent cache for the whole run (the
# xdist workers inherit it from the controller), so `train` -> `train --resume` -> `eval` or
# two servers compile each program once per run; removed when the run ends.
_RUN_CACHE_VAR = "K31JAX_TEST_RUN_XLA_CACHE"
_OWNS_RUN_CACHE = _RUN_CACHE_VAR not in os.environ
if _OWNS_RUN_CACHE:
    os.environ[_RUN_CACHE_VAR] = tempfile.mkdtemp(prefix="k31jax-test-xla-")


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a `k31jax` command a test runs as a subprocess."""
    return {**os.environ, "K31JAX_COMPILE_CACHE": os.environ[_RUN_CACHE_VAR], **extra}


def subprocess_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) for a process that picks its own CPU device count: no
    inherited device-count settings, the suite's code generation flags kept."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("JAX_NUM_CPU")}
    return {**env, "XLA_FLAGS": TEST_XLA_FLAGS, "JAX_PLATFORMS": "cpu"}


def pytest_sessionfinish(session, exitstatus):
    if _OWNS_RUN_CACHE:
        shutil.rmtree(os.environ[_RUN_CACHE_VAR], ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from k31jax import K31ForCausalLM, ModelConfig  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    """XLA:CPU compiles crashed (SIGSEGV / SIGABRT inside `backend_compile_and_load`) late in a
    full-suite process, after thousands of programs had been compiled and kept alive by jit's
    caches; dropping them after each test module keeps the process's JIT memory bounded."""
    yield
    jax.clear_caches()
    gc.collect()


def randomize(model, seed: int, scale: float = 0.05):
    """Perturb every parameter (zeros included) so no part of the model is trivially inert."""
    state = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(state)
    new = [jax.numpy.asarray((np.asarray(l, np.float32) + scale * rng.standard_normal(l.shape)).astype(l.dtype))
           for l in leaves]
    nnx.update(model, jax.tree.unflatten(treedef, new))
    return model


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig.preset("tiny", **{"dtype": "float32", **overrides})


def kimi_linear_tiny_config(**overrides) -> ModelConfig:
    """A tiny Kimi Linear: softplus gate, low-rank output gate, ungated MLA with plain q_proj,
    plain residuals, SwiGLU, no latent MoE, scaling 2.446."""
    base = tiny_config()
    return base.replace(
        kda_gate_lower_bound=None, kda_full_rank_gate=False, kda_a_log_len=base.kda_num_heads,
        q_lora_rank=None, mla_use_output_gate=False, attn_res_block_size=None, hidden_act="silu",
        activation_situ_linear_beta=None, routed_expert_hidden_size=None, routed_scaling_factor=2.446,
        num_shared_experts=1, index_topk=None, index_n_heads=0, index_head_dim=0, **overrides)


@pytest.fixture
def make_model():
    def make(cfg, seed=0, scale=0.05):
        return randomize(K31ForCausalLM(cfg, rngs=nnx.Rngs(seed)), seed + 1, scale)
    return make


def abstract(cls, *args):
    """The module with abstract parameters (no random init, which compiles per shape); every
    parameter is then filled from NumPy, so a leftover abstract leaf would fail loudly."""
    return nnx.eval_shape(lambda: cls(*args, rngs=nnx.Rngs(0)))


def rel_err(got, want):
    """max |got - want| / max(1, max |want|): absolute for O(1) tensors, relative for big ones."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0))
