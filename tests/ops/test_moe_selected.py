"""The "selected" routed-expert form (a loop over the chosen experts only, each decoded where
it is used) and the native bf16 MXFP4 decode it runs on accelerators: both equal the other
forms exactly, on one device and under expert parallelism (8 fake CPU devices)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax import ops, sharding
from k31jax.ops import routed_experts, visit_selected_experts
from k31jax.quant import (MXFP4Weight, mxfp4_dequantize_packed, mxfp4_dequantize_packed_bf16,
                          mxfp4_quantize_packed, words_view)

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_packed_ref(packed, scale):
    """float64 from mx_formats.md: byte j holds element 2j (low nibble) and 2j+1; each block of
    32 elements times 2**(scale byte - 127); scale byte 0xFF is NaN."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    s = np.where(scale == 255, np.nan, np.exp2(scale.astype(np.float64) - 127))
    return E2M1[codes] * np.repeat(s, 32, axis=-1)


def _experts(e, i, ell, seed):
    rng = np.random.default_rng(seed)
    shapes = ((e, i, ell), (e, i, ell), (e, ell, i))
    return tuple(MXFP4Weight(*mxfp4_quantize_packed(jnp.asarray(rng.standard_normal(s) * 0.2, jnp.float32)))
                 for s in shapes)


def _routing(n, k, e, seed, repeat_expert=False):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    if repeat_expert:  # every token also picks expert 5: one group holds every token
        idx[:, 0] = 5
        idx[:, 1:] = np.where(idx[:, 1:] == 5, 6, idx[:, 1:])
    pw = rng.uniform(0.1, 1.0, (n, k))
    return jnp.asarray(idx, jnp.int32), jnp.asarray(pw / pw.sum(1, keepdims=True), jnp.float32)


def test_native_bf16_decode_equals_the_float64_reference():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 7, 48), dtype=np.uint8)          # every code, both nibbles
    scale = rng.integers(100, 160, (3, 7, 3), dtype=np.uint8)
    scale[0, 0, 0], scale[0, 0, 1], scale[1, 2, 2] = 255, 254, 2        # NaN, overflow to Inf, 2**-125
    got = np.asarray(jax.jit(mxfp4_dequantize_packed_bf16)(packed, scale)).astype(np.float64)
    with np.errstate(over="ignore"):  # 6 * 2**127 is Inf in bf16, as it should be
        want = dequantize_packed_ref(packed, scale).astype(jnp.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got).any() and np.isinf(got).any()
    # uint32 words (the accelerator layout) decode straight to the same values
    words = jax.jit(mxfp4_dequantize_packed_bf16)(words_view(jnp.asarray(packed)), scale)
    np.testing.assert_array_equal(np.asarray(words).astype(np.float64), got)
    # and the CPU integer form, which `mxfp4_dequantize_packed` runs here, agrees
    np.testing.assert_array_equal(np.asarray(mxfp4_dequantize_packed(packed, scale)).astype(np.float64), got)


@pytest.mark.parametrize("n,k,e", [(5, 3, 12), (1, 4, 9), (7, 2, 33)])
@pytest.mark.parametrize("repeat_expert", [False, True], ids=["random", "one-expert-for-all"])
def test_selected_equals_ragged_and_gather(n, k, e, repeat_expert):
    ell, i = 64, 96
    weights = _experts(e, i, ell, n + e)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((n, ell)), jnp.bfloat16)
    idx, pw = _routing(n, k, e, 2, repeat_expert)
    run = jax.jit(lambda form, *a: routed_experts(*a, form=form), static_argnums=0)
    want = np.asarray(run("ragged", x, idx, pw, *weights))
    np.testing.assert_array_equal(np.asarray(run("selected", x, idx, pw, *weights)), want)
    np.testing.assert_array_equal(np.asarray(run("gather", x, idx, pw, *weights)), want)
    assert np.abs(want).min(axis=1).max() > 0


def test_visit_selected_experts_visits_only_chosen_experts_and_keeps_each_rows_own_result():
    sizes = jnp.asarray([0, 3, 0, 1, 2, 0], jnp.int32)                   # rows sorted by expert
    rows = jnp.arange(6, dtype=jnp.float32)[:, None] * jnp.ones((1, 2))
    # expert e adds 100*e: a row taking another expert's result would show it
    out = visit_selected_experts(rows, sizes, 3, lambda x_w, e: x_w + 100.0 * e, 2, jnp.float32)
    want = np.asarray([[100, 100], [101, 101], [102, 102], [303, 303], [404, 404], [405, 405]], np.float32)
    np.testing.assert_array_equal(np.asarray(out), want)
    visited = []
    jax.jit(lambda r, s: visit_selected_experts(
        r, s, 3, lambda x_w, e: (jax.debug.callback(lambda v: visited.append(int(v)), e), x_w)[1], 2,
        jnp.float32))(rows, sizes).block_until_ready()
    assert visited == [1, 3, 4]


@pytest.mark.parametrize("mesh_spec", ["expert=8", "expert=4,tensor=2"])
def test_expert_parallel_selected_equals_ragged(mesh_spec):
    n, k, e, i, ell = 16, 2, 16, 64, 32
    x = jnp.asarray(np.random.default_rng(3).standard_normal((n, ell)), jnp.float32)
    idx, pw = _routing(n, k, e, 4)
    weights = _experts(e, i, ell, 5)
    mesh = sharding.make_mesh(mesh_spec)
    outs = {}
    with sharding.activate(mesh):
        plan = ops.make_ep_plan(n, weights, exchange="dense")
        for local in ("ragged", "selected"):
            outs[local] = np.asarray(jax.jit(lambda x, i, p, w, local=local: ops.ep_routed_experts(
                x, i, p, *w, plan=plan, local=local))(x, idx, pw, weights))
    # f32 rows: a per-expert dot and ragged_dot may sum in different orders
    np.testing.assert_allclose(outs["selected"], outs["ragged"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outs["ragged"], routed_experts(x, idx, pw, *weights, form="ragged"),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh_spec", [None, "expert=4,tensor=2"])
def test_model_in_the_accelerator_layout_read_by_row_equals_the_byte_model(mesh_spec):
    """The accelerator inference layout (`expert_words`: codes as words, scales tiled where a
    device's blocks are narrow) and the selected form, run on CPU, on one device and with the
    experts split over 8 devices (`w_down`'s blocks split over `tensor`): prefill then decode
    give the byte model's logits exactly."""
    from flax import nnx

    from k31jax import K31ForCausalLM, ModelConfig
    from k31jax.distributed import shard_model
    from k31jax.nn import expert_words
    from k31jax.ops import Backends

    # widths whose scales take the tiled layout: w_down [16, 512, 256] holds 8 scale blocks a
    # row (4 a device under tensor=2), w_gate / w_up [16, 256, 512] 16
    cfg = ModelConfig.preset("tiny").replace(expert_weights="mxfp4", moe_intermediate_size=256,
                                             routed_expert_hidden_size=512)
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    mesh = sharding.make_mesh(mesh_spec) if mesh_spec else None
    if mesh is not None:
        model = shard_model(model, mesh)
    graphdef, state = nnx.split(model)
    words = expert_words(state)
    moe = words["moe"]
    assert moe["w_gate"]["packed"].get_value().dtype == jnp.uint32
    down = moe["w_down"]["scale"].get_value()
    splits = 2 if mesh else 1  # w_down's 8 blocks a row over `tensor`: 512 x 8 / splits bytes a device
    assert down.dtype == jnp.uint16 and down.shape[-3:] == (splits, 512 * 8 // splits // 256, 128)
    # with the intermediate split over `tensor`, w_gate's scale rows are split: left as bytes
    assert moe["w_gate"]["scale"].get_value().dtype == (jnp.uint8 if mesh else jnp.uint16)
    if mesh is not None:  # each device holds its own blocks' part
        assert down.sharding.spec[-3] == "tensor" and down.sharding.spec[1] == "expert"

    def run(st, backends):
        m = nnx.merge(graphdef, st)
        cache = m.init_cache(batch=2, max_len=32)
        tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 9)), jnp.int32)
        step = jax.jit(lambda t, c: m(t, c, backends=backends))
        prefill = step(tokens, cache)
        decode = step(tokens[:, :1], prefill.cache)
        return np.asarray(prefill.logits, np.float32), np.asarray(decode.logits, np.float32)

    with sharding.activate(mesh) if mesh is not None else contextlib.nullcontext():
        want = run(state, Backends(moe="auto"))
        # the selected form reads one expert's scales, the others whole layers (prefill)
        got = {form: run(words, Backends(moe=form)) for form in ("selected", "ragged", "auto")}
    for form in got:
        for g, w in zip(got[form], want):
            np.testing.assert_allclose(g, w, rtol=0, atol=2e-5, err_msg=form)
