"""Expert-parallel MoE on 8 fake CPU devices: the exchange implementations move identical
bytes, agree exactly end to end, equal the single-device experts, and never drop a token."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax import ops
from k31jax import sharding
from k31jax.ops import routed_experts
from k31jax.ops._moe import MXFP4Weight
from k31jax.quant import mxfp4_quantize_packed
from k31jax.ops import ragged_exchange

CPU_EXCHANGES = ("dense", "allgather")


def _ragged_reference(operands, outputs, in_off, send, out_off):
    """NumPy ragged_all_to_all over P devices: what every device's output should be."""
    outs = [o.copy() for o in outputs]
    p = len(operands)
    for s in range(p):
        for d in range(p):
            n = send[s][d]
            outs[d][out_off[s][d]:out_off[s][d] + n] = operands[s][in_off[s][d]:in_off[s][d] + n]
    return outs


@pytest.mark.parametrize("exchange", CPU_EXCHANGES)
def test_exchange_matches_ragged_all_to_all_semantics(exchange):
    p, a, cap = 8, 6, 40
    rng = np.random.default_rng(0)
    # send[s, d]: rows s sends d; each sender sends at most its a rows, some peers get none
    send = np.stack([rng.multinomial(rng.integers(0, a + 1), [1 / p] * p) for _ in range(p)])
    in_off = np.cumsum(send, 1) - send
    gap = rng.integers(0, 2, (p, p))           # receivers leave gaps: offsets are the sender's choice
    out_off = np.cumsum(send + gap, 0) - (send + gap)
    assert (out_off + send).max() <= cap
    operands = rng.standard_normal((p, a, 3)).astype(np.float32)
    outputs = np.full((p, cap, 3), -7.0, np.float32)
    want = _ragged_reference(list(operands), list(outputs), in_off, send, out_off)

    mesh = sharding.make_mesh(expert=8)
    spec = jax.P("expert")
    f = jax.shard_map(lambda o, out, io, ss, oo, rs: ragged_exchange(o[0], out[0], io[0], ss[0], oo[0], rs[0],
                                                                       axis_name="expert", exchange=exchange)[None],
                      mesh=mesh, in_specs=(spec,) * 6, out_specs=spec, check_vma=False)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    got = jax.jit(f)(operands, outputs, i32(in_off), i32(send), i32(out_off), i32(send.T))
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))


def _experts(e, i, ell, seed, mxfp4):
    rng = np.random.default_rng(seed)
    ws = [rng.standard_normal(s).astype(np.float32) * 0.2 for s in ((e, i, ell), (e, i, ell), (e, ell, i))]
    if not mxfp4:
        return tuple(jnp.asarray(w) for w in ws)
    return tuple(MXFP4Weight(*mxfp4_quantize_packed(jnp.asarray(w))) for w in ws)


def _run_ep(mesh_spec, x, idx, pw, weights, exchange, rules=None):
    mesh = sharding.make_mesh(mesh_spec)
    with sharding.activate(mesh, rules):
        plan = ops.make_ep_plan(x.shape[0], weights, exchange=exchange)
        assert plan is not None
        out = jax.jit(lambda x, i, p, w: ops.ep_routed_experts(x, i, p, *w, plan=plan))(x, idx, pw, weights)
    return np.asarray(out), plan


def _routing(n, k, e, seed, adversarial=False):
    rng = np.random.default_rng(seed)
    if adversarial:  # every token picks the same experts: one device gets every row
        idx = np.tile(np.arange(3, 3 + k), (n, 1))
    else:
        idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    pw = rng.uniform(0.1, 1.0, (n, k))
    return jnp.asarray(idx, jnp.int32), jnp.asarray(pw / pw.sum(1, keepdims=True), jnp.float32)


@pytest.mark.parametrize("mesh_spec,mxfp4", [("expert=8", False), ("expert=4,tensor=2", True),
                                             ("data=2,expert=2,tensor=2", True)])
@pytest.mark.parametrize("adversarial", [False, True], ids=["random", "all-to-one-expert"])
def test_exchanges_agree_exactly_and_drop_nothing(mesh_spec, mxfp4, adversarial):
    n, k, e, i, ell = 32, 2, 16, 64, 32
    x = jnp.asarray(np.random.default_rng(1).standard_normal((n, ell)), jnp.float32)
    idx, pw = _routing(n, k, e, 2, adversarial)
    weights = _experts(e, i, ell, 3, mxfp4)
    single = np.asarray(routed_experts(x, idx, pw, *weights, form="ragged"))
    outs = {}
    for ex in CPU_EXCHANGES:
        outs[ex], plan = _run_ep(mesh_spec, x, idx, pw, weights, ex)
        assert plan.ep_size > 1 and plan.token_axes  # tokens really are split and exchanged
    np.testing.assert_array_equal(outs["dense"], outs["allgather"])
    np.testing.assert_allclose(outs["dense"], single, rtol=1e-5, atol=1e-6)
    assert np.abs(single).min(axis=1).max() > 0  # every token got a non-zero result


def test_tensor_split_finer_than_mxfp4_blocks():
    """Intermediate 96 split over tensor=2 (48-wide shards, 32-blocks straddle devices): the
    replicated scales are looked up per column."""
    n, k, e, i, ell = 16, 2, 8, 96, 32
    x = jnp.asarray(np.random.default_rng(4).standard_normal((n, ell)), jnp.float32)
    idx, pw = _routing(n, k, e, 5)
    weights = _experts(e, i, ell, 6, True)
    out, plan = _run_ep("expert=4,tensor=2", x, idx, pw, weights, "dense")
    assert plan.tp_size == 2 and not plan.scale_split
    np.testing.assert_allclose(out, routed_experts(x, idx, pw, *weights, form="ragged"), rtol=1e-5, atol=1e-6)


def test_no_plan_without_a_mesh_or_with_unsplit_experts():
    weights = _experts(16, 64, 32, 0, False)
    assert ops.make_ep_plan(8, weights) is None
    mesh = sharding.make_mesh(data=8)
    with sharding.activate(mesh):
        assert ops.make_ep_plan(8, weights) is None


@pytest.mark.gpu
def test_ragged_all_to_all_equals_the_cpu_exchanges():
    """On GPU/TPU: the `ragged_all_to_all` exchange gives bit-identical results."""
    if jax.devices()[0].platform == "cpu":
        pytest.skip("XLA:CPU has no ragged-all-to-all")
    n_dev = len(jax.devices())
    if n_dev < 2 or 16 % n_dev:
        pytest.skip("needs 2, 4, 8 or 16 accelerators")
    n, k, e, i, ell = 32, 2, 16, 64, 32
    x = jnp.asarray(np.random.default_rng(1).standard_normal((n, ell)), jnp.bfloat16)
    idx, pw = _routing(n, k, e, 2)
    weights = _experts(e, i, ell, 3, True)
    spec = f"expert={n_dev}"
    a, _ = _run_ep(spec, x, idx, pw, weights, "ragged")
    b, _ = _run_ep(spec, x, idx, pw, weights, "dense")
    np.testing.assert_array_equal(a, b)


def test_exchange_rounds_divide_the_tokens_and_bound_the_receive_buffer():
    assert ops.exchange_rounds(1024, 16, 8, 3584) == 4           # a 64 x 1,024 micro-batch on 64 shards
    assert ops.exchange_rounds(256, 16, 8, 3584) == 1            # a 2,048-token prefill chunk on 8
    assert ops.exchange_rounds(1024, 16, 1, 3584) == 1           # no expert parallelism: no worst case
    for tokens in (1, 7, 12, 45, 1000):
        for budget in (1, 4 * 32 * 4, 10_000, 2**40):
            r = ops.exchange_rounds(tokens, 3, 4, 32, budget)
            assert tokens % r == 0
            fits = 4 * (tokens // r) * 3 * 32 * 4 <= budget
            assert fits or r == tokens                            # bounded, or one token a round
            assert r == 1 or not any(4 * (tokens // s) * 3 * 32 * 4 <= budget
                                     for s in range(1, r) if tokens % s == 0)  # and the fewest


@pytest.mark.parametrize("mesh_spec,adversarial,fake_quant", [
    ("expert=4,tensor=2", False, True), ("expert=4,tensor=2", True, False), ("data=2,expert=4", False, False)],
    ids=["qat", "all-to-one-expert", "data-parallel"])
def test_exchange_in_rounds_equals_one_round_values_and_gradients(mesh_spec, adversarial, fake_quant):
    """Splitting a device's 15 tokens into 3 or 5 rounds: the same outputs and input
    gradients exactly, the expert gradients up to the order of their fp32 sums."""
    n, k, e, i, ell = 60, 3, 16, 64, 32
    x = jnp.asarray(np.random.default_rng(7).standard_normal((n, ell)), jnp.float32)
    idx, pw = _routing(n, k, e, 8, adversarial)
    weights = _experts(e, i, ell, 9, False)
    mesh = sharding.make_mesh(mesh_spec)
    results = {}
    with sharding.activate(mesh):
        plan = ops.make_ep_plan(n, weights, exchange="dense")
        tokens = n // math.prod(dict(mesh.shape)[a] for a in plan.token_axes)
        row = plan.ep_size * k * ell * 4                          # one token's worst-case receive bytes
        for budget in (2**40, row * tokens // 3, row * tokens // 5):
            rounds = ops.exchange_rounds(tokens, k, plan.ep_size, ell, budget)

            def loss(x, w, budget=budget):
                y = ops.ep_routed_experts(x, idx, pw, *w, plan=plan, local="ragged", round_bytes=budget,
                                          weight_fake_quant=fake_quant)
                return jnp.sum(y * jnp.cos(y)), y

            step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
            scans = re.findall(r"length=(\d+)", str(jax.make_jaxpr(step)(x, weights)))
            assert (str(rounds) in scans) == (rounds > 1)           # the rounds really are a loop
            (_, y), grads = step(x, weights)
            results[rounds] = (y, grads)
    assert sorted(results) == [1, 3, 5]
    y1, (gx1, gw1) = results[1]
    for r in (3, 5):
        y, (gx, gw) = results[r]
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y1))
        np.testing.assert_array_equal(np.asarray(gx), np.asarray(gx1))
        for a, b in zip(gw, gw1):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("mesh_spec,rounds_budget", [("expert=4,tensor=2", 2**40), ("expert=4,tensor=2", 3),
                                                     ("data=2,expert=4", 5)], ids=["one-round", "3-rounds", "dp"])
def test_expert_adapters_under_expert_parallelism(mesh_spec, rounds_budget):
    """LoRA factors beside packed experts, split with them (the intermediate over the tensor
    axis): outputs and the adapters' gradients equal the single-device ragged form's, in one
    exchange round or several."""
    n, k, e, i, ell, r = 40, 3, 16, 64, 32, 4
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((n, ell)), jnp.float32)
    idx, pw = _routing(n, k, e, 12)
    weights = _experts(e, i, ell, 13, True)
    adapters = tuple(ops.ExpertAdapter(jnp.asarray(rng.standard_normal((e, out, r)) * 0.2, jnp.float32),
                                       jnp.asarray(rng.standard_normal((e, r, inp)) * 0.2, jnp.float32))
                     for out, inp in ((i, ell), (i, ell), (ell, i)))

    def loss(fn):
        def f(x, ads):
            y = fn(x, ads)
            return jnp.sum(y * jnp.cos(y)), y
        return jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))

    (_, want), (gx_want, ga_want) = loss(lambda x, ads: routed_experts(x, idx, pw, *weights, form="ragged",
                                                                     adapters=ads))(x, adapters)
    mesh = sharding.make_mesh(mesh_spec)
    with sharding.activate(mesh):
        plan = ops.make_ep_plan(n, weights, exchange="dense")
        tokens = n // math.prod(dict(mesh.shape)[a] for a in plan.token_axes)
        budget = rounds_budget if rounds_budget > 100 else plan.ep_size * k * ell * 4 * tokens // rounds_budget
        assert (ops.exchange_rounds(tokens, k, plan.ep_size, ell, budget) > 1) == (rounds_budget < 100)
        (_, got), (gx, ga) = loss(lambda x, ads: ops.ep_routed_experts(x, idx, pw, *weights, plan=plan, round_bytes=budget,
                                                                     adapters=ads))(x, adapters)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_want), rtol=1e-4, atol=1e-5)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(ga_want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))
    plain = np.asarray(routed_experts(x, idx, pw, *weights, form="ragged"))
    assert np.abs(plain - np.asarray(want)).max() > 1e-2  # the adapters matter here
