"""Whole-model properties on tiny configs: cached prefill + decode == full forward, scan ==
unrolled, padding is exact, bf16 tracks f32."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.model import kimi_linear_tiny_config, tiny_config
from k31jax import Backends
from k31jax.nn import MLAMixer, unstack_layers

GATHER = Backends(sparse="gather")  # the selected-rows attention in prefill too

forward = nnx.jit(lambda m, t, c: m(t, c))


def _tokens(b, t, vocab, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


CONFIGS = {
    "tiny_dsa": lambda: tiny_config(),
    "tiny_dense_mla": lambda: tiny_config(index_topk=None, index_n_heads=0, index_head_dim=0),
    "kimi_linear": lambda: kimi_linear_tiny_config(),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_then_decode_equals_full_forward(name, make_model):
    cfg = CONFIGS[name]()
    model = make_model(cfg)
    tokens = _tokens(2, 50, cfg.vocab_size)
    full = forward(model, tokens, None).logits
    out = forward(model, tokens[:, :45], model.init_cache(2, 64))
    np.testing.assert_allclose(out.logits, full[:, :45], rtol=1e-4, atol=1e-4 * float(jnp.abs(full).max()))
    for i in range(45, 50):
        out = forward(model, tokens[:, i:i + 1], out.cache)
        np.testing.assert_allclose(out.logits[:, 0], full[:, i], rtol=1e-4, atol=1e-4 * float(jnp.abs(full).max()))
    assert int(out.cache.pos) == 50


def test_indexer_is_active_in_tiny(make_model):
    """With index_topk (8) < T the DSA layers attend to fewer tokens, so logits change."""
    cfg = tiny_config()
    assert cfg.index_topk < 50
    dsa = make_model(cfg)
    dense = make_model(cfg.replace(index_topk=10_000))
    tokens = _tokens(1, 50, cfg.vocab_size)
    a = forward(dsa, tokens, None).logits
    b = forward(dense, tokens, None).logits
    np.testing.assert_array_equal(a[:, :8], b[:, :8])  # first k positions: every key selected
    assert float(jnp.abs(a[:, 20:] - b[:, 20:]).max()) > 1e-3


def test_indexer_prefill_streams_key_blocks(make_model, monkeypatch):
    """Prefill scores the indexer keys in blocks (running top-k) once the context exceeds
    `MLAMixer.index_key_block`: same selections, so the same logits, as scoring them at once;
    cached prefill in two chunks too."""
    cfg = tiny_config()
    model = make_model(cfg)
    tokens = _tokens(2, 37, cfg.vocab_size, seed=5)
    run = nnx.jit(lambda m, t, c: m(t, c, backends=GATHER))
    whole = run(model, tokens, None).logits
    prefill = run(model, tokens[:, :20], model.init_cache(2, 40))
    first, rest = prefill.logits, run(model, tokens[:, 20:], prefill.cache).logits
    from k31jax.nn import _mla_layer

    blocks = []
    select = _mla_layer.select_topk

    def spy(*a, **kw):
        blocks.append(a[6] if len(a) > 6 else kw.get("key_block"))
        return select(*a, **kw)

    monkeypatch.setattr(_mla_layer, "select_topk", spy)
    monkeypatch.setattr(MLAMixer, "index_key_block", 6)  # 37 keys: 7 blocks, the last one short
    blocked = nnx.jit(lambda m, t, c: m(t, c, backends=GATHER))(model, tokens, None).logits
    prefill = nnx.jit(lambda m, t, c: m(t, c, backends=GATHER))(model, tokens[:, :20], model.init_cache(2, 40))
    first_b = prefill.logits
    rest_b = nnx.jit(lambda m, t, c: m(t, c, backends=GATHER))(model, tokens[:, 20:], prefill.cache).logits
    assert set(blocks) == {6}  # every prefill call streamed (traced once per jit)
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jnp.concatenate([first_b, rest_b], 1), jnp.concatenate([first, rest], 1),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jnp.concatenate([first, rest], 1), whole, rtol=1e-4, atol=1e-4)


def test_scan_equals_unrolled(make_model):
    cfg = tiny_config()
    model = make_model(cfg)
    tokens = _tokens(2, 21, cfg.vocab_size)
    a = forward(model, tokens, None).logits
    b = nnx.jit(lambda m, t: m(t, None, scan_layers=False))(model, tokens).logits
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_decode_reads_the_layer_weights_in_place(make_model):
    """A cached call (prefill, decode) indexes the scanned layers' weights inside the scan; a
    slice of the stacks fed to the scan is a copy of the weights per call (it made the decode
    step read ~4x the weights and caches by XLA's cost model, and decode 6x slower)."""
    cfg = tiny_config()
    model = make_model(cfg)
    graphdef, state = nnx.split(model)
    cache = model.init_cache(2, 32)

    def decode(state, cache, token):
        return nnx.merge(graphdef, state)(token, cache)

    compiled = jax.jit(decode).lower(state, cache, jnp.ones((2, 1), jnp.int32)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    stored = sum(x.nbytes for x in jax.tree.leaves((state, cache)))
    assert cost["bytes accessed"] < 3 * stored, (cost["bytes accessed"], stored)


def _weight_row_copies(compiled) -> int:
    """Copy-only slice ops (no compute fused in) of the compiled entry computation whose
    operand is a model weight (a parameter of the argument named `weights`): on XLA:CPU each
    is a copy of a layer's row of a stack, made before a matmul reads it."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY"):]
    copies = 0
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%((?:wrapped_)?(?:dynamic-)?slice(?:_bitcast)?(?:_fusion)?)[.\d]* = .*?\((.*?)\)",
                     line)
        copies += bool(m and any(a.strip().startswith("%weights") for a in m.group(2).split(",")))
    return copies


def test_unstacked_layers_equal_the_stacks_and_read_weights_in_place(make_model):
    """`unstack_layers` (the engine's CPU form): prefill and decode equal the stacked, scanned
    model's, and the decode step takes no slice of a parameter, where the stacked step takes
    a row copy per layer and weight (XLA:CPU materialises each before its matmul)."""
    cfg = tiny_config()
    model = make_model(cfg)
    graphdef, state = nnx.split(model)
    rows = unstack_layers(state)
    assert unstack_layers(rows) is not rows and jax.tree.structure(unstack_layers(rows)) == jax.tree.structure(rows)
    call = jax.jit(lambda weights, t, c: nnx.merge(graphdef, weights)(t, c))
    tokens = _tokens(2, 23, cfg.vocab_size, seed=5)
    outs = {}
    for name, st in (("stacked", state), ("rows", rows)):
        out = call(st, tokens[:, :19], model.init_cache(2, 32))
        steps = [out.logits]
        for i in range(19, 23):
            out = call(st, tokens[:, i:i + 1], out.cache)
            steps.append(out.logits)
        outs[name] = jnp.concatenate(steps, axis=1)
    np.testing.assert_allclose(outs["rows"], outs["stacked"], rtol=1e-6, atol=1e-6)
    token, cache = jnp.ones((2, 1), jnp.int32), model.init_cache(2, 32)
    copies = {name: _weight_row_copies(call.lower(st, token, cache).compile())
              for name, st in (("stacked", state), ("rows", rows))}
    assert copies["rows"] == 0 and copies["stacked"] > cfg.num_hidden_layers, copies


def test_left_padding_is_exact(make_model):
    """A left-padded row gives the same logits as the unpadded sequence alone."""
    cfg = tiny_config()
    model = make_model(cfg)
    short = _tokens(1, 13, cfg.vocab_size, seed=3)
    alone = forward(model, short, None).logits
    padded = jnp.concatenate([jnp.full((1, 7), 5, jnp.int32), short], axis=1)
    valid = jnp.concatenate([jnp.zeros((1, 7), bool), jnp.ones((1, 13), bool)], axis=1)
    c = model.init_cache(1, 32)
    out = nnx.jit(lambda m, t, v, c: m(t, c, valid=v))(model, padded, valid, c)
    np.testing.assert_allclose(out.logits[:, 7:], alone, rtol=1e-5, atol=1e-5)
    nxt = _tokens(1, 1, cfg.vocab_size, seed=4)
    ref = forward(model, jnp.concatenate([short, nxt], 1), None).logits
    step = forward(model, nxt, out.cache).logits
    np.testing.assert_allclose(step[:, 0], ref[:, -1], rtol=1e-4, atol=1e-4)


def test_bf16_tracks_f32(make_model):
    """bf16 parameters and activations stay within bf16 tolerance of f32.

    Routing and top-k selection are discrete: in a random tiny model a 1% perturbation flips
    some expert choices, and each flip changes that token's output wholesale. To measure the
    arithmetic alone, routing is pinned (a bias that decides the experts) and the indexer is
    off; errors then grow about 1% per layer over the 13 layers.
    """
    cfg = tiny_config(index_topk=None, index_n_heads=0, index_head_dim=0)
    model32 = make_model(cfg)
    n_moe, n_exp = model32.moe.gate_bias[...].shape
    model32.moe.gate_bias[...] = jnp.broadcast_to(-2.0 * jnp.arange(n_exp, dtype=jnp.float32), (n_moe, n_exp))
    model16 = make_model(cfg.replace(dtype="bfloat16"))
    st32 = nnx.state(model32, nnx.Param)
    st16 = nnx.state(model16, nnx.Param)
    nnx.update(model16, jax.tree.map(lambda a, b: a.astype(b.dtype), st32, st16))
    assert model16.kda.q_proj[...].dtype == jnp.bfloat16 and model16.kda.a_log[...].dtype == jnp.float32
    tokens = _tokens(2, 30, cfg.vocab_size)
    run = nnx.jit(lambda m, t: m(t, None, return_intermediates=True))
    out32, out16 = run(model32, tokens), run(model16, tokens)
    a, ia, b, ib = out32.logits, out32.intermediates, out16.logits, out16.intermediates
    assert b.dtype == jnp.float32 and ib["partial_sum"].dtype == jnp.bfloat16
    first = float(jnp.abs(ia["partial_sum"][0] - ib["partial_sum"][0]).max() / jnp.abs(ia["partial_sum"][0]).max())
    assert first < 2e-2, first  # one layer: bf16 rounding only
    rel = float(jnp.abs(a - b).max() / jnp.abs(a).max())
    assert rel < 0.15, rel
    assert float(jnp.mean(jnp.argmax(a, -1) == jnp.argmax(b, -1))) >= 0.9


def test_intermediates_have_layer_axis(make_model):
    cfg = tiny_config()
    model = make_model(cfg)
    inter = nnx.jit(lambda m, t: m(t, None, return_intermediates=True))(model, _tokens(1, 9, cfg.vocab_size)).intermediates
    assert inter["attn_out"].shape == (cfg.num_hidden_layers, 1, 9, cfg.hidden_size)
    assert inter["router_idx"].shape == (cfg.num_hidden_layers, 1, 9, cfg.num_experts_per_token)
    # the dense layer routes nothing; MoE layers choose distinct experts
    assert int(jnp.abs(inter["router_idx"][0]).sum()) == 0
    for layer in cfg.moe_layers:
        ids = np.asarray(inter["router_idx"][layer]).reshape(-1, cfg.num_experts_per_token)
        assert all(len(set(r)) == len(r) for r in ids)
