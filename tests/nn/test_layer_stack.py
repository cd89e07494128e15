"""The layer stack (`k31jax.nn._layer_stack.run_layers`): the groups it scans, and every way it
reaches a layer's weights (scan-input slices, indexed stacks under remat or with a cache,
unrolled rows, `unstack_layers` tuples, per-head projections held transposed by
`out_major_projections`) gives the same numbers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from helpers.model import tiny_config

from k31jax import ModelConfig
from k31jax import sharding
from k31jax.nn import INTERMEDIATES, OUT_MAJOR_PROJECTIONS, OutMajor, out_major_projections, unstack_layers
from k31jax.nn._layer_stack import LayerGroups, layer_groups


def test_k3_scans_22_groups_of_4_layers_from_layer_1():
    assert layer_groups(ModelConfig.preset("k3")) == LayerGroups(start=1, period=4, count=22)


def test_every_way_of_reaching_the_weights_gives_the_same_numbers(make_model):
    cfg = tiny_config()
    graphdef, state = nnx.split(make_model(cfg))
    groups = layer_groups(cfg)
    assert groups.count >= 2 and groups.start + groups.period * groups.count <= cfg.num_hidden_layers
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def hidden(st, scan, remat):
        out = nnx.merge(graphdef, st).hidden_states(tokens, scan_layers=scan, remat=remat, collect=INTERMEDIATES)
        return out.hidden, out.intermediates

    want = hidden(state, True, "none")  # the scan's inputs are each group's slices of the stacks
    for name, got in (("indexed under remat", hidden(state, True, "full")),
                      ("unrolled", hidden(state, False, "none")),
                      ("unstacked rows", hidden(unstack_layers(state), True, "none")),
                      ("out-major projections", hidden(out_major_projections(state), True, "none"))):
        # a matmul reading a transposed weight may sum in another order (XLA:CPU): f32 rounding
        tol = 1e-5 if name.startswith("out-major") else 1e-6
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)

    @functools.partial(jax.jit, static_argnums=1)
    def decode(st, scan):  # with a cache: indexed stacks in the scan, MLA caches written in place
        model = nnx.merge(graphdef, st)
        prefill = model(tokens[:, :10], model.init_cache(2, 16), scan_layers=scan)
        step = model(tokens[:, 10:], prefill.cache, scan_layers=scan)
        return step.logits, step.cache

    want = decode(state, True)
    for name, got in (("unrolled", decode(state, False)), ("unstacked rows", decode(unstack_layers(state), True)),
                      ("out-major projections", decode(out_major_projections(state), True))):
        tol = 1e-5 if name.startswith("out-major") else 1e-6
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=tol, err_msg=name)


def test_out_major_projections_hold_each_stack_transposed_and_sharded_to_match(make_model):
    """On 8 CPU devices (heads split over `tensor`), each stack of `OUT_MAJOR_PROJECTIONS` is
    held `[n, out, in]` with its sharding moved with its axes, the other weights untouched, and
    prefill then decode give the standard state's numbers; rows (`unstack_layers`) are left."""
    from k31jax.distributed import shard_model

    cfg = tiny_config()
    mesh = sharding.make_mesh("expert=4,tensor=2")
    graphdef, state = nnx.split(shard_model(make_model(cfg), mesh))
    out_major = out_major_projections(state)
    for stack, names in OUT_MAJOR_PROJECTIONS.items():
        for name in names:
            a, held = state[stack][name].get_value(), out_major[stack][name].get_value()
            assert isinstance(held, OutMajor) and held.t.shape == a.shape[:-2] + a.shape[:-3:-1]
            spec = tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
            assert "tensor" in spec, (stack, name, spec)  # the heads axis is split: the test means something
            assert held.t.sharding.spec == jax.sharding.PartitionSpec(*spec[:-2], spec[-1], spec[-2])
            np.testing.assert_array_equal(held[...], a)
    assert out_major["mla"]["o_proj"].get_value() is state["mla"]["o_proj"].get_value()
    rows = unstack_layers(state)
    kept = out_major_projections(rows)["mla"]["q_b_proj"].get_value()
    assert isinstance(kept, tuple) and all(r is k for r, k in zip(rows["mla"]["q_b_proj"].get_value(), kept))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)

    @jax.jit
    def decode(st):
        model = nnx.merge(graphdef, st)
        prefill = model(tokens[:, :6], model.init_cache(2, 16))
        return prefill.logits, model(tokens[:, 6:], prefill.cache).logits

    with sharding.activate(mesh):
        want, got = decode(state), decode(out_major)
    for a, b in zip(got, want):  # f32; a transposed weight's matmul may sum in another order
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
