"""MXFP4 in the model: packed experts in memory, MXFP8 activations, QAT fake-quant."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers.model import tiny_config
from k31jax import Backends, K31ForCausalLM, count_params, dequantize_experts, quantize_experts
from k31jax.quant import fake_quant, mx_fake_quant_activations, mxfp4_dequantize_packed

forward = nnx.jit(lambda m, t: m(t, None).logits)


def small_config(**overrides):
    """Five layers (KDA x3, MLA x2, two AttnRes blocks): every feature, less to compile."""
    return tiny_config(num_hidden_layers=5, layer_types=("kda", "kda", "kda", "mla", "mla"), **overrides)


def _tokens(b=2, t=24, vocab=384, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


def _routed_bytes(model):
    moe = nnx.to_pure_dict(nnx.state(model.moe, nnx.Param))
    return sum(int(np.asarray(a).nbytes) for w in ("w_gate", "w_up", "w_down")
               for a in jax.tree.leaves(moe[w]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_model_equals_dequantized_model(dtype):
    packed = K31ForCausalLM(small_config(expert_weights="mxfp4", dtype=dtype), rngs=nnx.Rngs(0))
    assert packed.moe.w_gate.packed[...].dtype == jnp.uint8
    assert packed.moe.w_gate.scale[...].shape[-1] * 32 == packed.config.routed_expert_hidden_size
    plain = dequantize_experts(packed)
    assert plain.moe.w_gate[...].dtype == jnp.dtype(dtype)
    tokens = _tokens()
    for form in ("ragged", "gather"):
        run = nnx.jit(lambda m, t, form=form: m(t, None, backends=Backends(moe=form)).logits)
        np.testing.assert_array_equal(run(packed, tokens), run(plain, tokens))
    # decode path (gather over few tokens) as well
    step = nnx.jit(lambda m, t, c: m(t, c))
    out_a, out_b = step(packed, tokens[:, :20], packed.init_cache(2, 32)), step(plain, tokens[:, :20], plain.init_cache(2, 32))
    la = step(packed, tokens[:, 20:21], out_a.cache).logits
    lb = step(plain, tokens[:, 20:21], out_b.cache).logits
    np.testing.assert_array_equal(la, lb)


def test_packed_expert_bytes():
    """Packed routed experts hold ≤ 0.27x the bytes of their bf16 copy (live arrays)."""
    packed = K31ForCausalLM(tiny_config(expert_weights="mxfp4", dtype="bfloat16"), rngs=nnx.Rngs(0))
    plain = dequantize_experts(packed)
    ratio = _routed_bytes(packed) / _routed_bytes(plain)
    assert ratio <= 0.27, ratio
    assert ratio == pytest.approx(4.25 / 16)
    # logical parameter counts do not change with the storage format
    assert count_params(packed.config).total == count_params(plain.config).total


def test_mxfp8_activations_quantize_expert_inputs():
    cfg = small_config()
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    quant = K31ForCausalLM(cfg.replace(expert_activations="mxfp8"), rngs=nnx.Rngs(0))
    tokens = _tokens()
    a, b = forward(model, tokens), forward(quant, tokens)
    rel = float(jnp.abs(a - b).max() / jnp.abs(a).max())
    assert 0 < rel < 0.1  # E4M3 has a 3-bit mantissa: visible but small
    # op level: the GEMM input is exactly the MXFP8 round trip
    from k31jax.ops import routed_experts

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    idx = jnp.asarray([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]], jnp.int32)
    w = jnp.full((6, 2), 0.5, jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((4, 32, 64)) * 0.1, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((4, 64, 32)) * 0.1, jnp.float32)
    ours = routed_experts(x, idx, w, wg, wu, wd, hidden_act="silu", activation_fake_quant=True, form="gather")
    xq = mx_fake_quant_activations(x, "e4m3", "rceil")
    h = jax.nn.silu(jnp.einsum("ni,eoi->neo", xq, wg)) * jnp.einsum("ni,eoi->neo", xq, wu)
    ref = []
    for n in range(6):
        acc = 0
        for k in range(2):
            e = int(idx[n, k])
            hk = mx_fake_quant_activations(h[n, e][None], "e4m3", "rceil")[0]
            acc = acc + 0.5 * (wd[e] @ hk)
        ref.append(acc)
    np.testing.assert_allclose(ours, jnp.stack(ref), rtol=1e-5, atol=1e-6)
    plain = routed_experts(x, idx, w, wg, wu, wd, hidden_act="silu", form="gather")
    assert float(jnp.abs(ours - plain).max()) > 1e-4


def _qat_model(seed=0):
    return K31ForCausalLM(small_config(expert_qat=True), rngs=nnx.Rngs(seed))


def test_qat_forward_uses_mxfp4_values():
    qat = _qat_model()
    packed = quantize_experts(qat)
    tokens = _tokens()
    np.testing.assert_allclose(forward(qat, tokens), forward(packed, tokens), rtol=1e-6, atol=1e-6)
    # the exported bytes decode to exactly the fake-quantised master weights
    w = qat.moe.w_gate[...]
    dec = mxfp4_dequantize_packed(packed.moe.w_gate.packed[...], packed.moe.w_gate.scale[...], jnp.float32)
    np.testing.assert_array_equal(dec, fake_quant(w, "e2m1", "floor"))
    # and unchanged weights re-quantise to the identical bytes
    again = quantize_experts(dequantize_experts(packed))
    np.testing.assert_array_equal(again.moe.w_gate.packed[...], packed.moe.w_gate.packed[...])
    np.testing.assert_array_equal(again.moe.w_gate.scale[...], packed.moe.w_gate.scale[...])


def _loss(model, tokens):
    logits = model(tokens[:, :-1], None).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def test_qat_gradients_flow_straight_through():
    qat = _qat_model()
    tokens = _tokens()
    grads = nnx.jit(nnx.grad(_loss))(qat, tokens)
    g = grads["moe"]["w_gate"][...]
    assert bool(jnp.isfinite(g).all()) and float(jnp.abs(g).max()) > 0
    # STE: the gradient w.r.t. the master weight equals the gradient w.r.t. the quantised
    # weight used in the forward pass, i.e. that of a float model holding fq(w)
    plain = dequantize_experts(quantize_experts(qat))
    g_plain = nnx.jit(nnx.grad(_loss))(plain, tokens)["moe"]["w_gate"][...]
    np.testing.assert_allclose(g, g_plain, rtol=1e-4, atol=1e-7 * float(jnp.abs(g_plain).max()) + 1e-9)


def test_qat_training_step_lowers_the_loss():
    model = _qat_model()
    tokens = _tokens(b=4, t=17, seed=2)
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, tokens):
        loss, grads = nnx.value_and_grad(_loss)(model, tokens)
        opt.update(model, grads)
        return loss

    first = float(train_step(model, opt, tokens))
    for _ in range(4):
        last = float(train_step(model, opt, tokens))
    assert last < first - 1e-3, (first, last)
