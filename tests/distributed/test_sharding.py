"""Sharding on 8 fake CPU devices: sharded prefill + decode == single device, sharded init,
rule tables cover the full k31_pro model, and the memory planner's weight bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.model import randomize, tiny_config
from k31jax import Backends, K31ForCausalLM, ModelConfig, distributed, nn, sharding
from k31jax.nn import _ffn
from k31jax.ops import _moe_ep as _ep
from k31jax.distributed._plan import _param_leaves

B, T_PREFILL, MAX_LEN = 4, 18, 32


def _cfg(expert_weights, indexer):
    extra = {} if indexer else dict(index_topk=None, index_n_heads=0, index_head_dim=0)
    return tiny_config(expert_weights=expert_weights, **extra)


def _tokens(cfg):
    return jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T_PREFILL + 1)), jnp.int32)


def _prefill_decode(model, tokens, cache):
    step = nnx.jit(lambda m, t, c: m(t, c))
    prefill = step(model, tokens[:, :T_PREFILL], cache)
    decode = step(model, tokens[:, T_PREFILL:], prefill.cache)
    return prefill.logits, decode.logits, decode.cache


_REFS = {}


def _spec(x, ndim=None):
    """A sharding's spec padded with None to the array's rank (jax.P does not normalise)."""
    spec = tuple(x.sharding.spec if hasattr(x, "sharding") else x)
    ndim = ndim if ndim is not None else x.ndim
    return spec + (None,) * (ndim - len(spec))


def _reference(expert_weights, indexer):
    """The randomised tiny model and its single-device logits (computed once per variant)."""
    key = (expert_weights, indexer)
    if key not in _REFS:
        cfg = _cfg(expert_weights, indexer)
        model = K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
        _INIT[key] = [(p, np.asarray(v.get_value())) for p, v in nnx.to_flat_state(nnx.state(model))]
        model = randomize(model, 1)
        tokens = _tokens(cfg)
        a, b, _ = _prefill_decode(model, tokens, model.init_cache(B, MAX_LEN))
        _REFS[key] = (cfg, model, tokens, np.asarray(a), np.asarray(b))
    return _REFS[key]


_INIT = {}


# Every mesh once; each expert format and indexer setting on at least two meshes.
CASES = [
    ("expert=8", "mxfp4", True, ("expert",), ()),
    ("tensor=8", "bf16", True, (), ("tensor",)),
    ("expert=4,tensor=2", "mxfp4", False, ("expert",), ("tensor",)),
    ("fsdp=2,expert=2,tensor=2", "bf16", False, ("expert",), ("tensor",)),
    ("data=2,expert=2,tensor=2", "mxfp4", True, ("expert",), ("tensor",)),
]


@pytest.mark.parametrize("mesh_spec,expert_weights,indexer,ep_axes,tp_axes", CASES,
                         ids=[f"{c[0]}-{c[1]}-{'dsa' if c[2] else 'mla'}" for c in CASES])
def test_sharded_prefill_decode_equals_single_device(mesh_spec, expert_weights, indexer, ep_axes, tp_axes,
                                                     monkeypatch):
    cfg, model, tokens, ref_a, ref_b = _reference(expert_weights, indexer)
    plans = []
    orig = _ffn.ep_routed_experts  # the name the MoE module calls
    monkeypatch.setattr(_ffn, "ep_routed_experts", lambda *a, **k: plans.append(k["plan"]) or orig(*a, **k))
    mesh = sharding.make_mesh(mesh_spec)
    sm = distributed.shard_model(model, mesh)
    with sharding.activate(mesh):
        cache = distributed.init_sharded_cache(cfg, B, MAX_LEN, mesh)
        a, b, cache = _prefill_decode(sm, tokens, cache)
    np.testing.assert_allclose(a, ref_a, rtol=1e-5, atol=1e-5 * np.abs(ref_a).max())
    np.testing.assert_allclose(b, ref_b, rtol=1e-5, atol=1e-5 * np.abs(ref_b).max())
    # the expert-parallel shard_map ran, with the axes the rules give
    assert plans and {(p.ep_axes, p.tp_axes, p.exchange) for p in plans} == {(ep_axes, tp_axes, "dense")}
    # parameters and caches live where the rules say
    w = sm.moe.w_gate.packed[...] if expert_weights == "mxfp4" else sm.moe.w_gate[...]
    fsdp = "fsdp" if "fsdp" in mesh_spec else None  # FSDP also splits the latent side
    assert _spec(w) == (None, ep_axes[0] if ep_axes else None, tp_axes[0] if tp_axes else None, fsdp)
    want = distributed.cache_specs(cache, mesh)
    assert _spec(cache.mla_ckv) == _spec(want.mla_ckv, 4)
    assert int(cache.pos) == T_PREFILL + 1


def test_experts_inside_the_tensor_group_and_naive_path():
    """EP_IN_TP (experts over `tensor`, one node), and ep="off" (the partitioner all-gathers
    the experts): both equal the single-device logits."""
    cfg, model, tokens, ref_a, ref_b = _reference("mxfp4", True)
    mesh = sharding.make_mesh(tensor=4, data=2)
    sm = distributed.shard_model(model, mesh, "ep_in_tp")
    assert _spec(sm.moe.w_down.packed[...]) == (None, "tensor", None, None)
    with sharding.activate(mesh, "ep_in_tp"):
        cache = distributed.init_sharded_cache(cfg, B, MAX_LEN, mesh)
        assert _spec(cache.mla_ckv) == (None, "data", "tensor", None)
        a, b, _ = _prefill_decode(sm, tokens, cache)
        naive = nnx.jit(lambda m, t: m(t, None, backends=Backends(ep="off")).logits)(sm, tokens[:, :T_PREFILL])
    full = nnx.jit(lambda m, t: m(t, None).logits)(model, tokens[:, :T_PREFILL])
    np.testing.assert_allclose(a, ref_a, rtol=1e-5, atol=1e-5 * np.abs(ref_a).max())
    np.testing.assert_allclose(b, ref_b, rtol=1e-5, atol=1e-5 * np.abs(ref_b).max())
    np.testing.assert_allclose(naive, full, rtol=1e-5, atol=1e-5 * np.abs(full).max())


def test_engine_with_layer_rows_on_a_mesh_equals_single_device():
    """The engine's per-layer rows (`unstack_layers` slices the placed stacks) under an
    expert x tensor mesh generate the single-device engine's greedy tokens."""
    from k31jax.chat import ByteTokenizer
    from k31jax.generate import Engine

    model = randomize(K31ForCausalLM(tiny_config(), rngs=nnx.Rngs(0)), 1)
    tok = ByteTokenizer(384)
    prompts = [np.random.default_rng(i).integers(0, 256, n).tolist() for i, n in ((1, 5), (2, 17))]
    ref = Engine(model, tok, max_len=64, prefill_chunk=16).generate(prompts, 8, stop_ids=frozenset()).tokens
    mesh = sharding.make_mesh(expert=4, tensor=2)
    placed = distributed.shard_model(model, mesh)
    with sharding.activate(mesh):
        engine = Engine(placed, tok, max_len=64, prefill_chunk=16, layer_rows=True)
        q_proj = jax.tree.leaves(engine.core.state["kda"]["q_proj"], is_leaf=lambda a: isinstance(a, tuple))[0]
        assert isinstance(q_proj, tuple) and len(q_proj[0].sharding.device_set) == 8
        assert engine.generate(prompts, 8, stop_ids=frozenset()).tokens == ref


def test_sharded_init_materialises_shards_with_the_same_values():
    cfg = _reference("mxfp4", True)[0]
    mesh = sharding.make_mesh(expert=4, tensor=2)
    model = distributed.init_sharded(cfg, mesh, seed=0)
    w = model.moe.w_gate.packed[...]
    assert _spec(w) == (None, "expert", "tensor", None)
    assert w.addressable_shards[0].data.shape == (w.shape[0], w.shape[1] // 4, w.shape[2] // 2, w.shape[3])
    assert _spec(model.kda.q_proj[...]) == (None, None, "tensor")
    # same values as the unsharded initialiser (up to an ulp where XLA fuses the scaling
    # differently per shard; the packed MXFP4 bytes are identical)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), _INIT[("mxfp4", True)]):
        a = np.asarray(a.get_value())
        if a.dtype == np.uint8:
            np.testing.assert_array_equal(a, b, err_msg=str(path))
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0, err_msg=str(path))
    # building under the mesh directly also works (parameters constrained as they are created)
    with sharding.activate(mesh):
        eager = nnx.eval_shape(lambda: K31ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    assert eager.moe.w_gate.packed.get_metadata()["out_sharding"] == ("layers", "expert", "expert_mlp", "latent")
    assert _spec(eager.moe.w_gate.packed.get_value().sharding.spec, 4) == _spec(w)
    # and Flax's own abstract-model helper resolves the names the same way
    _, abs_state = nnx.get_abstract_model(lambda: K31ForCausalLM(cfg, rngs=nnx.Rngs(0)), mesh)
    assert _spec(abs_state["moe"]["w_gate"]["packed"].get_value().sharding.spec, 4) == _spec(w)


def test_constrain_is_a_no_op_without_a_mesh():
    x = jnp.ones((4, 8))
    assert sharding.constrain(x, "batch", "act_embed") is x


def test_logical_resolution_priority_and_divisibility():
    mesh = {"data": 1, "fsdp": 1, "expert": 8, "tensor": 8}
    spec = sharding.logical_to_spec
    assert spec(("embed", "heads"), (7168, 12288), mesh, sharding.TP) == jax.P(None, "tensor")
    assert spec(("embed", "head_dim"), (7168, 128), mesh, sharding.TP) == jax.P("tensor", None)
    assert spec(("batch",), (8,), mesh, sharding.EP_TP) == jax.P("expert")
    assert spec(("batch",), (2,), mesh, sharding.EP_TP) == jax.P(None)  # 8 does not divide 2
    assert spec(("expert", "latent", "expert_mlp"), (16, 64, 6), mesh, sharding.EP_TP) == jax.P("expert", None, None)
    with pytest.raises(KeyError, match="no sharding rule"):
        spec(("bogus",), (8,), mesh, sharding.TP)


TABLE_MESHES = {
    "tp": {"tensor": 8}, "ep_tp": {"expert": 8, "tensor": 8}, "fsdp_ep_tp": {"fsdp": 4, "expert": 8, "tensor": 8},
    "ep_in_tp": {"tensor": 8},
}


@pytest.mark.parametrize("table", sorted(sharding.RULE_TABLES))
def test_every_large_leaf_of_k31_pro_is_sharded(table):
    """Walk the abstract k31_pro (MXFP4 and bf16 experts, + caches at 1M context): no leaf
    over 1 MiB may be replicated on every device."""
    rules = sharding.RULE_TABLES[table]
    mesh = sharding.parse_mesh(TABLE_MESHES[table])
    bad = []
    for fmt in ("mxfp4", "bf16"):
        cfg = ModelConfig.preset("k31_pro", expert_weights=fmt)
        for path, shape, dtype, names in _param_leaves(cfg):
            nbytes = int(np.prod(shape)) * dtype.itemsize
            spec = sharding.logical_to_spec(names, shape, mesh, rules)
            if nbytes > 1 << 20 and sharding.shard_factor(spec, mesh) == 1:
                bad.append(("/".join(path), shape, names))
    cache = distributed.abstract_cache(ModelConfig.preset("k31_pro"), 8, 1 << 20)
    for name, axes in nn.CACHE_AXES.items():
        leaf = getattr(cache, name)
        nbytes = int(np.prod(leaf.shape)) * leaf.dtype.itemsize
        if nbytes > 1 << 20 and sharding.shard_factor(sharding.logical_to_spec(axes, leaf.shape, mesh, rules), mesh) == 1:
            bad.append((name, leaf.shape, axes))
    assert not bad, f"unsharded leaves > 1 MiB under {table}: {bad}"


# Spec totals (architecture.md §13, checkpoint bytes): K3.1 Pro text model with the indexer.
EXPERT_BYTES = 1_446_456_066_048  # MXFP4 routed experts (packed codes + E8M0 scales)
TEXT_BYTES = 1_560_860_324_864 - 2 * (401_214_464 + 46_144_512) + 2 * 335_026_176
ROUTER_BIAS_BYTES = 92 * 896 * 4  # the only non-expert leaf the EP+TP rules leave replicated


def test_planner_weight_bytes_match_the_spec_on_expert8_tensor8():
    plan = distributed.plan_memory("k31_pro", "expert=8,tensor=8", batch=8, context=1 << 20, chunk=256)
    assert plan.rules_name == "ep_tp" and plan.expert_format == "mxfp4"
    assert plan.weights["total_experts"] == EXPERT_BYTES
    assert plan.weights["total_experts"] + plan.weights["total_rest"] == TEXT_BYTES
    # experts: split over expert (896/8) x tensor (3072/8); everything else: tensor only
    assert plan.weights["experts"] == EXPERT_BYTES // 64
    rest = TEXT_BYTES - EXPERT_BYTES
    assert plan.weights["rest"] == (rest - ROUTER_BIAS_BYTES) // 8 + ROUTER_BIAS_BYTES
    # bf16 experts for comparison: 2 bytes per logical weight, same split
    assert plan.weights_other_format["experts"] == 2_722_740_830_208 * 2 // 64
    # caches: batch 8 over expert (one sequence per expert group), heads over tensor
    # (c_kv 512 + k_pe 64 padded to 128 lanes, `nn.kpe_width`)
    assert plan.cache["mla_ckv"] + plan.cache["mla_kpe"] == 24 * 1 * (1 << 20) * (512 + 128) * 2
    assert plan.cache["index_keys"] == 24 * 1 * (1 << 20) * 128 * 2
    assert plan.cache["kda_state"] == 69 * 1 * 12 * 128 * 128 * 4
    assert plan.fits("b300") and plan.fits("h200") and not plan.fits("v6e")
    table = plan.table("b300")
    assert "MLA latent cache" in table and "indexer key cache" in table and "AttnRes" in table


def test_plan_cli_and_suggestion():
    from k31jax.cli import main
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--config", "k31_pro", "--mesh", "expert=8,tensor=8", "--batch", "8",
                     "--context", "1048576", "--device", "b300", "--chunk", "256", "--prefill-batch", "1"]) == 0
    text = out.getvalue()
    assert "22,600,876,032" in text and "-> fits" in text
    assert "smallest mesh that fits" in text and "NVIDIA B300" in text
    best = distributed.suggest_mesh("k31_pro", "b300", batch=8, context=1 << 20, chunk=256, prefill_batch=1)
    assert best is not None and best.devices == 8  # one 8 x B300 node holds K3.1 Pro at 1M context


class _Holder(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((8, 8)), out_sharding=("expert", "expert_mlp"), eager_sharding=False)


def test_generate_accepts_distributed_and_mesh_flags():
    import argparse

    from k31jax.cli import REGISTRARS
    from k31jax.cli._common import cli_context

    from k31jax.cli import _paper

    assert _paper.register_plan in REGISTRARS
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd")
    from k31jax.cli._generate import register

    register(sub)
    args = p.parse_args(["generate", "--prompt", "x", "--coordinator", "localhost:1234", "--num-processes", "2",
                         "--process-id", "1", "--cpu-collectives", "gloo", "--mesh", "expert=4,tensor=2"])
    assert (args.coordinator, args.num_processes, args.process_id, args.mesh) == ("localhost:1234", 2, 1,
                                                                                 "expert=4,tensor=2")
    local = argparse.Namespace(mesh="expert=4,tensor=2", rules=None)  # no coordinator: single process
    with cli_context(local) as ctx:
        assert dict(jax.sharding.get_abstract_mesh().shape)["expert"] == 4
        x = ctx.place(_Holder())
        assert _spec(x.w[...]) == ("expert", "tensor")
    assert jax.sharding.get_abstract_mesh().empty
