"""The Pallas TPU (Mosaic) KDA chunked forward: in TPU interpret mode on CPU against the float64
recurrence written from the spec (kda.md §4) and the XLA chunked op, through the op's seam (with
the XLA path's gradient), per device under a mesh of 8 CPU devices, in the model's prefill, and
compiled by libtpu for v5e / v5p / v6e / tpu7x (skipped with the reason without it).

Awkward cases: T not a multiple of the chunk (45 and 130 tokens), a single token, every chunk
size, no initial state, head widths that are not a multiple of 128 (16, 24, 130: zero-padded in
the launch), a batch of 1, gates down to −30 (a channel decayed to nothing within a tile: the
diagonal tiles' explicit decay), bf16 inputs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_kda_tpu import f64_ref, inputs, needs_libtpu, rel_err

from k31jax import aot
from k31jax.kernels.kda_chunk import mosaic_kda_chunk
from k31jax.ops import _kda


@pytest.mark.parametrize("b,t,h,dk,dv,chunk,with_state", [
    (1, 1, 2, 16, 8, 16, False),     # one token, a batch of 1, a fresh state
    (2, 45, 3, 16, 24, 16, True),    # T not a multiple of the chunk, three chunks
    (1, 130, 1, 130, 7, 64, True),   # dk padded to 256, dv to 128, a partial third chunk
    (1, 70, 2, 32, 32, 32, False),
    (1, 140, 1, 16, 16, 128, True),  # the largest chunk: eight tiles
])
def test_matches_float64_and_the_xla_op(b, t, h, dk, dv, chunk, with_state):
    q, k, v, g, beta, s0 = inputs(b * 1000 + t, b, t, h, dk, dv)
    state = s0 if with_state else np.zeros_like(s0)
    run = jax.jit(functools.partial(mosaic_kda_chunk.kda_chunk_tpu, chunk=chunk, interpret=True))
    o, s = run(q, k, v, g, beta, state)
    o_x, s_x = _kda.kda_chunked(q, k, v, g, beta, s0 if with_state else None, chunk, impl="xla")
    o_64, s_64 = f64_ref(q, k, v, g, beta, s0 if with_state else None)
    assert rel_err(o, o_64) < 2e-5 and rel_err(s, s_64) < 2e-5
    assert rel_err(o, o_x) < 2e-5 and rel_err(s, s_x) < 2e-5


def test_the_seam_runs_it_with_the_xla_paths_gradient():
    """`ops.kda_chunked(impl="interpret_tpu")`: bf16 inputs, no state; values as the XLA op,
    and gradients (`with_reference_grad`) equal to the XLA op's."""
    arrs = inputs(17, 2, 20, 2, 16, 16)
    q, k, v, g, beta = (jnp.asarray(a, jnp.bfloat16) for a in arrs[:5])
    s0 = jnp.asarray(arrs[5])
    o, s = _kda.kda_chunked(q, k, v, g, beta, None, 16, impl="interpret_tpu")
    o_x, s_x = _kda.kda_chunked(q, k, v, g, beta, None, 16, impl="xla")
    assert rel_err(o, o_x) < 1e-5 and rel_err(s, s_x) < 1e-5

    def grads(impl):
        def f(q_, v_, s_):
            o_, s_new = _kda.kda_chunked(q_, k, v_, g, beta, s_, 16, impl=impl)
            return jnp.sum(o_ * o_) + jnp.sum(s_new)
        return jax.grad(f, argnums=(0, 1, 2))(q.astype(jnp.float32), v.astype(jnp.float32), s0)

    for got, want in zip(grads("interpret_tpu"), grads("xla")):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_under_a_mesh_each_device_runs_its_rows_and_heads_with_the_tokens_whole():
    """On 8 CPU devices (rows over `expert`, heads over `tensor`), the opted-in kernel runs under
    `shard_map` on each device's rows and heads (`ops.per_device`), every token of them on the
    device, equal to the XLA op."""
    from k31jax import sharding

    q, k, v, g, beta, s0 = inputs(21, 4, 24, 4, 16, 16)
    mesh = sharding.make_mesh("expert=4,tensor=2")
    with sharding.activate(mesh):
        run = jax.jit(lambda *a: _kda.kda_chunked(*a, 16, impl="interpret_tpu"))
        jaxpr = str(jax.make_jaxpr(lambda *a: _kda.kda_chunked(*a, 16, impl="interpret_tpu"))(q, k, v, g, beta, s0))
        o, s = run(q, k, v, g, beta, s0)
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    assert "f32[1,24,2,16]" in jaxpr  # a device's slice: one row, all 24 tokens, two heads
    o_x, s_x = _kda.kda_chunked(q, k, v, g, beta, s0, 16, impl="xla")
    assert rel_err(o, o_x) < 2e-5 and rel_err(s, s_x) < 2e-5


def test_cost_estimate_counts_each_block_once():
    b, h, t, d, c = 2, 3, 256, 128, 64
    est = mosaic_kda_chunk.cost_estimate(b=b, h=h, t=t, dk=d, dv=d, chunk=c)
    per_chunk = c * (3 * d + d + h) + c * d  # q, k, g, v, β read; o written
    per_head = (t // c) * per_chunk + 2 * d * d  # the state read once and written once
    assert est.bytes_accessed == b * h * per_head * 4
    tiles = c // 16
    matmuls = 2 * (c * c * d + (tiles - 1) * 2 * 16 * c * d + tiles * 2 * 16 * 16 * c + 2 * c * c * d
                   + 3 * c * d * d + c * c * d)
    assert est.flops == b * h * (t // c) * (matmuls + tiles * 5 * 16 * 16 * d + 2 * c ** 3 + 2 * d * d)
    assert est.transcendentals == b * h * (t // c) * ((tiles - 1) * (16 + c) * d + tiles * 16 * 16 * d + 2 * c * d + d)


def test_bad_inputs_are_one_clear_error():
    q, k, v, g, beta, s0 = (jnp.asarray(a) for a in inputs(3, 1, 5, 2, 16, 8))
    with pytest.raises(ValueError, match=r"state has shape \(1, 2, 8, 16\), expected \(1, 2, 16, 8\)"):
        mosaic_kda_chunk.kda_chunk_tpu(q, k, v, g, beta, jnp.swapaxes(s0, -1, -2), interpret=True)
    with pytest.raises(ValueError, match="beta has shape"):
        mosaic_kda_chunk.kda_chunk_tpu(q, k, v, g, beta[..., :1], s0, interpret=True)
    with pytest.raises(ValueError, match=r"chunk=48 not in \(16, 32, 64, 128\)"):
        mosaic_kda_chunk.kda_chunk_tpu(q, k, v, g, beta, s0, chunk=48, interpret=True)


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"])
def test_compiles_for_tpu_moving_the_estimated_bytes(topology):
    """libtpu compiles the launch at one K3.1 Pro device's prefill shapes (a 1,024-token row,
    4 heads of 128 x 128, chunks of 64): the donated state is updated in place, and the
    kernel's traffic in the compile report is exactly its BlockSpec cost estimate (A, W and U
    never leave VMEM)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from k31jax.kernels import target_tpu

    mesh = Mesh(np.asarray(aot.tpu_devices(topology)[:1]), ("x",))
    rep = NamedSharding(mesh, P())
    b, t, h, d, c = 1, 1024, 4, 128, 64

    def spec(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep)

    with target_tpu():
        compiled = jax.jit(functools.partial(mosaic_kda_chunk.kda_chunk_tpu, chunk=c), donate_argnums=5).lower(
            spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h),
            spec(b, h, d, d)).compile()
    text = compiled.as_text()
    assert "kda_chunk_tpu" in text
    assert compiled.memory_analysis().alias_size_in_bytes == b * h * d * d * 4
    est = mosaic_kda_chunk.cost_estimate(b, h, t, d, d, c)
    kernel = [moved for moved, name in aot.analyse(text).traffic if name.endswith("kda_chunk_tpu/pallas_call")]
    assert kernel == [est.bytes_accessed]


def test_model_prefill_with_the_kernel_equals_the_xla_paths():
    """The tiny model on 8 CPU devices (rows over `expert`, heads over `tensor`): a 20-token
    prefill (two chunks and a part) and a 5-token continuation from its cache whose KDA layers
    run the Mosaic chunked forward in TPU interpret mode (`kernels="interpret_tpu"`) give the
    XLA paths' logits and states. Four layers (three KDA): the interpreter is slow."""
    from flax import nnx

    from k31jax import K31ForCausalLM, ModelConfig, sharding
    from k31jax.distributed import shard_model
    from k31jax.ops import Backends

    tiny = ModelConfig.preset("tiny")
    cfg = tiny.replace(num_hidden_layers=4, layer_types=tiny.layer_types[:4], kda_chunk_size=16)
    assert cfg.layer_types.count("kda") == 3
    mesh = sharding.make_mesh("expert=4,tensor=2")
    graphdef, state = nnx.split(shard_model(K31ForCausalLM(cfg, rngs=nnx.Rngs(0)), mesh))
    tokens = jnp.asarray(np.random.default_rng(6).integers(1, cfg.vocab_size, (4, 25)), jnp.int32)

    @functools.partial(jax.jit, static_argnums=1)
    def run(st, kernels):
        model = nnx.merge(graphdef, st)
        first = model(tokens[:, :20], model.init_cache(4, 32), backends=Backends(kernels=kernels))
        more = model(tokens[:, 20:], first.cache, backends=Backends(kernels=kernels))
        return first.logits, more.logits, more.cache.kda_state

    with sharding.activate(mesh):
        got, want = run(state, "interpret_tpu"), run(state, "xla")
        traced = str(jax.make_jaxpr(run.__wrapped__, static_argnums=1)(state, "interpret_tpu"))
    assert traced.count("name=kda_chunk_tpu") >= 2  # in both calls (layers in a scan trace once)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-5, atol=2e-5)
