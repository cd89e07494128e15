"""The layer stack (`k31jax.nn._layer_stack.run_layers`): the groups it scans, and every way it
reaches a layer's weights (scan-input slices, indexed stacks under remat or with a cache,
unrolled rows, `unstack_layers` tuples) gives the same numbers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from helpers.model import tiny_config

from k31jax import ModelConfig
from k31jax.nn import INTERMEDIATES, unstack_layers
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
                      ("unstacked rows", hidden(unstack_layers(state), True, "none"))):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=name)

    @functools.partial(jax.jit, static_argnums=1)
    def decode(st, scan):  # with a cache: indexed stacks in the scan, MLA caches written in place
        model = nnx.merge(graphdef, st)
        prefill = model(tokens[:, :10], model.init_cache(2, 16), scan_layers=scan)
        step = model(tokens[:, 10:], prefill.cache, scan_layers=scan)
        return step.logits, step.cache

    want = decode(state, True)
    for name, got in (("unrolled", decode(state, False)), ("unstacked rows", decode(unstack_layers(state), True))):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
