"""The ops' one kernel seam (`k31jax.ops._impl`): how `impl` resolves (backend, mesh), the
`Backends` object and its `K31JAX_KERNELS` default, that the kernels differentiate exactly
like the XLA paths they replace (or, for the Mosaic MXFP4 matmul, by its own transposed
kernel), that "auto" takes only kernels verified on the target's hardware, and that a whole model run with `Backends(kernels="interpret")` (every hot path on its Pallas kernel:
KDA chunk + decode step, sparse MLA, indexer top-k, MXFP4 grouped matmul) gives the logits
and caches of `Backends(kernels="xla")`, in prefill and in decode."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from helpers.model import rel_err, tiny_config
from k31jax import Backends, K31ForCausalLM
from k31jax.ops import _impl, _kda, _mla, _moe
from k31jax.quant import mxfp4_quantize_packed


# ---------------------------------------------------------------------------- resolution
@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend the default backend is a GPU (resolution only; nothing is compiled)."""
    monkeypatch.setattr(_impl.jax, "default_backend", lambda: "gpu")


def test_auto_follows_the_backend(monkeypatch):
    monkeypatch.delenv("K31JAX_KERNELS", raising=False)
    for kernel in _impl.KERNELS:
        want = "pallas" if jax.default_backend() == "gpu" and kernel in _impl.VERIFIED_ON_GPU else "xla"
        assert _impl.resolve_impl(None, kernel) == _impl.resolve_impl("auto", kernel) == want
    assert _impl.resolve_impl("interpret", "kda_chunk", supported=False) == "interpret"  # explicit: the kernel decides
    with pytest.raises(ValueError, match=r"impl='triton': expected one of \('xla', 'pallas', 'interpret', 'interpret_tpu'\)"):
        _impl.resolve_impl("triton", "kda_chunk")
    with pytest.raises(ValueError, match="kernel='flash'"):
        _impl.resolve_impl(None, "flash")


def test_tpu_kernels_for_every_op():
    """"interpret_tpu", and "pallas" for a TPU target, take every op's Mosaic kernel; "auto"
    never picks an unverified TPU kernel."""
    from k31jax.kernels import kernel_platform, target_tpu

    assert {_impl.resolve_impl("interpret_tpu", k) for k in _impl.KERNELS} == {"interpret_tpu"}
    with target_tpu():
        assert kernel_platform() == "tpu"
        assert {_impl.resolve_impl("pallas", k) for k in _impl.KERNELS} == {"pallas"}
        assert {_impl.resolve_impl(None, k) for k in _impl.KERNELS} == {"xla"}
    assert kernel_platform() == jax.default_backend()


def test_auto_for_a_tpu_takes_only_kernels_verified_on_one(monkeypatch):
    """Building for a TPU, "auto" takes a Mosaic kernel once `VERIFIED_ON_TPU` records its check
    (benchmarks/tpu_check.py), and only that one; on this CPU host, never."""
    from k31jax.kernels import target_tpu

    monkeypatch.delenv("K31JAX_KERNELS", raising=False)
    monkeypatch.setattr(_impl, "VERIFIED_ON_TPU", {"kda_chunk": "jax 0.12.0, libtpu 0.0.50, TPU v5"})
    with target_tpu():
        assert {k: _impl.resolve_impl(None, k) for k in _impl.KERNELS} == {
            k: "pallas" if k == "kda_chunk" else "xla" for k in _impl.KERNELS}
        assert _impl.resolve_impl(None, "kda_chunk", supported=False) == "xla"
    assert _impl.resolve_impl(None, "kda_chunk") == "xla"


def test_auto_on_gpu_takes_only_verified_kernels(on_gpu, monkeypatch):
    """Until a kernel has passed its check on GPU hardware, "auto" keeps its op on XLA."""
    monkeypatch.setattr(_impl, "VERIFIED_ON_GPU", {})
    assert {_impl.resolve_impl(None, k) for k in _impl.KERNELS} == {"xla"}
    assert _impl.resolve_impl("pallas", "kda_chunk") == "pallas"  # opt-in stays possible


def test_auto_on_gpu_outside_and_inside_a_mesh(on_gpu, monkeypatch):
    monkeypatch.delenv("K31JAX_KERNELS", raising=False)
    monkeypatch.setattr(_impl, "VERIFIED_ON_GPU", {"kda_chunk": "0.11.2"})
    assert _impl.resolve_impl(None, "kda_chunk") == "pallas"
    assert _impl.resolve_impl(None, "kda_chunk", supported=False) == "xla"
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    seen = {}
    with jax.set_mesh(mesh):
        seen["partitioned"] = _impl.resolve_impl(None, "kda_chunk")

        def per_device(x):
            seen["shard_map"] = _impl.resolve_impl(None, "kda_chunk")
            return x

        jax.shard_map(per_device, in_specs=P("data", "model"), out_specs=P("data", "model"))(jnp.zeros((2, 4)))
    assert seen == {"partitioned": "xla", "shard_map": "pallas"}


def test_backends_default_from_the_environment(on_gpu, monkeypatch):
    """`K31JAX_KERNELS` is only the default of `Backends.kernels`; `resolve_impl` never reads it."""
    monkeypatch.delenv("K31JAX_KERNELS", raising=False)
    assert Backends() == Backends(kernels="auto", moe="auto", sparse="auto", ep="auto")
    monkeypatch.setenv("K31JAX_KERNELS", "xla")
    assert Backends().kernels == "xla" and Backends(kernels="interpret").kernels == "interpret"
    monkeypatch.setattr(_impl, "VERIFIED_ON_GPU", {"mxfp4_gmm": "0.11.2"})
    assert _impl.resolve_impl(Backends().kernels, "mxfp4_gmm") == "xla"
    assert _impl.resolve_impl(None, "mxfp4_gmm") == "pallas"  # the seam itself ignores the variable
    monkeypatch.setenv("K31JAX_KERNELS", "cuda")
    with pytest.raises(ValueError, match="K31JAX_KERNELS='cuda'"):
        Backends()
    for field, value in (("kernels", "cuda"), ("moe", "pallas"), ("sparse", "dense"), ("ep", "mpi")):
        with pytest.raises(ValueError, match=f"Backends.{field}={value!r}"):
            Backends(**{"kernels": "xla", field: value})


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the kernel compiles")
def test_a_kernel_that_fails_to_compile_runs_the_xla_path_with_one_warning(monkeypatch):
    """Off a GPU the Triton kernels cannot compile (only their interpreter runs): exactly the
    failure an opted-in kernel meets on an unsupported GPU or jax version."""
    import warnings

    monkeypatch.setattr(_impl, "_COMPILES", {})
    monkeypatch.setattr(_impl, "_WARNED", set())
    rng = np.random.default_rng(3)

    def inputs(t):
        q, k = (jnp.asarray(rng.standard_normal((1, t, 2, 16)) * 0.3, jnp.float32) for _ in range(2))
        v = jnp.asarray(rng.standard_normal((1, t, 2, 16)), jnp.float32)
        g = jnp.asarray(-np.abs(rng.standard_normal((1, t, 2, 16))) * 0.1, jnp.float32)
        beta = jnp.asarray(rng.uniform(0.1, 0.9, (1, t, 2)), jnp.float32)
        return q, k, v, g, beta

    args = inputs(21)
    with pytest.warns(RuntimeWarning, match="'kda_chunk' failed to compile"):
        out, state = _kda.kda_chunked(*args, chunk_size=16, impl="pallas")
    want_out, want_state = _kda.kda_chunked(*args, chunk_size=16, impl="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(state), np.asarray(want_state))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # new shapes are checked again, but warned about once per kernel
        jax.jit(lambda *a: _kda.kda_chunked(*a, chunk_size=16, impl="pallas"))(*inputs(9))
    assert sorted(_impl._COMPILES.values()) == [False, False]


# ---------------------------------------------------------------------------- gradients
def _grads(fn, args, argnums):
    """Gradients of a random projection of fn's float outputs."""
    def loss(*a):
        out = fn(*a)
        leaves = [o for o in jax.tree.leaves(out) if jnp.issubdtype(o.dtype, jnp.floating)]
        return sum(jnp.sum(o * jnp.cos(jnp.arange(o.size, dtype=o.dtype).reshape(o.shape))) for o in leaves)
    return jax.jit(jax.grad(loss, argnums=argnums))(*args)


def _assert_same_grads(op, args, argnums, tol=1e-5):
    got = _grads(functools.partial(op, impl="interpret"), args, argnums)
    want = _grads(functools.partial(op, impl="xla"), args, argnums)
    for g, w in zip(got, want):
        assert rel_err(g, w) < tol


def test_kda_grads_through_the_kernels():
    rng = np.random.default_rng(0)
    b, t, h, dk, dv = 1, 37, 2, 16, 16  # t: not a multiple of the chunk
    q, k = (jnp.asarray(rng.standard_normal((b, t, h, dk)) * 0.3, jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    g = jnp.asarray(-5.0 * rng.uniform(0.0, 1.0, (b, t, h, dk)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (b, t, h)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, h, dk, dv)) * 0.1, jnp.float32)
    chunked = functools.partial(_kda.kda_chunked, chunk_size=16, lower_bound=-5.0)
    _assert_same_grads(chunked, (q, k, v, g, beta, s0), (0, 1, 2, 3, 4, 5))
    step = lambda *a, impl: _kda.kda_recurrent(*(x[:, :1] for x in a[:5]), a[5], impl=impl)
    _assert_same_grads(step, (q, k, v, g, beta, s0), (0, 1, 2, 3, 4, 5))


def test_sparse_mla_grads_through_the_kernel():
    rng = np.random.default_rng(1)
    b, t, h, dn, dr, r, dv, s, kk = 1, 3, 4, 16, 8, 16, 16, 40, 12
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.float32)
    args = (f(b, t, h, dn), f(b, t, h, dr), f(b, s, r), f(b, s, dr), f(r, h, dn), f(r, h, dv),
            jnp.asarray(rng.integers(0, s, (b, t, kk)), jnp.int32), jnp.asarray(rng.random((b, t, kk)) < 0.8))
    op = lambda *a, impl: _mla.mla_attention_sparse(*a, 0.2, impl=impl)
    _assert_same_grads(op, args, (0, 1, 2, 3, 4, 5))


def test_mxfp4_grouped_matmul_grads_through_the_kernel():
    rng = np.random.default_rng(2)
    e, n, k = 4, 32, 64
    packed, scale = mxfp4_quantize_packed(jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32))
    w = _moe.MXFP4Weight(packed, scale)
    sizes = jnp.asarray([5, 0, 9, 3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((17, k)), jnp.float32)
    op = lambda x, impl: _moe.grouped_matmul(x, w, sizes, impl=impl)
    _assert_same_grads(op, (x,), (0,))


# ---------------------------------------------------------------------------- the model
KERNELS = {"k31jax.kernels.kda_chunk": ("kda_chunked", "kda_recurrent"),
           "k31jax.kernels.sparse_mla": ("mla_attention_sparse", "select_topk"),
           "k31jax.kernels.mxfp4_matmul": ("grouped_matmul", "grouped_matmul_gate_up")}


def test_model_on_the_kernels_equals_xla(monkeypatch):
    """tiny (indexer top-8 < context, MXFP4 experts): prefill of 21 tokens then 3 decode steps,
    every hot path on its interpret-mode kernel vs the XLA paths."""
    import importlib

    calls = {}
    for module, names in KERNELS.items():
        mod = importlib.import_module(module)
        for name in names:
            def counted(*a, _f=getattr(mod, name), _n=name, **kw):
                calls[_n, kw.get("impl")] = calls.get((_n, kw.get("impl")), 0) + 1
                return _f(*a, **kw)
            monkeypatch.setattr(mod, name, counted)
    cfg = tiny_config(expert_weights="mxfp4")
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)

    @functools.partial(nnx.jit, static_argnames="kernels")
    def run(model, tokens, kernels):
        cache = model.init_cache(2, 32)
        backends = Backends(kernels=kernels, sparse="gather")  # the kernel's attention form in prefill too
        out = model(tokens[:, :21], cache, backends=backends)
        steps = [out.logits[:, -1]]
        for i in range(21, 24):
            out = model(tokens[:, i:i + 1], out.cache, backends=backends)
            steps.append(out.logits[:, -1])
        return jnp.stack(steps, 1), out.cache

    got, got_cache = run(model, tokens, "interpret")
    assert {n for n, _ in calls} == {n for names in KERNELS.values() for n in names}
    assert {impl for _, impl in calls} == {"interpret"}
    calls.clear()
    want, want_cache = run(model, tokens, "xla")
    assert not calls
    assert rel_err(got, want) < 1e-4
    for g, w in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        if jnp.issubdtype(g.dtype, jnp.floating):
            assert rel_err(g, w) < 1e-4
        else:
            np.testing.assert_array_equal(g, w)


def test_the_tpu_check_script_dry_run_passes(capsys, monkeypatch):
    """benchmarks/tpu_check.py off a TPU: every Mosaic kernel in TPU interpret mode at tiny shapes
    against its XLA path; all pass, and no `VERIFIED_ON_TPU` line is printed (not a TPU)."""
    from helpers.benchmarks import load_benchmark

    check = load_benchmark("tpu_check")
    monkeypatch.setattr(sys, "argv", ["tpu_check.py", "--reps", "1"])
    assert check.main() == 0
    out = capsys.readouterr().out
    assert "DRY RUN" in out and out.count(" ok ") == 7 and "VERIFIED_ON_TPU" not in out
