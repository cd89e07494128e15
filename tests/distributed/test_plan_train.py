"""The training memory planner (`k31jax plan --train`): exact state bytes against a hand count
from the spec's parameter table, labels and optimizer state against `k31jax.train`, and the
activation estimate against the residuals JAX actually saves for the backward pass."""

import contextlib
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
# What JAX keeps for a backward pass: jax.ad_checkpoint makes only its printer public.
from jax._src.ad_checkpoint import saved_residuals

from k31jax import distributed
from k31jax.cli import main
from k31jax.config import ModelConfig
from k31jax.distributed import _plan_train
from k31jax.distributed._plan import candidate_meshes
from k31jax.nn import abstract_model
from k31jax.nn._ffn import LatentMoE
from k31jax.ops import Backends
from k31jax.sharding import activate, make_mesh, parse_mesh, rules_for_mesh
from k31jax.train import (OptimConfig, abstract_train_step, apply_lora, chunked_cross_entropy, init_lora,
                          make_optimizer, param_labels)
from k31jax.train._trainer import split_for_training

F32 = 4
D, E, I, ELL = 7168, 896, 3072, 3584
ROUTED_PARAMS = 92 * E * 3 * I * ELL  # architecture.md §13: 2,722,740,830,208
# (params per unit, units, split on expert=8,tensor=8 (ep_tp), split on fsdp=8,expert=8,tensor=8
# (fsdp_ep_tp)). Every non-expert tensor of architecture.md's §13 / §10.1 tables: under ep_tp all of
# them split 8 ways over `tensor` except the router bias; under fsdp_ep_tp a [D, x] / [x, D]
# projection also splits its D side over `fsdp` (64), a latent-side one (q_b, kv_b, f_b,
# wq_b, the convs, every vector) only over `tensor`.
NON_EXPERT = {
    "kda q,k,v,g_proj": (4 * D * 12288, 69, 8, 64),
    "kda o_proj": (12288 * D, 69, 8, 64),
    "kda convs": (3 * 4 * 12288, 69, 8, 8),
    "kda f_a_proj": (D * 128, 69, 8, 64),
    "kda f_b_proj": (128 * 12288, 69, 8, 8),
    "kda b_proj": (D * 96, 69, 8, 64),
    "kda A_log, o_norm": (2 * 128, 69, 8, 8),
    "kda dt_bias": (12288, 69, 8, 8),
    "mla q_a_proj": (D * 1536, 24, 8, 64),
    "mla q_b_proj": (1536 * 18432, 24, 8, 8),
    "mla kv_a_proj": (D * 576, 24, 8, 64),
    "mla kv_b_proj": (512 * 24576, 24, 8, 8),
    "mla g_proj, o_proj": (2 * D * 12288, 24, 8, 64),
    "mla q_a_norm, kv_a_norm": (1536 + 512, 24, 8, 8),
    "indexer wq_b": (1536 * 8192, 24, 8, 8),
    "indexer wk, weights_proj": (D * 128 + D * 64, 24, 8, 64),
    "indexer k_norm": (2 * 128, 24, 8, 8),
    "per-layer norms + AttnRes": (6 * D, 93, 8, 8),
    "dense MLP": (3 * 33792 * D, 1, 8, 64),
    "moe router": (D * E, 92, 8, 64),
    "moe router bias": (E, 92, 1, 1),
    "moe latent down, up": (2 * D * ELL, 92, 8, 64),
    "moe latent norm": (ELL, 92, 8, 8),
    "moe shared experts": (3 * D * 6144, 92, 8, 64),
    "embed, lm_head": (2 * 163840 * D, 1, 8, 64),
    "final norm, output AttnRes": (3 * D, 1, 8, 8),
}
MESHES = {"expert=8,tensor=8": 2, "fsdp=8,expert=8,tensor=8": 3}  # -> the split column


def test_hand_table_is_the_whole_spec_model():
    per_layer = lambda prefix: sum(n for k, (n, *_) in NON_EXPERT.items() if k.startswith(prefix))
    assert per_layer("kda") == 443_740_416 and per_layer("mla") == 232_196_096
    assert per_layer("indexer") == 13_959_424 and per_layer("moe") == 189_927_808
    total = sum(n * units for n, units, *_ in NON_EXPERT.values()) + ROUTED_PARAMS
    assert total == 2_779_484_478_208 + 335_026_176  # text model + the K3.1 indexer


@pytest.mark.parametrize("mesh", list(MESHES))
def test_state_bytes_match_a_hand_count(mesh):
    """K3.1 Pro QAT, experts trained with AdamW, float32 masters."""
    col = MESHES[mesh]
    plan = distributed.plan_training("k31_pro", mesh, trainable="experts", optimizer="adamw", master_dtype="float32")
    expert_split = 8 * 8 * (8 if "fsdp" in mesh else 1)  # experts / expert_mlp / latent
    experts = ROUTED_PARAMS * F32 // expert_split
    rest = sum(row[0] * row[1] * F32 // row[col] for row in NON_EXPERT.values())
    assert plan.state["weights_experts"] == experts
    assert plan.state["weights_rest"] == rest
    assert plan.weights == experts + rest
    assert plan.gradients == experts  # train_step differentiates only the trained leaves
    assert plan.state["moments_experts"] == 2 * experts and plan.state["moments_rest"] == 0
    assert plan.optimizer_state == 2 * experts + 16  # + 2 AdamW groups x (Adam, schedule) int32 counters
    table = plan.table("h200")
    assert f"{experts:>19,}" in table and f"{2 * experts:>19,}" in table and f"{plan.total:,}" in table


def test_training_all_adds_exactly_the_non_expert_moments():
    for mesh in MESHES:
        experts = distributed.plan_training("k31_pro", mesh, trainable="experts")
        every = distributed.plan_training("k31_pro", mesh, trainable="all")
        router_bias = 92 * E * F32  # never trained by gradient, replicated
        assert every.weights == experts.weights
        assert every.gradients - experts.gradients == experts.state["weights_rest"] - router_bias
        assert every.optimizer_state - experts.optimizer_state == 2 * (experts.state["weights_rest"] - router_bias)
        assert every.activations == experts.activations


def test_master_dtype_and_grad_accum():
    f32 = distributed.plan_training("k31_pro", "expert=8,tensor=8")
    bf16 = distributed.plan_training("k31_pro", "expert=8,tensor=8", master_dtype="bfloat16")
    assert bf16.state["weights_experts"] * 2 == f32.state["weights_experts"]
    # the KDA convs, A_log, dt_bias, o_norm and the router bias stay float32
    kept = (69 * (3 * 4 * 12288 + 2 * 128 + 12288)) * F32 // 8 + 92 * E * F32
    assert f32.state["weights_rest"] - bf16.state["weights_rest"] == (f32.state["weights_rest"] - kept) // 2
    accum = distributed.plan_training("k31_pro", "expert=8,tensor=8", grad_accum=4)
    assert accum.gradients == 2 * f32.gradients and accum.total - f32.total == f32.gradients


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_labels_match_the_trainer(optimizer):
    cfg = _plan_train.training_config(ModelConfig.preset("k31_pro"), "float32")
    state = nnx.state(abstract_model(cfg), nnx.Param)
    for trainable in _plan_train.TRAINABLE_SETS:
        labels = jax.tree_util.tree_flatten_with_path(param_labels(state, trainable, optimizer))[0]
        want = {jax.tree_util.keystr(p, simple=True, separator="/"): v for p, v in labels}
        for path, _, dtype, names in distributed._plan._param_leaves(cfg):
            got = _plan_train._label("/".join(path), names, dtype, trainable, optimizer)
            assert got == want["/".join(path)].replace("adamw_no_decay", "adamw"), (trainable, path)


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_optimizer_state_is_what_optax_allocates():
    """The planner's gradients and optimizer state on one device == the trainer's own trees."""
    cfg = _plan_train.training_config(ModelConfig.preset("tiny"), "float32")
    state = nnx.state(abstract_model(cfg), nnx.Param)
    params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    for optimizer in _plan_train.OPTIMIZERS:
        for trainable in _plan_train.TRAINABLE_SETS:
            tx = make_optimizer(OptimConfig(optimizer=optimizer, trainable=trainable), state)
            plan = distributed.plan_training(cfg, {}, trainable=trainable, optimizer=optimizer)
            assert plan.optimizer_state == _nbytes(jax.eval_shape(tx.init, params)), (optimizer, trainable)
            _, trained, _ = split_for_training(state, OptimConfig(optimizer=optimizer, trainable=trainable))
            assert plan.gradients == _nbytes(trained), (optimizer, trainable)


# ----------------------------------------------------------------------------- activations
# A tiny model whose widths all differ, so a term counted with the wrong width shows.
ODD = dict(hidden_size=80, intermediate_size=112, moe_intermediate_size=64, routed_expert_hidden_size=96,
           kv_lora_rank=48, q_lora_rank=40, v_head_dim=24, num_attention_heads=5, index_topk=12, kda_num_heads=3,
           kda_head_dim=16, num_experts=12, num_experts_per_token=3)


def _measured_residuals(cfg, remat, batch, seq):
    """Bytes JAX saves for the backward pass of the loss (parameters themselves excluded)."""
    graphdef, state = nnx.split(abstract_model(cfg))
    params = nnx.to_pure_dict(state)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq)), jnp.int32)
    segments = jnp.asarray(np.repeat([[1] * (seq // 2) + [2] * (seq - seq // 2)], batch, 0), jnp.int32)

    def loss(p):
        model = nnx.merge(graphdef, p)
        hidden = model.hidden_states(tokens, segment_ids=segments, remat=remat, backends=Backends(moe="ragged")).hidden
        return chunked_cross_entropy(hidden, model.lm_head[...], tokens, jnp.ones((batch, seq)), vocab_chunk=128)[0]

    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, what in saved_residuals(loss, params)
               if "from the argument" not in what)


@pytest.mark.parametrize("remat,dtype,batch,seq", [("none", "float32", 1, 100), ("dots", "float32", 2, 72),
                                                   ("full", "bfloat16", 1, 100)])
def test_saved_activations_match_jax_residuals(remat, dtype, batch, seq):
    cfg = _plan_train.training_config(ModelConfig.preset("tiny", **ODD), dtype)
    plan = distributed.plan_training(cfg, {}, master_dtype=dtype, remat=remat, seq_len=seq, micro_batch=batch)
    planned = plan.saved_activations + (plan.activations["fake_quant"] if remat == "none" else 0)
    measured = _measured_residuals(cfg, remat, batch, seq)
    assert abs(planned / measured - 1) < 0.05, (planned, measured)


def test_expert_parallel_moe_residuals_per_device():
    """The expert-parallel MoE layer on a 4 x 2 CPU mesh: what one device saves, against the estimate."""
    cfg = _plan_train.training_config(ModelConfig.preset("tiny", **ODD), "float32")
    mesh = make_mesh("expert=4,tensor=2")
    with activate(mesh):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: LatentMoE(cfg, rngs=nnx.Rngs(0))))
        x = jax.ShapeDtypeStruct((1, 128, cfg.hidden_size), jnp.float32)

        def f(st, x):
            return jnp.sum(nnx.merge(graphdef, st)(x, backends=Backends(ep="ragged")).output)

        per_device = 0.0
        for aval, what in saved_residuals(f, state, x):
            if "from the argument st" in what:
                continue
            n = int(np.prod(aval.shape)) * aval.dtype.itemsize
            if "shard_map" in what:  # shard_map residuals stack every device's along axis 0
                n /= mesh.size
            elif aval.ndim and aval.shape[-1] == cfg.shared_intermediate_size:  # shared experts: over tensor
                n /= mesh.shape["tensor"]
            per_device += n
    shape = parse_mesh("expert=4,tensor=2")
    everything, _, fake_quant, in_rounds = _plan_train._moe(_plan_train._Local(cfg, shape, rules_for_mesh(shape), 1, 128))
    assert in_rounds == 0  # 32 tokens a device: one exchange round
    assert abs((everything + fake_quant) / per_device - 1) < 0.05


def test_remat_orders_and_grows_with_tokens():
    def act(mesh="expert=8,tensor=8", **kw):
        return distributed.plan_training("k31_pro", mesh, **kw).backward_peak

    for seq in (1024, 4096):
        assert act(remat="none", seq_len=seq) > act(remat="dots", seq_len=seq) > act(remat="full", seq_len=seq)
    for remat in ("none", "dots", "full"):
        assert act(remat=remat, seq_len=1024) < act(remat=remat, seq_len=2048) < act(remat=remat, seq_len=4096)
        # tensor-only mesh: rows are never split, so every row adds to each device
        assert act("tensor=8", remat=remat, micro_batch=1) < act("tensor=8", remat=remat, micro_batch=2) \
            < act("tensor=8", remat=remat, micro_batch=4)
        # batch over `expert`: per-device rows grow once the micro-batch outgrows the 8 groups
        assert act(remat=remat, micro_batch=8) < act(remat=remat, micro_batch=16) < act(remat=remat, micro_batch=32)
    full = distributed.plan_training("k31_pro", "expert=8,tensor=8", remat="full")
    carry = 93 * 9 * 4096 * D * F32  # prefix + 8 AttnRes slots, float32, one 4096-token row per layer
    assert full.activations["saved_carry"] == carry
    assert full.activations["fake_quant"] == 3 * (E // 8) * (I // 8) * ELL * F32  # one layer's local experts


def test_suggested_training_mesh_is_the_smallest_that_fits():
    options = dict(master_dtype="bfloat16", seq_len=2048)
    best = distributed.suggest_training_mesh("k31_pro", "b300", **options)
    assert best is not None and best.fits("b300") and not any("QAT" in n for n in best.notes)
    for mesh, rules in candidate_meshes(best.devices // 2):
        plan = distributed.plan_training("k31_pro", mesh, rules=rules, **options)
        assert not plan.fits("b300") or any("QAT" in n for n in plan.notes), mesh
    # float32 masters at 4k tokens: one row's activations alone exceed an H200 at any size
    assert distributed.suggest_training_mesh("k31_pro", "h200", max_devices=1024) is None


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="trainable='lora'"):
        distributed.plan_training("k31_pro", "tensor=8", trainable="lora")
    with pytest.raises(ValueError, match="seq_len=0"):
        distributed.plan_training("k31_pro", "tensor=8", seq_len=0)
    with pytest.raises(ValueError, match="remat='some'"):
        distributed.plan_training("k31_pro", "tensor=8", remat="some")
    # a tensor split the QAT expert path refuses is flagged, not silently planned
    cfg = ModelConfig.preset("tiny", **ODD)
    assert any("QAT cannot run" in n for n in distributed.plan_training(cfg, "expert=2,tensor=4").notes)


def _cli(*argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--train", "--config", "k31_pro", *argv]) == 0
    return out.getvalue()


@pytest.mark.parametrize("mesh", list(MESHES))
def test_cli_prints_the_training_table(mesh):
    text = _cli("--mesh", mesh, "--trainable", "experts", "--device", "h200")
    plan = distributed.plan_training("k31_pro", mesh)
    assert f"QAT fine-tune (trainable experts, adamw) on {mesh}" in text and "AdamW moments, routed experts" in text
    assert f"{plan.total:,}" in text and f"{plan.state['weights_experts']:,}" in text
    assert "-> does NOT fit" in text and "smallest mesh that fits" in text
    assert math.isclose(plan.total / 1e9, float(text.split(" GB per device of")[0].rsplit(" ", 1)[1]), rel_tol=1e-3)


def test_slices_add_the_gradient_shard_each_device_sends_between_them(capsys):
    one = distributed.plan_training("k31_pro", "data=2,expert=64,tensor=4")
    two = distributed.plan_training("k31_pro", "data=2,expert=64,tensor=4", slices=2)
    assert one.cross_slice_bytes == 0 and two.cross_slice_bytes == two.state["trained"] > 0
    assert two.total == one.total  # a slice holds what a data-parallel replica holds
    text = _cli("--mesh", "data=2,expert=64,tensor=4", "--slices", "2")
    assert f"across 2 slices (data-center network), per device per step: the trained gradients' shard, " \
           f"{two.cross_slice_bytes / 1e9:.3f} GB" in text
    with pytest.raises(ValueError, match="data=1 is not a multiple of the slices"):
        distributed.plan_training("k31_pro", "expert=64,tensor=4", slices=2)
    assert main(["plan", "--train", "--config", "k31_pro", "--mesh", "expert=64,tensor=4", "--slices", "2"]) == 2
    assert "--slices 2: the --mesh data axis (1) must be a multiple of the slices" in capsys.readouterr().err


# ----------------------------------------------------------------------------- LoRA
# ODD with MXFP4-packed routed experts (their widths are multiples of the 32-blocks)
PACKED = dict(ODD, expert_weights="mxfp4")


def _device_bytes(tree) -> int:
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("mesh", ["expert=2,tensor=2", "fsdp=2,expert=2,tensor=2"])
@pytest.mark.parametrize("experts", [False, True])
def test_lora_state_is_what_the_step_holds(mesh, experts):
    """Per device: the frozen base, the adapters and their AdamW state, byte for byte the
    arguments of the trainer's LoRA step (`abstract_train_step`, which places the adapters
    as `lora_shardings` does)."""
    cfg = ModelConfig.preset("tiny", **PACKED)
    _, args = abstract_train_step(cfg, make_mesh(mesh), lora_rank=4, lora_experts=experts, micro_batch=4, seq_len=64)
    params, opt_state, adapters = args[3:6]
    plan = distributed.plan_training(cfg, mesh, lora_rank=4, lora_experts=experts, micro_batch=4, seq_len=64)
    s = plan.state
    assert plan.packed_experts and any(a.dtype == jnp.uint8 for a in jax.tree.leaves(params))
    assert s["weights_experts"] + s["weights_rest"] == _device_bytes(params)
    assert s["adapters"] == plan.gradients == _device_bytes(adapters) > 0
    assert plan.optimizer_state == _device_bytes(opt_state)
    assert any(a.sharding.spec != jax.sharding.PartitionSpec() for a in jax.tree.leaves(adapters))  # split
    # adapters beside the routed experts: their slots in the base, and most of the adapters
    assert (s["grads_experts"] > s["grads_rest"]) == experts


@pytest.mark.parametrize("remat,within", [("full", 0.05), ("dots", 0.05), ("none", 0.12)])
def test_lora_saved_activations_match_jax_residuals(remat, within):
    """A LoRA loss (adapters on the defaults, the packed base frozen) saves what the QAT step
    does plus each adapted weight's merged copy: the planner's saved terms against JAX's.
    Without remat the planner counts the inputs of the packed experts' matmuls, which a frozen
    packed weight does not need (no weight gradient): ~10% over at this size."""
    cfg = _plan_train.lora_config(ModelConfig.preset("tiny", **PACKED), "float32", 4, False)
    batch, seq = 1, 100
    graphdef, state = nnx.split(abstract_model(cfg))
    lora = jax.eval_shape(lambda: init_lora(state, distributed.DEFAULT_LORA_TARGETS, 4, 8.0, jax.random.key(0)))
    params = nnx.to_pure_dict(state)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq)), jnp.int32)

    def loss(p, adapters):
        model = nnx.merge(graphdef, apply_lora(p, adapters))
        hidden = model.hidden_states(tokens, remat=remat, backends=Backends(moe="ragged")).hidden
        return chunked_cross_entropy(hidden, model.lm_head[...], tokens, jnp.ones((batch, seq)), vocab_chunk=128)[0]

    measured = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, what in saved_residuals(loss, params, lora)
                   if "from the argument" not in what)
    plan = distributed.plan_training(cfg, {}, lora_rank=4, remat=remat, seq_len=seq, micro_batch=batch)
    act = plan.activations
    planned = plan.saved_activations + act["lora_merged"] + (act["fake_quant"] if remat == "none" else 0)
    assert act["lora_merged"] > 0
    if remat != "none":  # the merged copies are a share of it that the check would see missing
        assert abs((planned - act["lora_merged"]) / measured - 1) > within
    assert abs(planned / measured - 1) < within, (planned, measured)


def test_lora_plan_table_and_refusals(capsys):
    text = _cli("--mesh", "expert=8,tensor=8", "--lora-rank", "16", "--master-dtype", "bfloat16", "--seq-len", "512",
                "--micro-batch", "8", "--device", "v5p")
    plan = distributed.plan_training("k31_pro", "expert=8,tensor=8", lora_rank=16, master_dtype="bfloat16",
                                     seq_len=512, micro_batch=8)
    assert "LoRA fine-tune (rank 16" in text and "routed experts (packed MXFP4, frozen" in text
    assert f"{plan.total:,}" in text and f"{plan.activations['lora_merged']:,}" in text
    # the routed experts stay packed: a quarter-byte each plus the scales, not float masters
    assert plan.state["weights_experts"] < ROUTED_PARAMS / 64 * 0.6
    with pytest.raises(ValueError, match="optimizer='muon' with lora_rank=16"):
        distributed.plan_training("k31_pro", "tensor=8", lora_rank=16, optimizer="muon")
    with pytest.raises(ValueError, match="lora_experts=True with lora_rank=0"):
        distributed.plan_training("k31_pro", "tensor=8", lora_experts=True)
    assert main(["plan", "--config", "k31_pro", "--lora-rank", "4"]) == 2
    assert "--lora-rank / --lora-experts apply with --train" in capsys.readouterr().err
