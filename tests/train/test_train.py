"""The training step on the tiny config: packing is exact through the whole model, gradient
accumulation equals the large batch, QAT's straight-through gradient, and a sharded step
equals the single-device step (runs, resume and the CLI: test_train_runs.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.model import tiny_config
from k31jax import K31ForCausalLM
from k31jax.quant import fake_quant
from k31jax.train import OptimConfig, chunked_cross_entropy
from k31jax.train._steps import StepSettings, overlay, train_step
from k31jax.train._trainer import split_for_training
from k31jax.ops import Backends


# ---------------------------------------------------------------------------- packing
def _doc_losses(model, tokens, segment_ids, targets, mask):
    logits = model.logits(model.hidden_states(tokens, segment_ids=segment_ids).hidden)
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return nll * mask


def test_a_documents_loss_is_the_same_packed_or_alone():
    """Three documents packed in one row (lengths not multiples of the KDA chunk, the indexer
    top-k larger than one of them) give each document exactly its loss when run alone."""
    cfg = tiny_config(dtype="float32")
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    lengths = (37, 5, 70)
    docs = [rng.integers(1, cfg.vocab_size, n) for n in lengths]
    t = 128
    tokens = np.zeros((1, t), np.int32)
    seg = np.zeros((1, t), np.int32)
    start = 0
    for i, d in enumerate(docs):
        tokens[0, start:start + len(d)] = d
        seg[0, start:start + len(d)] = i + 1
        start += len(d)
    targets = np.roll(tokens, -1, 1)
    mask = ((seg == np.roll(seg, -1, 1)) & (seg > 0)).astype(np.float32)
    packed = np.asarray(jax.jit(lambda m, *a: _doc_losses(m, *a), static_argnums=())(
        model, jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(targets), jnp.asarray(mask)))
    start = 0
    for d in docs:
        n = len(d)
        alone = np.asarray(_doc_losses(model, jnp.asarray(d[None], jnp.int32), jnp.ones((1, n), jnp.int32),
                                       jnp.asarray(np.roll(d, -1)[None], jnp.int32),
                                       jnp.asarray(np.arange(n) < n - 1, jnp.float32)[None]))
        np.testing.assert_allclose(packed[0, start:start + n], alone[0], rtol=2e-5, atol=2e-6)
        start += n
    assert packed.sum() > 0


# ---------------------------------------------------------------------------- the step
def _step_inputs(cfg, optim, micro, rows, t, seed=0):
    """(graphdef, frozen rest, trained leaves, optimizer, a batch [micro, rows, t] of two
    documents per row with some padding)."""
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    rest, trained, tx = split_for_training(state, optim)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, cfg.vocab_size, (micro * rows, t)).astype(np.int32)
    seg = np.ones_like(tokens)
    seg[:, t // 2 + 3:] = 2  # two documents per row
    seg[0, -5:] = 0          # some padding
    mask = ((seg == np.roll(seg, -1, 1)) & (seg > 0)).astype(np.float32)
    batch = dict(tokens=tokens, targets=np.roll(tokens, -1, 1), loss_mask=mask,
                 target_bytes=np.ones_like(tokens), segment_ids=seg, positions=np.zeros_like(tokens))
    return graphdef, rest, trained, tx, {k: jnp.asarray(v.reshape(micro, rows, t)) for k, v in batch.items()}


def test_gradient_accumulation_equals_the_large_batch():
    cfg = tiny_config(dtype="float32")
    # eps = 1 makes Adam's first update ~0.45·lr·g (linear in g), so the comparison below
    # measures the gradients, not the sign of near-zero ones
    optim = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10, clip_norm=0.05, eps=1.0)
    settings = StepSettings(backends=Backends(), bias_update_rate=1e-3)
    step = jax.jit(train_step, static_argnums=(0, 1, 2))
    graphdef, rest, trained, tx, big = _step_inputs(cfg, optim, 1, 4, 24)
    params = overlay(rest, trained)
    small = {k: v.reshape(2, 2, 24) for k, v in big.items()}
    outs = []
    for batch in (big, small):
        r, opt, t, metrics = step(graphdef, tx, settings, rest, tx.init(trained), trained, batch)
        outs.append((overlay(r, t), metrics))
    (p_big, m_big), (p_small, m_small) = outs
    assert float(m_big["grad_norm"]) > 0.05  # the clip acts on the accumulated gradient
    np.testing.assert_allclose(m_small["loss"], m_big["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_small["grad_norm"], m_big["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(m_small["update_norm"], m_big["update_norm"], rtol=1e-5)
    for a, b, p0 in zip(jax.tree.leaves(p_small), jax.tree.leaves(p_big), jax.tree.leaves(params)):
        step_big = np.asarray(b) - np.asarray(p0)
        np.testing.assert_allclose(np.asarray(a) - np.asarray(p0), step_big, rtol=1e-4,
                                   atol=1e-4 * np.abs(step_big).max() + 1e-12)
    # the router bias moved by the sign rule on the step's load, the same in both
    np.testing.assert_array_equal(p_small["moe"]["gate_bias"], p_big["moe"]["gate_bias"])
    assert np.abs(np.asarray(p_big["moe"]["gate_bias"])).max() == pytest.approx(1e-3)


def test_qat_gradient_is_the_straight_through_one():
    """With QAT the expert gradient equals the plain model's gradient taken at the
    quantised weights (the straight-through estimator, nothing clipped in between)."""
    cfg = tiny_config(dtype="float32")
    qat = K31ForCausalLM(cfg.replace(expert_qat=True), rngs=nnx.Rngs(1))
    graphdef_q, state = nnx.split(qat)
    params = nnx.to_pure_dict(state)
    quantised = jax.tree.map(lambda x: x, params)
    for w in ("w_gate", "w_up", "w_down"):
        quantised["moe"][w] = fake_quant(params["moe"][w], "e2m1", "floor")
    graphdef_p, _ = nnx.split(K31ForCausalLM(cfg, rngs=nnx.Rngs(1)))
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 20)), jnp.int32)

    def loss(graphdef, p):
        model = nnx.merge(graphdef, p)
        hidden = model.hidden_states(tokens).hidden
        return chunked_cross_entropy(hidden, model.lm_head[...], jnp.roll(tokens, -1, 1),
                                     jnp.ones(tokens.shape, jnp.float32), vocab_chunk=100)[0]

    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)  # one compile each, not op by op
    l_qat, g_qat = value_and_grad(graphdef_q, params)
    l_plain, g_plain = value_and_grad(graphdef_p, quantised)
    assert float(l_qat) == pytest.approx(float(l_plain), rel=1e-6)
    for w in ("w_gate", "w_up", "w_down"):
        a, b = np.asarray(g_qat["moe"][w]), np.asarray(g_plain["moe"][w])
        assert np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * np.abs(b).max())


def test_the_trainers_step_program_is_the_jitted_step_and_returns_the_state_as_it_took_it():
    """`StepProgram`, the Trainer's step (state donated; on a TPU laid out as the compiler
    chooses): the plain jitted step's numbers, one compile per argument signature, and the
    state returned in the formats the program takes it in, so placing it for the next step
    moves nothing."""
    from k31jax.train import StepProgram

    cfg = tiny_config(dtype="float32")
    optim = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10)
    settings = StepSettings(backends=Backends(), bias_update_rate=1e-3)
    graphdef, rest, trained, tx, batch = _step_inputs(cfg, optim, 1, 2, 24)
    want = jax.jit(train_step, static_argnums=(0, 1, 2))(graphdef, tx, settings, rest, tx.init(trained), trained,
                                                        batch)
    program = StepProgram(train_step)
    fresh = lambda tree: jax.tree.map(jnp.copy, tree)  # the program donates its state
    got = program(graphdef, tx, settings, fresh(rest), tx.init(trained), fresh(trained), batch)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    formats = program.compiled(graphdef, tx, settings, *got[:3], batch).input_formats[0][:3]
    assert len(program._compiled) == 1  # the updated state has the signature it came with
    assert jax.tree.map(lambda a: a.format, got[:3]) == formats
    again = program(graphdef, tx, settings, *got[:3], batch)
    assert len(program._compiled) == 1 and float(again[3]["loss"]) < float(want[3]["loss"])


def test_the_step_program_places_a_leaf_once_and_frees_the_original():
    """Placing the state for the compiled step (`_placed`): a leaf already in its format is
    passed on as it is; any other is copied to it and the original deleted at once, so the
    placement needs one leaf of headroom, not a second copy of the state."""
    from jax.experimental.layout import Format

    from k31jax.train._programs import _placed

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    split, whole = jax.NamedSharding(mesh, jax.P("x")), jax.NamedSharding(mesh, jax.P())
    x = jax.device_put(jnp.arange(12.0).reshape(4, 3), split)
    fmt = Format(x.format.layout, whole)
    y = _placed(x, fmt)
    assert x.is_deleted() and y.format == fmt
    np.testing.assert_array_equal(y, np.arange(12.0).reshape(4, 3))
    assert _placed(y, fmt) is y and not y.is_deleted()


def test_a_leaf_whose_sharding_is_written_with_its_trailing_axes_is_not_placed_again():
    """A compiled step writes its output shardings with the trailing unsplit axes that its
    input formats leave out (`P(None, "x", None)` against `P(None, "x")`; the deviceless TPU
    compile of a LoRA step showed it for every `a` factor and its moments): the same placement,
    so the state it returns is passed to the next step as it is, and the compile report counts
    it as returned as taken (`StepProgram.relaid`). A different split or layout still differs."""
    from jax.experimental.layout import Format, Layout

    from k31jax.train._programs import _placed, same_format

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    x = jax.device_put(jnp.arange(24.0).reshape(2, 4, 3), jax.NamedSharding(mesh, jax.P(None, "x")))
    written_out = Format(x.format.layout, jax.NamedSharding(mesh, jax.P(None, "x", None)))
    assert x.format != written_out and same_format(x.format, written_out, x.ndim)
    assert _placed(x, written_out) is x and not x.is_deleted()
    assert not same_format(x.format, Format(x.format.layout, jax.NamedSharding(mesh, jax.P("x"))), x.ndim)
    assert not same_format(x.format, Format(Layout(major_to_minor=(0, 2, 1)), x.sharding), x.ndim)


def test_sharded_step_equals_the_single_device_step():
    """Two optimizer steps on 8 fake CPU devices (data x expert x tensor, experts run
    expert-parallel) equal the same steps on one device."""
    from k31jax import distributed, sharding
    from k31jax.train import StepProgram

    cfg = tiny_config(dtype="float32")
    optim = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10, eps=1.0)  # linear updates
    settings = StepSettings(backends=Backends(), bias_update_rate=1e-3)
    graphdef, rest, trained, tx, batch = _step_inputs(cfg, optim, 1, 4, 24)
    params = jax.tree.map(np.asarray, overlay(rest, trained))  # host values: the sharded steps donate theirs
    step = jax.jit(train_step, static_argnums=(0, 1, 2))
    r1, t1, opt1 = rest, trained, tx.init(trained)
    for _ in range(2):
        r1, opt1, t1, m1 = step(graphdef, tx, settings, r1, opt1, t1, batch)
    p1 = overlay(r1, t1)

    mesh = sharding.make_mesh(data=2, expert=2, tensor=2)
    model = distributed.shard_model(nnx.merge(graphdef, params), mesh)
    graphdef_s, state_s = nnx.split(model)
    rs, ts, _ = split_for_training(state_s, optim)
    spec = jax.sharding.NamedSharding(mesh, jax.P(None, "data"))
    batch_s = {k: jax.device_put(v, spec) for k, v in batch.items()}
    with sharding.activate(mesh):
        opt_s = jax.jit(tx.init)(ts)
        step_s = StepProgram(train_step)  # the Trainer's program
        for _ in range(2):
            rs, opt_s, ts, ms = step_s(graphdef_s, tx, settings, rs, opt_s, ts, batch_s)
    ps = overlay(rs, ts)
    assert len(ps["moe"]["w_gate"].sharding.device_set) == 8
    np.testing.assert_allclose(ms["loss"], m1["loss"], rtol=1e-5)
    for a, b, p0 in zip(jax.tree.leaves(ps), jax.tree.leaves(p1), jax.tree.leaves(params)):
        moved = np.asarray(b) - np.asarray(p0)
        np.testing.assert_allclose(np.asarray(a) - np.asarray(p0), moved, rtol=1e-3,
                                   atol=1e-3 * np.abs(moved).max() + 1e-12)
