"""Ahead-of-time compilation for a TPU slice with no TPU (`k31jax.aot`, `k31jax compile`).

The HLO reader is checked on XLA:CPU programs whose costs are known by construction (a scan
of matmuls: XLA's own total counts the loop body once). The TPU compiles need libtpu (the
`tpu` extra, installed in CI) and are skipped with the reason where it cannot load."""

import re

import jax
import jax.numpy as jnp
import pytest

from k31jax import aot
from k31jax.aot import analyse, topology_name

needs_libtpu = pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu not installed (pip install 'k31jax[tpu]')")


def test_loop_trip_counts_multiply_flops_and_bytes():
    n, d, trips = 8, 64, 7

    def f(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    x = jnp.ones((n, d), jnp.float32)
    compiled = jax.jit(f).lower(x, jnp.ones((trips, d, d), jnp.float32)).compile()
    report = analyse(compiled.as_text())
    assert [t for _, t, _ in report.loops] == [trips]
    assert report.flops == trips * 2 * n * d * d
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    assert report.flops > 5 * xla["flops"]  # XLA's own total counts the body once
    # every trip reads its weight slice: at least the whole stack once
    assert report.hbm_bytes >= trips * d * d * 4
    # by source: taking and using the weight slice moves the most, and the sources sum to the total
    assert re.search(r"dynamic_slice|dot_general", report.traffic[0][1]) and report.traffic[0][0] >= trips * d * d * 4
    assert sum(b for b, _ in analyse(compiled.as_text(), top=100).traffic) == report.hbm_bytes


def test_a_data_dependent_loop_is_counted_as_told():
    def f(x, n):
        with jax.named_scope("my_loop"):
            return jax.lax.fori_loop(0, n, lambda i, h: h @ h, x)

    text = jax.jit(f).lower(jnp.ones((16, 16)), 3).compile().as_text()
    once, thrice = analyse(text), analyse(text, {"my_loop": 3})
    assert once.dynamic_loops and once.loops[0][1] is None
    assert thrice.flops == 3 * once.flops == 3 * 2 * 16 ** 3


_RELAYOUT_THEN_SLICE = """HloModule m

%relayout (p: bf16[4,64,128]) -> bf16[4,64,128] {
  %p = bf16[4,64,128]{2,1,0:T(16,128)(2,1)} parameter(0)
  ROOT %c = bf16[4,64,128]{2,1,0:T(8,128)(2,1)} copy(%p)
}

%one_layer (q: bf16[4,64,128], i: s32[]) -> bf16[64,128] {
  %q = bf16[4,64,128]{2,1,0:T(16,128)(2,1)} parameter(0)
  %i = s32[] parameter(1)
  %f = bf16[4,64,128]{2,1,0:T(8,128)(2,1)} fusion(%q), kind=kLoop, calls=%relayout
  %z = s32[] constant(0)
  %ds = bf16[1,64,128]{2,1,0:T(8,128)(2,1)} dynamic-slice(%f, %i, %z, %z), dynamic_slice_sizes={1,64,128}
  ROOT %b = bf16[64,128]{1,0:T(8,128)(2,1)} bitcast(%ds)
}

%copied (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  ROOT %c = f32[1024]{0} copy(%a)
}

ENTRY %main (w: bf16[4,64,128], i: s32[], x: f32[1024]) -> (bf16[64,128], f32[1024]) {
  %w = bf16[4,64,128]{2,1,0:T(16,128)(2,1)} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[1024]{0} parameter(2)
  %r = bf16[64,128]{1,0} fusion(%w, %i), kind=kLoop, calls=%one_layer
  %s = ((), (), (u32[]{:S(8)})) call-start(), async_execution_thread="sparsecore", to_apply=%copied
  %u = ((f32[1024]{0}), f32[1024]{0}) call-update(%s, %x)
  %d = f32[1024]{0} call-done(%u)
  ROOT %t = (bf16[64,128]{1,0}, f32[1024]{0}) tuple(%r, %d)
}
"""


_ASYNC_COLLECTIVES = """HloModule m

ENTRY %main (x: bf16[64,256], o: bf16[512,256], n: s32[8]) -> (bf16[512,256], bf16[64,256], bf16[256,256]) {
  %x = bf16[64,256]{1,0} parameter(0)
  %o = bf16[512,256]{1,0} parameter(1)
  %n = s32[8]{0} parameter(2)
  %r = ((bf16[64,256]{1,0}, bf16[512,256]{1,0}, s32[8]{0}, s32[8]{0}, s32[8]{0}, s32[8]{0}), bf16[512,256]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) ragged-all-to-all-start(%x, %o, %n, %n, %n, %n), replica_groups={{0,1,2,3,4,5,6,7}}
  %rd = bf16[512,256]{1,0} ragged-all-to-all-done(%r)
  %p = (bf16[64,256]{1,0}, bf16[64,256]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %pd = bf16[64,256]{1,0} collective-permute-done(%p)
  %g = ((bf16[64,256]{1,0}), bf16[256,256]{1,0}) all-gather-start(%x), dimensions={0}, replica_groups={{0,1,2,3}}
  %gd = bf16[256,256]{1,0} all-gather-done(%g)
  ROOT %t = (bf16[512,256]{1,0}, bf16[64,256]{1,0}, bf16[256,256]{1,0}) tuple(%rd, %pd, %gd)
}
"""


def test_an_async_collective_counts_its_result_not_its_operands_or_context():
    coll = analyse(_ASYNC_COLLECTIVES).collectives
    row = 256 * 2
    assert coll["ragged-all-to-all"] == (1, 512 * row)
    assert coll["collective-permute"] == (1, 64 * row)
    assert coll["all-gather"] == (1, 256 * row)


def test_a_fused_relayout_read_through_a_slice_and_an_async_copy_are_counted_once():
    """A layer of a stack taken through a fused relayout reads the layer, not the stack (the
    emitter makes only the windows the slice reads); an asynchronous call (a SparseCore copy:
    call-start, call-update, call-done) reads its argument and writes its result once."""
    report = analyse(_RELAYOUT_THEN_SLICE)
    layer, vector = 64 * 128 * 2, 1024 * 4
    assert report.hbm_bytes == 2 * layer + 4 + 2 * vector  # + the s32 layer index
    assert [(b, s, o) for b, s, o, _ in report.largest[:2]] == [(layer, "bf16[64,128]", "fusion"),
                                                                (vector, "f32[1024]", "call-update")]


def test_the_peak_breakdown_names_what_is_live_and_counts_an_in_place_chain_once():
    """The values XLA's live-range dump lists at the peak, named by the op_name of the
    instruction that made them (a parameter's argument path), summed per source; a
    dynamic-update-slice of a live buffer is that buffer, counted once."""
    from k31jax.aot import peak_breakdown

    live_range = """HloLiveRange (max 9):
  Live ranges at 7 (peak):
    param.1{}: 400 bytes (cumulative: 400 bytes)
    dynamic-update-slice.2{}: 400 bytes (cumulative: 800 bytes)
    fusion.3{}: 96 bytes (cumulative: 896 bytes)
    fusion.4{}: 64 bytes (cumulative: 960 bytes)
    copy.5{0}: 32 bytes (cumulative: 992 bytes)
    copy.5{1}: 32 bytes (cumulative: 1024 bytes)
  Stack trace breakdown for peak usage: 1 024 bytes
"""
    hlo = """HloModule m, is_scheduled=true

ENTRY %main (param.1: f32[100], p.2: f32[8]) -> f32[100] {
  %param.1 = f32[100]{0} parameter(0), metadata={op_name="cache[\\'mla_ckv\\']"}
  %p.2 = f32[8]{0} parameter(1)
  %c = s32[] constant(0)
  %fusion.3 = f32[24]{0} fusion(%p.2), kind=kLoop, calls=%f, metadata={op_name="jit(step)/dot_general"}
  %fusion.4 = f32[16]{0} fusion(%p.2), kind=kLoop, calls=%f, metadata={op_name="jit(step)/dot_general"}
  %copy.5 = (f32[8]{0}, f32[8]{0}) copy(%p.2)
  ROOT %dynamic-update-slice.2 = f32[100]{0} dynamic-update-slice(%param.1, %p.2, %c), metadata={op_name="jit(step)/dus"}
}
"""
    assert peak_breakdown(live_range, hlo) == [(400, "cache['mla_ckv']"), (160, "jit(step)/dot_general"),
                                               (64, "copy.5")]
    assert peak_breakdown(live_range, hlo, top=1) == [(400, "cache['mla_ckv']")]
    assert peak_breakdown("HloLiveRange (max 3):\n", hlo) == []


@pytest.mark.parametrize("name,want", [("v5p-128", "v5p:4x4x4"), ("v5e-16", "v5e:4x4"), ("tpu7x-64", "tpu7x:2x4x4"),
                                       ("v6e:2x4", "v6e:2x4")])
def test_named_slices_become_topologies(name, want):
    assert topology_name(name) == want


def test_a_bad_slice_name_is_one_clear_error():
    with pytest.raises(aot.CompileError, match="v9x-8.*expected a libtpu topology"):
        topology_name("v9x-8")


def test_expected_local_experts():
    from k31jax import ModelConfig

    cfg = ModelConfig.preset("k31_pro")
    # 8 tokens x top-16 of 896 experts, 8 expert shards: ~15 of each shard's 112
    assert 14.5 < aot.expected_local_experts(cfg, 8, 8) < 15.5
    assert aot.expected_local_experts(cfg, 1 << 16, 8) == pytest.approx(112)


def test_compile_without_libtpu_says_what_to_install(monkeypatch, capsys):
    from k31jax.cli import main

    monkeypatch.setattr(aot, "libtpu_available", lambda: False)
    assert main(["compile", "--config", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'k31jax[tpu]'" in err
    # --config takes a preset or a config.json; anything else is named in one line
    assert main(["compile", "--config", "no/such/config.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--config 'no/such/config.json': no such config file" in err


def _check_report(report: dict, step: str):
    m, p, h = report["memory"], report["planner"], report["hlo"]
    assert report["devices"] == 4 and report["fits"] and report["compile_seconds"] > 0
    # the engine's programs donate the cache (and the decode sampler): the compiler aliases all
    # of it (TPU tiles pad small arrays, so per-device bytes are at least the planner's)
    assert m["aliased"] >= p["donated"] >= p["cache"] > 0
    assert m["arguments"] >= p["weights"] + p["cache"] + p["inputs"]
    assert h["flops"] > 0 and h["hbm_bytes"] > 0 and h["collectives"]
    assert report["step"] == step
    # what the compiler holds at its peak, from its own live-range dump
    assert report["peak"] and 0 < sum(b for b, _ in report["peak"]) <= report["total"]


@needs_libtpu
def test_k31jax_compile_decode_for_a_tpu_slice(tmp_path, capsys):
    import json

    from k31jax.cli import main

    out = tmp_path / "decode.json"
    assert main(["compile", "--config", "tiny", "--topology", "v5e:2x2", "--mesh", "expert=2,tensor=2", "--batch", "2",
                 "--context", "256", "--json", str(out), "--dump", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "temporaries" in text and "planner floor" in text and "fits" in text and "collectives" in text
    report = json.loads(out.read_text())
    assert report["tokens"] == 2 and (tmp_path / "tiny.decode.hlo.txt").read_text().startswith("HloModule")
    _check_report(report, "decode")


@needs_libtpu
def test_k31jax_compile_the_speculative_verify_step(tmp_path):
    """The verify step (3 drafted tokens and the last one per row, every position's KDA state
    kept) compiles for a slice beside the decode step: its cache and sampler donated and
    aliased, the HLO the engine's `_verify` program."""
    import json

    from k31jax.cli import main

    out = tmp_path / "verify.json"
    assert main(["compile", "--config", "tiny", "--topology", "v5e:2x2", "--mesh", "expert=2,tensor=2", "--batch", "2",
                 "--context", "256", "--step", "verify", "--draft", "3", "--json", str(out), "--dump",
                 str(tmp_path)]) == 0
    report = json.loads(out.read_text())
    assert report["tokens"] == 2 * 4
    _check_report(report, "verify")
    assert "jit(_verify)" in (tmp_path / "tiny.verify.hlo.txt").read_text()


@needs_libtpu
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_no_float_copy_of_a_layers_experts_at_decode(step, tmp_path):
    """Expert dims no other tensor has (12 local experts, 64 wide, 96 latent): a float
    `[12, 64, 96]` / `[12, 96, 64]` is a whole layer's local experts decoded. Decode never makes
    one (the selected form decodes one expert at a time); prefill's ragged_dot reads whole layers."""
    from k31jax import ModelConfig

    cfg = ModelConfig.preset("tiny").replace(num_experts=24, moe_intermediate_size=128, routed_expert_hidden_size=96,
                                             expert_weights="mxfp4")
    report = aot.compile_program(cfg, "v5e:2x2", "expert=2,tensor=2", step=step, batch=2, context=128, chunk=32,
                                 dump=tmp_path)
    _check_report(report.as_dict(), step)
    text = (tmp_path / f"model.{step}.hlo.txt").read_text()
    whole = re.findall(r"(?:bf16|f32)\[(?:12,64,96|12,96,64)\]", text)
    assert bool(whole) == (step == "prefill")
    # decode: the selected-experts loops, counted at the expected number of chosen experts
    assert bool(report.hlo.dynamic_loops) == (step == "decode")
    assert report.floor_note.startswith("experts: all local" if step == "prefill" else "experts: the")


@needs_libtpu
def test_decode_with_the_pallas_tpu_kernel_reads_the_expert_stacks_in_place(tmp_path):
    """`k31jax compile --kernels pallas`: the state holds the experts in the Mosaic kernel's
    layout, each MoE layer runs the kernel (gate/up fused, then down) on its expert-parallel rows,
    the stacks reach it uncopied (no copy, no float decode of a layer's experts), the cache is
    aliased, and the report counts the kernel by its cost estimate: far below the stacks. The
    KDA layers run the Mosaic decode step and the MLA layers the indexer's scores (and, at a
    short context, the sparse attention) on each device's rows and heads (`ops.per_device`):
    no state gathered."""
    import json

    from k31jax.cli import main
    from k31jax.ops import Backends

    cfg = _tile_filling_config()
    out = tmp_path / "decode.json"
    report = aot.compile_program(cfg, "v5p:2x2x1", "expert=2,tensor=2", step="decode", batch=8, context=1024,
                                 dump=tmp_path, backends=Backends(kernels="pallas", ep="ragged"))
    _check_report(report.as_dict(), "decode")
    text = (tmp_path / "model.decode.hlo.txt").read_text()
    launches = sum('custom_call_target="tpu_custom_call"' in line for line in text.splitlines()
                   if "mxfp4_gmm_tpu" in line)
    assert launches >= 2 and launches % 2 == 0  # per MoE layer (or scanned body): gate/up, then down
    experts = [line for line in text.splitlines() if re.search(r"\b(copy|transpose|fusion)\(", line)
               and "['moe']['w_" in line]
    assert not experts, experts[0][:200]
    # the XLA path over every local expert (32 assignments of 32 experts; "auto" would visit the
    # chosen ones one at a time, `FEW_ASSIGNMENTS_PER_EXPERT`)
    held = aot.compile_program(cfg, "v5p:2x2x1", "expert=2,tensor=2", step="decode", batch=8, context=1024,
                               backends=Backends(kernels="xla", ep="ragged", moe="ragged"))
    assert report.hlo.hbm_bytes < held.hlo.hbm_bytes
    assert "kda_decode_tpu" in text and "indexer_scores_tpu" in text
    # nothing gathered: the kernels' collectives are the XLA path's, but that the indexer's query
    # heads are gathered (a few KB) where the XLA path all-reduces its [B, S] scores
    coll, coll_xla = report.hlo.collectives, held.hlo.collectives
    assert set(coll) == set(coll_xla) and all(coll[k][1] <= coll_xla[k][1] + (16 << 10) for k in coll)
    assert sum(b for _, b in coll.values()) <= sum(b for _, b in coll_xla.values())
    assert re.search(r"mxfp4_gmm_tpu", " ".join(name for _, name in report.hlo.traffic))
    # top-128 of 1,024 bf16 rows keeps the XLA gather (`ops._mla.MAX_TILE_READ`); of 256, the
    # sparse MLA kernel reads the latent stacks at each layer's row, on each device's rows
    short = aot.compile_program(cfg, "v5p:2x2x1", "expert=2,tensor=2", step="decode", batch=8, context=256,
                                dump=tmp_path / "short", backends=Backends(kernels="pallas", ep="ragged"))
    _check_report(short.as_dict(), "decode")
    assert "sparse_mla_tpu" not in text and "sparse_mla_tpu" in (tmp_path / "short" / "model.decode.hlo.txt").read_text()
    # the CLI flag reaches the same program
    assert main(["compile", "--config", "tiny", "--topology", "v5e:2x2", "--mesh", "expert=2,tensor=2", "--batch",
                 "2", "--context", "128", "--kernels", "pallas", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["hlo"]["flops"] > 0


@needs_libtpu
def test_k31jax_compile_train_step(tmp_path, capsys):
    """The trainer's QAT step (float master experts, AdamW over the experts) of a model given by
    a config.json (`tiny` cut to 4 layers, KDA and MLA twice): it compiles, the updated
    optimizer state and trained leaves are aliased, and the planner plans it."""
    import json
    from pathlib import Path

    import k31jax
    from k31jax.cli import main

    out = tmp_path / "train.json"
    raw = json.loads((Path(k31jax.__file__).parent / "configs" / "tiny.json").read_text())
    raw["text_config"]["num_hidden_layers"] = 4
    raw["text_config"]["linear_attn_config"].update(full_attn_layers=[2, 4], kda_layers=[1, 3])
    config = tmp_path / "tiny4.json"
    config.write_text(json.dumps(raw))
    assert main(["compile", "--config", str(config), "--topology", "v5e:2x2", "--mesh", "expert=4", "--step", "train",
                 "--batch", "1", "--seq-len", "64", "--remat", "none", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    m, p = report["memory"], report["planner"]
    assert report["step"] == "train" and report["fits"] and report["tokens"] == 64
    assert p["donated"] > p["updated"] > 0 and m["aliased"] >= p["updated"]
    assert m["arguments"] >= p["donated"] + p["inputs"]
    assert p["total"] > p["donated"]  # the planner's full plan: state plus activations
    assert report["hlo"]["flops"] > 0 and "train of tiny4" in capsys.readouterr().out
    assert report["slices"] == 1 and report["hlo"]["cross_slice"] == {}  # one slice: nothing crosses


def _tile_filling_config():
    """K3.1 Pro's structure (KDA, gated DSA MLA with the indexer, LatentMoE with MXFP4 experts,
    AttnRes) at widths that fill TPU tiles (multiples of 128), 4 layers: big enough that
    weights and cache dominate the compiler's buffers, small enough to compile in seconds.
    (`tiny`'s 16- and 32-wide tensors are mostly tile padding on a TPU.)"""
    from k31jax import ModelConfig

    return ModelConfig.preset("k31_pro").replace(
        num_hidden_layers=4, layer_types=("kda", "kda", "kda", "mla"), vocab_size=8192, hidden_size=512,
        intermediate_size=1024, num_attention_heads=4, q_lora_rank=256, kv_lora_rank=256, kda_num_heads=4,
        kda_a_log_len=4, index_n_heads=4, index_topk=128, num_experts=32, num_experts_per_token=4,
        moe_intermediate_size=512, routed_expert_hidden_size=256, attn_res_block_size=2, expert_weights="mxfp4")


@needs_libtpu
def test_the_planner_is_within_ten_percent_of_the_compiler_at_decode():
    """The planner's per-device total against the compiler's buffers (its total less the
    generated code, which the planner does not model) for a decode step with the donated cache."""
    report = aot.compile_program(_tile_filling_config(), "v5p:2x2x1", "expert=2,tensor=2", step="decode", batch=8,
                                 context=1024)
    _check_report(report.as_dict(), "decode")
    assert report.memory["temporaries"] <= 0.5 * report.memory["arguments"]
    assert 0.9 <= report.planner_ratio <= 1.1, report.table()


@needs_libtpu
def test_a_program_that_does_not_fit_says_what_the_compiler_held_at_its_peak():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from k31jax.aot._compile import _compile

    mesh = Mesh(aot.tpu_devices("v5e:2x2"), ("x",))
    x = jax.ShapeDtypeStruct((150_000,), jnp.float32, sharding=NamedSharding(mesh, P()))
    squares = jax.jit(lambda x: jnp.sort(jnp.sort(jnp.outer(x, x), axis=1) * 2, axis=0))  # 90 GB temporaries
    failed = r"outer: the TPU compiler failed: RESOURCE_EXHAUSTED.*; at its peak: .*90\.00 GB"
    with pytest.raises(aot.CompileError, match=failed):
        _compile(squares, (x,), mesh, None, "outer", None)


@needs_libtpu
def test_qat_fake_quant_under_a_grouped_matmul_holds_no_float_copies_of_the_weight():
    """QAT's fake-quantised expert weight feeding `ragged_dot` (which wants the weight's blocked
    axis minor), with both gradients, compiled for a TPU: its temporaries stay near two weights
    (the fake-quantised one and its layout copy). Scale factors derived per block and
    broadcast were eight f32 copies beside an s32 one: ten weights."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from k31jax.quant import fake_quant

    mesh = Mesh(aot.tpu_devices("v5p:2x2x1")[:1], ("x",))
    one = NamedSharding(mesh, P())
    w = jax.ShapeDtypeStruct((32, 512, 512), jnp.bfloat16, sharding=one)
    x = jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16, sharding=one)
    sizes = jax.ShapeDtypeStruct((32,), jnp.int32, sharding=one)

    rows_by_expert = jax.lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])  # x @ w[e].T

    def loss(w, x, sizes):
        y = jax.lax.ragged_dot_general(x, fake_quant(w), sizes, rows_by_expert, preferred_element_type=jnp.float32)
        return jnp.sum(y * y)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, x, sizes).compile()
    weight = 32 * 512 * 512 * 2
    assert compiled.memory_analysis().temp_size_in_bytes <= 3 * weight


@needs_libtpu
def test_decode_reads_a_split_w_down_scale_stack_in_place(tmp_path):
    """A `w_down` whose intermediate is split over `tensor` leaves each device 12 scale blocks a
    row (as K3.1 Pro's on tensor=8). XLA:TPU lays such a uint8 stack out with the 12 outside the
    experts and re-tiled the whole stack in every decode call for the loop that reads one
    expert at a time; the tiled scale layout (`quant.tile_scales`) it reads in place."""
    from k31jax.distributed import abstract_state
    from k31jax.nn import expert_words
    from k31jax.sharding import rules_for_mesh

    # w_down [32, 512, 768]: 24 scale blocks a row, 12 a device
    cfg = _tile_filling_config().replace(moe_intermediate_size=768, routed_expert_hidden_size=512)
    report = aot.compile_program(cfg, "v5e:2x2", "expert=2,tensor=2", step="decode", batch=2, context=256,
                                 dump=tmp_path)
    _check_report(report.as_dict(), "decode")
    mesh = aot.slice_mesh(aot.tpu_devices("v5e:2x2"), "expert=2,tensor=2")
    _, state = abstract_state(cfg, mesh, rules_for_mesh(dict(mesh.shape)))
    scale = expert_words(state)["moe"]["w_down"]["scale"].get_value()
    assert scale.dtype == jnp.uint16 and scale.sharding.shard_shape(scale.shape)[-3:] == (1, 512 * 12 // 256, 128)
    text = (tmp_path / "model.decode.hlo.txt").read_text()
    layers, experts = scale.shape[0], scale.sharding.shard_shape(scale.shape)[1]
    stack_copies = re.findall(rf"= u(?:8|16)\[{layers},{experts},[\d,]+\]\S* copy\(", text)
    assert not stack_copies, stack_copies


@needs_libtpu
def test_decode_reads_the_per_head_projection_stacks_in_place(tmp_path):
    """The MLA `q_b_proj` / `kv_b_proj` and KDA `f_b_proj` / `g_proj` stacks, whose outputs a
    decode step reads head by head: XLA:TPU wants them `out`-major and copied each `[n, in, out]` stack
    whole in every decode call. Held transposed (`nn.out_major_projections`, what the engine
    and `aot` do for a TPU) they are read in place. 8 layers: the stacks are read in a scan."""
    from k31jax.nn import OUT_MAJOR_PROJECTIONS

    cfg = _tile_filling_config().replace(num_hidden_layers=8, layer_types=("kda", "kda", "kda", "mla") * 2)
    report = aot.compile_program(cfg, "v5e:2x2", "expert=2,tensor=2", step="decode", batch=2, context=256,
                                 dump=tmp_path)
    _check_report(report.as_dict(), "decode")
    text = (tmp_path / "model.decode.hlo.txt").read_text()
    params = {m.group(2): m.group(1) for m in re.finditer(r"(%param\.\d+) = \S+ parameter\(\d+\), "
                                                        r"metadata=\{op_name=\"(state[^\"]+)\"", text)}
    stacks = tuple(f"state[\\'{stack}\\'][\\'{name}\\']" for stack, ns in OUT_MAJOR_PROJECTIONS.items() for name in ns)
    sources = {param for name, param in params.items() if name.startswith(stacks)}
    assert len(sources) == len(stacks), sorted(params)
    # a copy of a whole stack: of its parameter, or of the async copy that brings it in
    sources |= {m.group(1) for m in re.finditer(r"(%copy-start\.\d+) = \S+ copy-start\((%param\.\d+)\)", text)
                if m.group(2) in sources}
    sources |= {m.group(1) for m in re.finditer(r"(%copy-done\.\d+) = \S+ copy-done\((%copy-start\.\d+)\)", text)
                if m.group(2) in sources}
    copies = [m.group(0) for m in re.finditer(r"= \S+ copy\((%[\w.-]+)\)", text) if m.group(1) in sources]
    assert not copies, copies


@needs_libtpu
def test_the_kda_chunk_scan_gathers_its_inputs_once_per_layer_not_once_per_chunk():
    """A 2,048-token prefill chunk of one row, 8 layers (a scanned layer group), expert=4: the
    expert-parallel MoE splits the row's tokens over `expert`. Without the KDA layer's
    constraint (tokens whole, heads split) that split reached the chunk scan's inputs and every
    one of the 32 chunk steps all-gathered all of them: 1,057 all-gathers moving 3.3 GB here."""
    cfg = _tile_filling_config().replace(num_hidden_layers=8, layer_types=("kda", "kda", "kda", "mla") * 2,
                                         kda_num_heads=8, kda_a_log_len=8)
    report = aot.compile_program(cfg, "v5p:2x2x2", "expert=4,tensor=2", step="prefill", batch=1, context=4096,
                                 chunk=2048)
    count, moved = report.hlo.collectives["all-gather"]
    assert count < 300 and moved < 0.5e9, (count, moved)


@needs_libtpu
def test_the_exchange_in_rounds_bounds_an_expert_parallel_training_layers_temporaries():
    """The expert-parallel routed experts with the gradients of their input and weights,
    compiled for a TPU slice (expert=4, 1,024 tokens a device, top-8): exchanged in one round
    the worst-case receive buffer (every peer sends all its assignments here) and its
    cotangents fill the temporaries; in eight rounds they exist one round at a time."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from k31jax import ops, sharding

    mesh = Mesh(aot.tpu_devices("v5p:2x2x1"), ("expert",))
    n, k, e, i, ell = 4096, 8, 64, 256, 512
    sds = jax.ShapeDtypeStruct
    tok, ex = NamedSharding(mesh, P("expert")), NamedSharding(mesh, P("expert", None, None))
    args = (sds((n, ell), jnp.bfloat16, sharding=tok), sds((n, k), jnp.int32, sharding=tok),
            sds((n, k), jnp.float32, sharding=tok),
            tuple(sds(s, jnp.bfloat16, sharding=ex) for s in ((e, i, ell), (e, i, ell), (e, ell, i))))
    worst = 4 * (n // 4) * k * ell * 4  # one round's fp32 receive buffer, in one round
    temps = {}
    with sharding.activate(mesh, "ep_tp"):
        plan = ops.make_ep_plan(n, args[3], exchange="ragged")
        for rounds, budget in ((1, worst), (8, worst // 8)):
            assert ops.exchange_rounds(n // 4, k, 4, ell, budget) == rounds

            def loss(x, idx, pw, w, budget=budget):
                y = ops.ep_routed_experts(x, idx, pw, *w, plan=plan, local="ragged", round_bytes=budget)
                return jnp.sum(y * y)

            compiled = jax.jit(jax.grad(loss, argnums=(0, 3))).lower(*args).compile()
            temps[rounds] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[1] > 3 * worst            # the one round's buffers and cotangents
    assert temps[8] < temps[1] / 3, temps


@needs_libtpu
def test_the_training_step_lets_the_compiler_lay_out_its_state_and_keeps_it(tmp_path):
    """The trainer's QAT step compiled as `Trainer` runs it (`train.StepProgram`: the donated
    state's layouts left to XLA:TPU). With the default layouts, the trained routed-expert
    stacks (`[E, out, in]`, `in` minor) were copied whole to the `out`-minor layout the
    grouped matmuls read, in the forward pass and again in the backward (10 stack-sized copies
    here; 3.55 GB each at K3.1 Pro scale). Now the stacks arrive in that layout: at most one
    copy of each of `w_gate` / `w_up`, which the backward reads the other way; and the state
    comes back in the formats it went in, so the trainer places it once, not every step."""
    cfg = _tile_filling_config().replace(num_hidden_layers=8, layer_types=("kda", "kda", "kda", "mla") * 2)
    report = aot.compile_program(cfg, "v5e:2x2", "fsdp=2,expert=2", step="train", batch=4, context=256,
                                 dump=tmp_path, train=aot.TrainSettings(master_dtype="bfloat16", seq_len=256))
    assert report.state_formats_changed == 0
    assert report.memory["aliased"] >= report.planner["updated"]
    text = (tmp_path / "model.train.hlo.txt").read_text()
    stacks = {m.group(1) for m in re.finditer(r"= (bf16\[[\d,]+\])\{[^}]*\} parameter\(\d+\), "
                                              r"metadata=\{op_name=\"trainable\[\\'moe\\'\]\[\\'w_", text)}
    assert stacks, "no trained expert stack among the parameters"
    copies = [m.group(0) for m in re.finditer(r"= (bf16\[[\d,]+\])\{[^}]*\} copy\(", text) if m.group(1) in stacks]
    assert len(copies) <= 2, copies


@needs_libtpu
def test_the_planner_is_within_ten_percent_of_the_compiler_for_a_lora_step():
    """A LoRA step on the packed base (rank-8 adapters on attention and the shared experts,
    placed as `lora_shardings` places them): the planner's total (the frozen packed base, the
    adapters and their moments, the activations with each adapted weight's merged copy and its
    cotangent) against the compiler's buffers; the state comes back in the formats it went in."""
    report = aot.compile_program(_tile_filling_config(), "v5p:2x2x1", "expert=2,tensor=2", step="train", batch=4,
                                 context=256, train=aot.TrainSettings(master_dtype="bfloat16", seq_len=256,
                                                                      lora_rank=8))
    assert report.state_formats_changed == 0
    assert 0.9 <= report.planner_ratio <= 1.1, report.table()


@needs_libtpu
def test_a_two_slice_training_step_sends_the_gradients_between_slices(tmp_path):
    """Multi-slice (`num_slices=2`, the data axis across the slices): the TPU compiler keeps
    every collective inside a slice and carries what crosses the data-center network as
    megascale sends. Their all-reduces carry exactly the planner's bytes, each device's shard
    of the trained gradients, plus a few scalars (the loss and token counts). The one other
    crossing is the embedding lookup's rows gathered over the data axis once per step (the
    partitioner's choice for a table split along `embed` over fsdp): listed, and small."""
    report = aot.compile_program(_tile_filling_config(), "v5e:2x2", "data=2,fsdp=2,expert=2", step="train", batch=8,
                                 slices=2, train=aot.TrainSettings(seq_len=64, remat="none"))
    assert report.slices == 2 and report.devices == 8 and report.fits
    crossing = dict(report.hlo.cross_slice)
    planned = report.planner["cross_slice"]
    assert planned > 0 and 0 <= crossing.pop("all-reduce")[1] - planned <= 16 * 1024, (report.hlo.cross_slice, planned)
    assert sum(b for _, b in crossing.values()) < planned / 100, crossing
    table = report.table()
    assert "across slices (data-center network)" in table and "all-reduce (all-reduce." in table


def test_a_multi_slice_mesh_keeps_all_but_the_data_axis_inside_a_slice():
    class Device:
        def __init__(self, i):
            self.id, self.slice_index = i, i // 4

    with pytest.raises(aot.CompileError, match="data=1 is not a multiple of the 2 slices"):
        aot.slice_mesh([Device(i) for i in range(8)], "expert=4,tensor=2")
    mesh = aot.slice_mesh([Device(i) for i in (4, 5, 6, 7, 0, 1, 2, 3)], "data=2,expert=4")
    assert [[d.slice_index for d in row] for row in mesh.devices.reshape(2, 4)] == [[0] * 4, [1] * 4]
