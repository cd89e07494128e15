"""The Pallas TPU (Mosaic) KDA decode step: in TPU interpret mode on CPU against the float64
recurrence written from the spec (kda.md §4) and the XLA op, through the op's seam (with the
XLA path's gradient), per device under a mesh of 8 CPU devices, and compiled by libtpu for
v5e / v5p / v6e / tpu7x (skipped with the reason without it).

Awkward cases: one token and several (T = 3, not a multiple of the 8-row tile), no initial
state, head widths that are not a multiple of 128 (16, 24, 130: zero-padded in the launch), a
batch of 1, gates down to −30 (a channel decayed to nothing), bf16 inputs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import refs as R
from k31jax import aot
from k31jax.kernels.kda_chunk import mosaic_kda
from k31jax.ops import _kda

needs_libtpu = pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu not installed (pip install 'k31jax[tpu]')")


def inputs(seed, b, t, h, dk, dv):
    rng = np.random.default_rng(seed)
    q = R.l2_normalize(rng.standard_normal((b, t, h, dk))) * dk ** -0.5
    k = R.l2_normalize(rng.standard_normal((b, t, h, dk)))
    v = rng.standard_normal((b, t, h, dv))
    g = -np.exp(rng.uniform(-2, 1, (b, t, h, dk)))
    g[:, :, 0, :3] = -30.0
    beta = R.sigmoid(rng.standard_normal((b, t, h)))
    s0 = rng.standard_normal((b, h, dk, dv)) * 0.5
    return [np.asarray(a, np.float32) for a in (q, k, v, g, beta, s0)]


def f64_ref(q, k, v, g, beta, s0):
    outs = [R.kda_recurrent(*(np.asarray(a, np.float64)[i] for a in (q, k, v, g, beta)),
                            None if s0 is None else np.asarray(s0, np.float64)[i]) for i in range(q.shape[0])]
    return np.stack([o for o, _ in outs]), np.stack([s for _, s in outs])


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all()
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0))


@pytest.mark.parametrize("b,t,h,dk,dv,with_state", [
    (1, 1, 2, 16, 8, False),    # decode, a batch of 1, a fresh state
    (2, 3, 3, 16, 24, True),    # three tokens in one launch
    (1, 2, 1, 130, 7, True),    # dk padded to 256, dv to 128
])
def test_matches_float64_and_the_xla_op(b, t, h, dk, dv, with_state):
    q, k, v, g, beta, s0 = inputs(b * 100 + t, b, t, h, dk, dv)
    state = jnp.asarray(s0) if with_state else jnp.zeros_like(s0)
    o, s = jax.jit(lambda *a: mosaic_kda.kda_decode_tpu(*a, interpret=True))(q, k, v, g, beta, state)
    o_x, s_x = _kda.kda_recurrent(q, k, v, g, beta, s0 if with_state else None)
    o_64, s_64 = f64_ref(q, k, v, g, beta, s0 if with_state else None)
    assert rel_err(o, o_64) < 1e-5 and rel_err(s, s_64) < 1e-5
    assert rel_err(o, o_x) < 1e-6 and rel_err(s, s_x) < 1e-6


def test_the_seam_runs_it_with_the_xla_paths_gradient():
    """`ops.kda_recurrent(impl="interpret_tpu")`: bf16 inputs, no state; values as the XLA op,
    and gradients (`with_reference_grad`) equal to the XLA op's."""
    arrs = inputs(7, 2, 1, 2, 16, 16)
    q, k, v, g, beta = (jnp.asarray(a, jnp.bfloat16) for a in arrs[:5])
    s0 = jnp.asarray(arrs[5])
    o, s = _kda.kda_recurrent(q, k, v, g, beta, None, impl="interpret_tpu")
    o_x, s_x = _kda.kda_recurrent(q, k, v, g, beta, None, impl="xla")
    assert rel_err(o, o_x) < 1e-6 and rel_err(s, s_x) < 1e-6

    def loss(impl):
        def f(q_, v_, s_):
            o_, s_new = _kda.kda_recurrent(q_, k, v_, g, beta, s_, impl=impl)
            return jnp.sum(o_ * o_) + jnp.sum(s_new)
        return jax.grad(f, argnums=(0, 1, 2))(q.astype(jnp.float32), v.astype(jnp.float32), s0)

    for got, want in zip(loss("interpret_tpu"), loss("xla")):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_under_a_mesh_each_device_runs_its_rows_and_heads():
    """On 8 CPU devices (rows over `expert`, heads over `tensor`), an opted-in kernel runs under
    `shard_map` on each device's rows and heads (`ops.per_device`), equal to the XLA op."""
    from k31jax import sharding

    q, k, v, g, beta, s0 = inputs(11, 4, 1, 4, 16, 16)
    mesh = sharding.make_mesh("expert=4,tensor=2")
    with sharding.activate(mesh):
        run = jax.jit(lambda *a: _kda.kda_recurrent(*a, impl="interpret_tpu"))
        jaxpr = str(jax.make_jaxpr(lambda *a: _kda.kda_recurrent(*a, impl="interpret_tpu"))(q, k, v, g, beta, s0))
        o, s = run(q, k, v, g, beta, s0)
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    o_x, s_x = _kda.kda_recurrent(q, k, v, g, beta, s0, impl="xla")
    assert rel_err(o, o_x) < 1e-6 and rel_err(s, s_x) < 1e-6


def test_cost_estimate_counts_each_block_once():
    est = mosaic_kda.cost_estimate(b=8, h=12, t=1, dk=128, dv=128)
    per_head_read = 8 * (3 * 128 + 128) + 1 + 128 * 128  # q, k, g, v rows (8-row tile), beta, state
    per_head_written = 128 + 128 * 128                   # o row, state
    assert est.bytes_accessed == 8 * 12 * (per_head_read + per_head_written) * 4
    assert est.flops == 8 * 12 * (7 * 128 * 128 + 128) and est.transcendentals == 8 * 12 * 128


def test_bad_shapes_are_one_clear_error():
    q, k, v, g, beta, s0 = (jnp.asarray(a) for a in inputs(3, 1, 1, 2, 16, 8))
    with pytest.raises(ValueError, match=r"state has shape \(1, 2, 8, 16\), expected \(1, 2, 16, 8\)"):
        mosaic_kda.kda_decode_tpu(q, k, v, g, beta, jnp.swapaxes(s0, -1, -2), interpret=True)
    with pytest.raises(ValueError, match="beta has shape"):
        mosaic_kda.kda_decode_tpu(q, k, v, g, beta[..., :1], s0, interpret=True)


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"])
def test_compiles_for_tpu_updating_the_state_in_place(topology):
    """libtpu compiles the launch at one K3.1 Pro device's decode shapes (8 rows, 12 heads of
    128 x 128): the donated state is updated in place (aliased, no copy of it), and the compile
    report counts the kernel by its BlockSpec cost estimate."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from k31jax.kernels import target_tpu

    mesh = Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",))
    rep = NamedSharding(mesh, P())
    b, t, h, d = 8, 1, 12, 128

    def spec(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep)

    with target_tpu():
        compiled = jax.jit(mosaic_kda.kda_decode_tpu, donate_argnums=5).lower(
            spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h),
            spec(b, h, d, d)).compile()
    text = compiled.as_text()
    assert "kda_decode_tpu" in text
    state_bytes = b * h * d * d * 4
    assert compiled.memory_analysis().alias_size_in_bytes == state_bytes
    # temporaries: the launch's 8-row-padded token rows and their transposes (about 2 MB on
    # v5p, none on the others), never a copy of the state
    assert compiled.memory_analysis().temp_size_in_bytes < state_bytes // 3
    est = mosaic_kda.cost_estimate(b, h, t, d, d)
    report = aot.analyse(text)
    assert est.bytes_accessed <= report.hbm_bytes < 1.2 * est.bytes_accessed


def test_model_decode_with_the_kernel_equals_the_xla_paths():
    """The tiny model on 8 CPU devices (rows over `expert`, heads over `tensor`): prefill, then
    two decode steps whose KDA layers run the Mosaic step in TPU interpret mode
    (`kernels="interpret_tpu"`) give the XLA paths' logits and states. Four layers (three
    KDA): the interpreter is slow."""
    from flax import nnx

    from k31jax import K31ForCausalLM, ModelConfig, sharding
    from k31jax.distributed import shard_model
    from k31jax.ops import Backends

    tiny = ModelConfig.preset("tiny")
    cfg = tiny.replace(num_hidden_layers=4, layer_types=tiny.layer_types[:4])
    assert cfg.layer_types.count("kda") == 3
    mesh = sharding.make_mesh("expert=4,tensor=2")
    graphdef, state = nnx.split(shard_model(K31ForCausalLM(cfg, rngs=nnx.Rngs(0)), mesh))
    tokens = jnp.asarray(np.random.default_rng(5).integers(1, cfg.vocab_size, (4, 8)), jnp.int32)

    @functools.partial(jax.jit, static_argnums=1)
    def run(st, kernels):
        model = nnx.merge(graphdef, st)
        out = model(tokens[:, :6], model.init_cache(4, 16), backends=Backends(kernels="xla"))
        logits = []
        for i in (6, 7):
            out = model(tokens[:, i:i + 1], out.cache, backends=Backends(kernels=kernels))
            logits.append(out.logits)
        return logits, out.cache.kda_state

    with sharding.activate(mesh):
        got, want = run(state, "interpret_tpu"), run(state, "xla")
        traced = str(jax.make_jaxpr(run.__wrapped__, static_argnums=1)(state, "interpret_tpu"))
    assert traced.count("name=kda_decode_tpu") >= 2  # in each decode step (layers in a scan trace once)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)
