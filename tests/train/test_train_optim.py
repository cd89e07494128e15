"""Optimizer construction (labels, decay masks, frozen sets, Muon per matrix, accumulation)
and LoRA parameter deltas."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers.model import tiny_config
from k31jax import K31ForCausalLM
from k31jax.train._lora import (DEFAULT_LORA_TARGETS, EXPERT_LORA_TARGET, apply_lora, init_lora, load_adapter,
                                routed_expert_digest, save_adapter)
from k31jax.train._optim import (OptimConfig, decay_mask, learning_rate_schedule, make_optimizer,
                                 map_by_path, param_labels)
from refs import train as ref


# ---------------------------------------------------------------- the tiny K3.1 model's paths

VECTORS = {  # every (per-layer) vector of the tiny K3.1 model: never decayed
    "final_norm", "out_res_norm", "out_res_proj", "kda/a_log", "kda/dt_bias", "kda/o_norm",
    "mla/kv_a_norm", "mla/q_a_norm", "mla/indexer/k_norm_bias", "mla/indexer/k_norm_weight",
    "moe/gate_bias", "moe/latent_norm", "norms/attn_res_norm", "norms/attn_res_proj",
    "norms/input_norm", "norms/mlp_res_norm", "norms/mlp_res_proj", "norms/post_norm",
}
MATRICES = {  # linear maps between hidden spaces: Muon's
    "dense/down_proj", "dense/gate_proj", "dense/up_proj",
    "kda/b_proj", "kda/f_a_proj", "kda/f_b_proj", "kda/g_proj", "kda/k_proj", "kda/o_proj",
    "kda/q_proj", "kda/v_proj",
    "mla/g_proj", "mla/kv_a_proj", "mla/kv_b_proj", "mla/o_proj", "mla/q_a_proj", "mla/q_b_proj",
    "mla/indexer/weights_proj", "mla/indexer/wk", "mla/indexer/wq_b",
    "moe/gate", "moe/latent_down", "moe/latent_up", "moe/shared/down_proj", "moe/shared/gate_proj",
    "moe/shared/up_proj", "moe/w_down", "moe/w_gate", "moe/w_up",
}
ADAM_MATRICES = {"embed", "lm_head", "kda/q_conv", "kda/k_conv", "kda/v_conv"}  # decayed, AdamW even under Muon
EXPERTS = {"moe/w_down", "moe/w_gate", "moe/w_up"}
INDEXER = {"mla/indexer/weights_proj", "mla/indexer/wk", "mla/indexer/wq_b", "mla/indexer/k_norm_bias",
           "mla/indexer/k_norm_weight"}


@pytest.fixture(scope="module")
def tiny_state():
    model = nnx.eval_shape(lambda: K31ForCausalLM(tiny_config(), rngs=nnx.Rngs(0)))
    return nnx.state(model, nnx.Param)


def _flat(tree) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p, simple=True, separator="/"): x for p, x in leaves}


def test_path_lists_cover_the_tiny_model(tiny_state):
    assert set(_flat(decay_mask(tiny_state))) == VECTORS | MATRICES | ADAM_MATRICES


def test_decay_mask(tiny_state):
    got = _flat(decay_mask(tiny_state))
    assert {p for p, d in got.items() if not d} == VECTORS
    assert {p for p, d in got.items() if d} == MATRICES | ADAM_MATRICES


@pytest.mark.parametrize("trainable, trained", [
    ("all", VECTORS | MATRICES | ADAM_MATRICES),
    ("experts", EXPERTS),
    ("indexer", INDEXER),
    ("no_embed", (VECTORS | MATRICES | ADAM_MATRICES) - {"embed", "lm_head"}),
])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_param_labels(tiny_state, trainable, trained, optimizer):
    trained = trained - {"moe/gate_bias"}  # the router bias is set by balancing, never by gradient
    got = _flat(param_labels(tiny_state, trainable, optimizer))
    want = {}
    for path in got:
        if path not in trained:
            want[path] = "frozen"
        elif path in VECTORS:
            want[path] = "adamw_no_decay"
        elif optimizer == "muon" and path in MATRICES:
            want[path] = "muon"
        else:
            want[path] = "adamw"
    assert got == want


def test_bf16_model_gets_the_same_labels(tiny_state):
    model = nnx.eval_shape(lambda: K31ForCausalLM(tiny_config(dtype="bfloat16"), rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    assert jax.tree.leaves(state)[0].dtype == jnp.bfloat16
    for optimizer in ("adamw", "muon"):
        assert _flat(param_labels(state, "all", optimizer)) == _flat(param_labels(tiny_state, "all", optimizer))


def test_packed_experts_are_never_trainable():
    model = nnx.eval_shape(lambda: K31ForCausalLM(tiny_config(expert_weights="mxfp4"), rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    for trainable in ("all", "experts", "no_embed"):
        with pytest.raises(ValueError, match=r"MXFP4-packed.*moe/w_gate/packed.*dequantise"):
            make_optimizer(OptimConfig(trainable=trainable), state)
    labels = _flat(param_labels(state, "indexer"))
    assert labels["moe/w_gate/packed"] == labels["moe/w_up/scale"] == "frozen"


def test_state_without_axis_names_is_rejected():
    with pytest.raises(ValueError, match=r"'w'.*out_sharding"):
        param_labels(nnx.State({"w": nnx.Param(jnp.zeros((2, 3)))}))


def test_config_errors_are_named():
    with pytest.raises(ValueError, match="optimizer='sgd'.*trainable='lora'"):
        OptimConfig(optimizer="sgd", trainable="lora")
    with pytest.raises(ValueError, match="warmup_steps"):
        OptimConfig(warmup_steps=10, total_steps=10)


def test_schedule():
    cfg = OptimConfig(learning_rate=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    lr = learning_rate_schedule(cfg)
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(5e-4)
    assert float(lr(10)) == pytest.approx(1e-3)
    # halfway through the cosine: end + (peak - end) / 2
    assert float(lr(60)) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-5)
    assert float(lr(110)) == pytest.approx(1e-4, rel=1e-5)


# ---------------------------------------------------------------- a small stand-in model


class Toy(nnx.Module):
    """Stacked leaves in the k31jax layouts: [L, in, out] matrices, [L, E, out, in] experts,
    [L, D] norms, conv taps, embedding / head, and a router bias."""

    def __init__(self, seed=0, layers=3, experts=2, d=8, f=6, vocab=11):
        rng = np.random.default_rng(seed)

        def p(shape, axes, scale=0.3):
            return nnx.Param(jnp.asarray(scale * rng.standard_normal(shape), jnp.float32),
                             out_sharding=axes, eager_sharding=False)

        self.embed = p((vocab, d), ("vocab", "embed"))
        self.mix = p((layers, d, f), ("layers", "embed", "mlp"))
        self.w_up = p((layers, experts, f, d), ("layers", "expert", "expert_mlp", "embed"))
        self.norm = p((layers, d), ("layers", "norm"))
        self.conv = p((layers, 3, d), ("layers", "conv", "heads"))
        self.gate_bias = p((layers, experts), ("layers", None))
        self.lm_head = p((d, vocab), ("embed", "vocab"))

    def __call__(self, tokens):
        h = self.embed[...][tokens]
        for layer in range(self.mix.shape[0]):
            h = h * self.norm[layer] + self.conv[layer].sum(0)
            u = jnp.tanh(h @ self.mix[layer])
            v = jnp.einsum("nd,efd->nf", h, self.w_up[layer]) + self.gate_bias[layer].sum()
            h = h + jnp.tanh(u + v) @ self.mix[layer].T
        return h @ self.lm_head[...]


def _mean_ce(model, tokens, targets):
    logits = model(tokens)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], -1))


def _grads(model, tokens, targets):
    return nnx.grad(_mean_ce)(model, tokens, targets)


def _batch(seed, n):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 11, n)), jnp.asarray(rng.integers(0, 11, n))


def test_toy_labels():
    labels = _flat(param_labels(nnx.state(Toy(), nnx.Param), "all", "muon"))
    assert labels == dict(embed="adamw", mix="muon", w_up="muon", norm="adamw_no_decay", conv="adamw",
                          gate_bias="frozen", lm_head="adamw")


def test_frozen_leaves_get_zero_updates_and_no_state():
    model = Toy()
    state = nnx.state(model, nnx.Param)
    tx = make_optimizer(OptimConfig(trainable="no_embed", warmup_steps=0), state)
    opt = tx.init(nnx.as_pure(state))
    n_state = sum(math.prod(x.shape) for x in jax.tree.leaves(opt))
    trained = sum(math.prod(np.shape(model.__dict__[k])) for k in ("mix", "w_up", "norm", "conv"))
    scalars = 16  # step counters, one per inner adamw and per multi_transform / chain element at most
    assert 2 * trained <= n_state <= 2 * trained + scalars  # Adam mu + nu for the trained leaves only
    g = nnx.as_pure(_grads(model, *_batch(0, 8)))
    assert float(jnp.abs(g["embed"]).max()) > 0 and float(jnp.abs(g["gate_bias"]).max()) > 0
    upd, _ = tx.update(g, opt, nnx.as_pure(state))
    for name in ("embed", "lm_head", "gate_bias"):
        assert float(jnp.abs(upd[name]).max()) == 0.0, name
    for name in ("mix", "w_up", "norm", "conv"):
        assert float(jnp.abs(upd[name]).max()) > 0.0, name


def test_frozen_gradients_do_not_count_in_the_clip():
    """Only the trained leaves' norm is clipped: a huge frozen gradient changes nothing."""
    model = Toy()
    state = nnx.as_pure(nnx.state(model, nnx.Param))
    # eps = 1 makes Adam's first step lr * c / (c + 1): sensitive to the clipped size c
    cfg = OptimConfig(trainable="no_embed", warmup_steps=0, clip_norm=1.0, learning_rate=1.0,
                      weight_decay=0.0, eps=1.0)
    tx = make_optimizer(cfg, nnx.state(model, nnx.Param))
    g = jax.tree.map(jnp.ones_like, state)
    g["embed"] = g["embed"] * 1e6
    upd, _ = tx.update(g, tx.init(state), state)
    trained = ("mix", "w_up", "norm", "conv")
    c = 1.0 / math.sqrt(sum(g[k].size for k in trained))  # each entry after clipping to norm 1
    for name in trained:
        np.testing.assert_allclose(np.asarray(upd[name]), -c / (c + 1.0), rtol=1e-5, err_msg=name)


def _muon_reference(update_2d, lr):
    """optax's plain 2-D Muon on one matrix [in, out], first step."""
    tx = optax.contrib.muon(learning_rate=lr, beta=0.95, ns_steps=5, consistent_rms=0.2)
    out, _ = tx.update(update_2d, tx.init(update_2d), update_2d)
    return out


def test_muon_orthogonalises_each_stacked_matrix_separately():
    model = Toy(layers=3, experts=2, d=8, f=6)
    state = nnx.state(model, nnx.Param)
    cfg = OptimConfig(optimizer="muon", learning_rate=0.1, warmup_steps=0, total_steps=1000,
                      weight_decay=0.0, clip_norm=None)
    tx = make_optimizer(cfg, state)
    pure = nnx.as_pure(state)
    rng = np.random.default_rng(1)
    g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), pure)
    upd, _ = tx.update(g, tx.init(pure), pure)
    for layer in range(3):
        want = _muon_reference(g["mix"][layer], 0.1)  # [in=D, out=F]
        np.testing.assert_allclose(np.asarray(upd["mix"][layer]), np.asarray(want), rtol=1e-5, atol=1e-6)
        for e in range(2):  # experts are [out, in]: the reference sees [in, out]
            want = _muon_reference(g["w_up"][layer, e].T, 0.1).T
            np.testing.assert_allclose(np.asarray(upd["w_up"][layer, e]), np.asarray(want), rtol=1e-5, atol=1e-6)
    # and it is not the orthogonalisation of the flattened tensor
    flat = _muon_reference(g["mix"].reshape(-1, g["mix"].shape[-1]), 0.1).reshape(g["mix"].shape)
    assert not np.allclose(np.asarray(upd["mix"]), np.asarray(flat), atol=1e-3)


def test_nnx_optimizer_step_on_variable_state():
    """The transformation built from the Variable state drives `nnx.Optimizer` (init on the
    Variables, update on pure arrays)."""
    model = Toy()
    before = {k: np.asarray(v) for k, v in _flat(nnx.as_pure(nnx.state(model, nnx.Param))).items()}
    tx = make_optimizer(OptimConfig(optimizer="muon", trainable="no_embed", warmup_steps=0,
                                    learning_rate=1e-2), nnx.state(model, nnx.Param))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    opt.update(model, _grads(model, *_batch(3, 8)))
    after = _flat(nnx.as_pure(nnx.state(model, nnx.Param)))
    for name in ("embed", "lm_head", "gate_bias"):
        np.testing.assert_array_equal(np.asarray(after[name]), before[name])
    for name in ("mix", "w_up", "norm", "conv"):
        assert not np.allclose(np.asarray(after[name]), before[name]), name


# ---------------------------------------------------------------- LoRA (parameter deltas)

LORA_PATHS = {  # DEFAULT_LORA_TARGETS on the tiny K3.1 model
    "kda/q_proj", "kda/k_proj", "kda/v_proj", "kda/o_proj",
    "mla/q_a_proj", "mla/q_b_proj", "mla/kv_a_proj", "mla/kv_b_proj", "mla/o_proj",
    "moe/shared/gate_proj", "moe/shared/up_proj", "moe/shared/down_proj",
}


def test_lora_targets_and_shapes(tiny_state):
    lora = init_lora(tiny_state, rank=3, alpha=6.0, rng=jax.random.key(1))
    assert set(lora.a) == set(lora.b) == LORA_PATHS
    flat = _flat(nnx.as_pure(tiny_state))
    for path in LORA_PATHS:
        *lead, n, m = flat[path].shape
        assert lora.a[path].shape == (*lead, n, 3) and lora.b[path].shape == (*lead, 3, m), path
        assert float(jnp.abs(lora.b[path]).max()) == 0.0 and float(jnp.std(lora.a[path])) > 0
    assert lora.scale == 2.0


def test_lora_target_errors(tiny_state):
    with pytest.raises(ValueError, match=r"'mla/nope_proj' matches no parameter"):
        init_lora(tiny_state, targets=("mla/nope_proj",))
    with pytest.raises(ValueError, match=r"'final_norm'.*float weight matrix"):
        init_lora(tiny_state, targets=("final_norm",))


def test_lora_merge_and_gradients_flow_to_adapters_only():
    """Toy stand-in: zero-init merges to identical params; with a non-zero B, apply_lora is
    W + (alpha/r) A B (float64 reference), the adapters' gradients obey the chain rule
    dA = s dW B^T, dB = s A^T dW, and the adapted base weight gets no gradient."""
    model = Toy()
    graphdef, params = nnx.split(model, nnx.Param)
    lora = init_lora(params, targets=("mix", "w_up"), rank=2, alpha=3.0, rng=jax.random.key(2))
    merged = apply_lora(params, lora)
    assert type(merged) is type(params)  # a State of Variables stays one
    for path, want in _flat(nnx.as_pure(params)).items():
        np.testing.assert_array_equal(np.asarray(_flat(nnx.as_pure(merged))[path]), np.asarray(want))

    rng = np.random.default_rng(3)
    lora = dataclasses.replace(lora, b={p: jnp.asarray(rng.standard_normal(b.shape), jnp.float32)
                                        for p, b in lora.b.items()})
    pure = nnx.as_pure(params)
    merged = apply_lora(pure, lora)
    np.testing.assert_allclose(np.asarray(merged["mix"]),
                               ref.lora_merge(pure["mix"], lora.a["mix"], lora.b["mix"], 3.0, 2), rtol=1e-6, atol=1e-7)
    tokens, targets = _batch(4, 16)

    def loss(p, adapters):
        return _mean_ce(nnx.merge(graphdef, apply_lora(p, adapters)), tokens, targets)

    d_params, d_lora = jax.grad(loss, argnums=(0, 1))(pure, lora)
    d_w = jax.grad(lambda p: _mean_ce(nnx.merge(graphdef, p), tokens, targets))(merged)
    for path in ("mix", "w_up"):
        assert float(jnp.abs(d_params[path]).max()) == 0.0, path  # the adapted base is frozen
        a, b, g = (np.asarray(x, np.float64) for x in (lora.a[path], lora.b[path], d_w[path]))
        np.testing.assert_allclose(np.asarray(d_lora.a[path]), 1.5 * g @ np.swapaxes(b, -1, -2), rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(np.asarray(d_lora.b[path]), 1.5 * np.swapaxes(a, -1, -2) @ g, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(d_params["embed"]), np.asarray(d_w["embed"]), rtol=1e-5, atol=1e-8)


def test_lora_on_the_scanned_tiny_model():
    """On the real stack (one scan over the layers, under jit): a fresh adapter gives the
    model's own logits, a non-zero one changes them. (Gradients: the Toy test above.)"""
    model = nnx.eval_shape(lambda: K31ForCausalLM(tiny_config(), rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(5)
    # random parameters without compiling the initialisers: norms near 1, the rest near 0
    def fill(path, v):
        centre = 1.0 if path.endswith(("norm", "norm_weight")) else 0.0
        return jnp.asarray(centre + 0.05 * rng.standard_normal(v.shape), v.dtype)

    nnx.update(model, map_by_path(fill, nnx.state(model, nnx.Param)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    lora = init_lora(params, rank=2, alpha=2.0, rng=jax.random.key(3))
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 384, (1, 8)), jnp.int32)

    @jax.jit
    def logits(p, adapters):
        return nnx.merge(graphdef, apply_lora(p, adapters), rest)(tokens).logits

    trained = dataclasses.replace(lora, b={p: jnp.asarray(0.1 * rng.standard_normal(b.shape), jnp.float32)
                                           for p, b in lora.b.items()})
    frozen_b = dataclasses.replace(lora, a={p: 0 * a for p, a in lora.a.items()})  # A = 0: no delta
    base = logits(params, frozen_b)
    # B = 0: the model's own logits (to XLA:CPU's run-to-run threading noise in a full suite)
    np.testing.assert_allclose(np.asarray(logits(params, lora)), np.asarray(base), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(logits(params, trained) - base).max()) > 1e-3


def _packed_tiny(adapter_rank: int = 0):
    cfg = tiny_config().replace(expert_weights="mxfp4", expert_adapter_rank=adapter_rank)
    return nnx.state(K31ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)


def test_lora_on_packed_experts_needs_slots_and_fills_them():
    with pytest.raises(ValueError, match="need adapter slots"):
        init_lora(_packed_tiny(), targets=(EXPERT_LORA_TARGET,), rank=2)
    state = _packed_tiny(adapter_rank=2)
    with pytest.raises(ValueError, match="rank 2, not 3"):
        init_lora(state, targets=(EXPERT_LORA_TARGET,), rank=3)
    lora = init_lora(state, targets=(EXPERT_LORA_TARGET,), rank=2, alpha=6.0, rng=jax.random.key(3))
    assert set(lora.a) == {"moe/w_gate", "moe/w_up", "moe/w_down"}
    gate = state["moe"]["w_gate"]["packed"].get_value()
    *lead, out, half = gate.shape
    assert lora.a["moe/w_gate"].shape == (*lead, out, 2) and lora.b["moe/w_gate"].shape == (*lead, 2, 2 * half)
    lora = dataclasses.replace(lora, b={p: jnp.ones_like(b) for p, b in lora.b.items()})
    pure = nnx.to_pure_dict(state)
    out_state = apply_lora(pure, lora)
    np.testing.assert_array_equal(out_state["moe"]["w_gate"]["packed"], pure["moe"]["w_gate"]["packed"])
    np.testing.assert_allclose(out_state["moe"]["w_gate"]["adapter_a"], 3.0 * lora.a["moe/w_gate"], rtol=1e-6)
    np.testing.assert_array_equal(out_state["moe"]["w_gate"]["adapter_b"], lora.b["moe/w_gate"])


def test_adapter_files_round_trip_and_bad_input(tmp_path):
    state = _packed_tiny(adapter_rank=2)
    lora = init_lora(state, targets=DEFAULT_LORA_TARGETS + (EXPERT_LORA_TARGET,), rank=2, rng=jax.random.key(4))
    digest = routed_expert_digest(state)
    folder = save_adapter(lora, tmp_path / "adapter", targets=("x",), base="tiny", base_experts=digest)
    back, meta = load_adapter(folder)
    assert meta["base"] == "tiny" and meta["base_routed_experts_sha256"] == digest and back.rank == 2
    for path in lora.a:
        np.testing.assert_array_equal(back.a[path], lora.a[path])
        np.testing.assert_array_equal(back.b[path], lora.b[path])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    assert routed_expert_digest(_packed_tiny()) == digest  # the slots are not part of the digest
    assert routed_expert_digest(tiny_state_concrete()) is None  # float experts have no packed bytes
    meta_file = folder / "adapter_config.json"
    raw = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**raw, "paths": raw["paths"] + ["kda/x_proj"]}))
    with pytest.raises(ValueError, match=r"adapter.safetensors: tensor 'kda/x_proj.lora_a' missing"):
        load_adapter(folder)
    meta_file.write_text(json.dumps({**raw, "rank": 4}))
    with pytest.raises(ValueError, match="not of rank 4"):
        load_adapter(folder)
    (folder / "adapter.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="adapter.safetensors: missing"):
        load_adapter(folder)


def tiny_state_concrete():
    return nnx.state(K31ForCausalLM(tiny_config(), rngs=nnx.Rngs(0)), nnx.Param)
