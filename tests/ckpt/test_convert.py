"""The converter end to end on `tiny` written in the release layout (3 shards + index,
per-expert MXFP4, vision tower + projector): convert -> load_checkpoint -> the same logits
as the model built directly from the same weights; export -> every source tensor (and every
file) reproduced bytewise; dry run, verify, dtype / expert-weight options, progress bar,
sharded restore, and the Kimi Linear and K3 golden checkpoints through the converter."""

import io
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.paths import GOLDEN_DIR, SHARED_DATA_DIR
from helpers.release import release_ready_model, tensors_of, write_model_release
from k31jax import convert, export
from k31jax.ckpt._convert import compare_with_source
from k31jax import dequantize_experts, load_hf_weights
from k31jax.ckpt import (CheckpointError, SafetensorsIndex, TensorReader, checkpoint_info, load_checkpoint,
                         load_vision)

GOLDEN_KL = GOLDEN_DIR / "kimi_linear_tiny"
GOLDEN_K3 = SHARED_DATA_DIR / "k3_golden_tiny"
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 384, (2, 24)), jnp.int32)
logits_of = nnx.jit(lambda m, t: m(t).logits)


def params(model):
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    model, p = release_ready_model(seed=3)
    src = write_model_release(tmp_path_factory.mktemp("release") / "tiny", model, p)
    return src, model


@pytest.fixture(scope="module")
def converted(release, tmp_path_factory):
    src, _ = release
    dst = tmp_path_factory.mktemp("ckpt") / "tiny-orbax"
    return convert(src, dst, verify=True)


def test_fixture_is_release_layout(release):
    src, model = release
    names = sorted(p.name for p in src.iterdir())
    assert names == ["config.json", "model-00001-of-000003.safetensors", "model-00002-of-000003.safetensors",
                     "model-00003-of-000003.safetensors", "model.safetensors.index.json"]
    t = tensors_of(src)
    e = "language_model.model.layers.1.block_sparse_moe.experts.5."
    assert t[e + "w1.weight_packed"].dtype == np.uint8 and t[e + "w1.weight_packed"].shape == (32, 16)
    assert t[e + "w2.weight_scale"].shape == (32, 1)
    assert t["language_model.model.layers.0.self_attn.A_log"].dtype == np.float32
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in t and "mm_projector.proj.2.weight" in t
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"


def test_round_trip_logits_equal(release, converted):
    _, model = release
    assert converted.verified and converted.dst.exists()
    loaded = load_checkpoint(converted.dst, dtype=jnp.float32)
    assert loaded.config.expert_weights == "mxfp4" and loaded.config.use_indexer
    ours, ref = params(loaded), params(model)
    assert ours.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)
    np.testing.assert_array_equal(np.asarray(logits_of(loaded, TOKENS)), np.asarray(logits_of(model, TOKENS)))


def test_stored_layout(converted):
    info = checkpoint_info(converted.dst)
    stored = info["stored"]
    assert set(stored) == {"embed", "lm_head", "final_norm", "out_res_norm", "out_res_proj", "layers", "vision"}
    assert sorted(stored["layers"]) == [f"layer_{i:03d}" for i in range(13)]
    moe = stored["layers"]["layer_001"]["moe"]
    assert moe["w_gate"]["packed"].shape == (16, 32, 16) and moe["w_gate"]["packed"].dtype == np.uint8
    assert moe["w_down"]["scale"].shape == (16, 32, 1)
    assert stored["layers"]["layer_000"]["norms"]["input_norm"].dtype == jnp.bfloat16  # kept as stored
    assert stored["layers"]["layer_000"]["kda"]["a_log"].dtype == np.float32
    assert info["options"]["expert_weights"] == "mxfp4"


def test_export_reproduces_every_tensor_bytewise(release, converted, tmp_path):
    src, _ = release
    out = tmp_path / "exported"
    result = export(converted.dst, out)
    assert result.recorded_layout
    a, b = tensors_of(src), tensors_of(out)
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert a[n].tobytes() == b[n].tobytes(), n
    for f in src.iterdir():  # same writer: even the files are identical
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_vision_preserved(release, converted):
    src, _ = release
    vision = load_vision(converted.dst)
    t = tensors_of(src)
    names = sorted(n for n in t if n.startswith(("vision_tower.", "mm_projector.")))
    assert sorted(vision) == names and len(names) == 2 + 2 * 6 + 1 + 3
    for n in names:
        assert vision[n].tobytes() == t[n].tobytes()


def test_dry_run_reports_and_writes_nothing(release, tmp_path):
    src, _ = release
    buf = io.StringIO()
    result = convert(src, tmp_path / "never", dry_run=True, out=buf)
    text = buf.getvalue()
    n = len(tensors_of(src))
    assert f"accounted {n:,} of {n:,} tensors used exactly once, 0 dropped on request, 0 unused" in text
    assert "moe/w_gate/packed" in text and "[12, 16, 32, 16]" in text and "vision/ (verbatim)" in text
    assert not (tmp_path / "never").exists() and result.dst is None


def test_expert_weights_bf16_and_dtype(release, tmp_path):
    src, model = release
    r = convert(src, tmp_path / "bf16", expert_weights="bf16", dtype="float32")
    stored = checkpoint_info(r.dst)["stored"]
    w = stored["layers"]["layer_004"]["moe"]["w_up"]
    assert w.shape == (16, 32, 32) and w.dtype == jnp.bfloat16  # decoded while streaming, exact in bf16
    assert stored["lm_head"].dtype == np.float32  # --dtype for the non-expert weights
    loaded = load_checkpoint(r.dst, dtype=jnp.float32)
    assert loaded.config.expert_weights == "bf16"
    ours, ref = params(loaded), params(dequantize_experts(model))
    for k in ref:
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)
    # The floor rule re-derives exactly the released bytes from the decoded values.
    out = export(r.dst, tmp_path / "bf16-exported")
    a, b = tensors_of(src), tensors_of(out.out)
    assert all(a[n].tobytes() == b[n].tobytes() for n in a)


def test_progress_bar_shows_rate_and_eta(release, tmp_path, capsys):
    src, _ = release
    convert(src, tmp_path / "p", progress=True)
    err = capsys.readouterr().err
    assert "convert [" in err and "B/s" in err and "ETA" in err and "100.0%" in err


def test_sharded_restore_in_bounded_calls(converted):
    mesh = jax.make_mesh((4, 2), ("expert", "tensor"))
    ref = load_checkpoint(converted.dst, dtype=jnp.float32)
    state = nnx.to_pure_dict(nnx.state(ref, nnx.Param))
    rep = jax.sharding.NamedSharding(mesh, jax.P())

    def pick(kp, leaf):
        path = jax.tree_util.keystr(kp)
        if "w_gate" in path or "w_up" in path or "w_down" in path:
            return jax.sharding.NamedSharding(mesh, jax.P(None, "expert"))
        return rep

    shardings = jax.tree_util.tree_map_with_path(pick, state)
    model = load_checkpoint(converted.dst, dtype=jnp.float32, shardings=shardings, max_bytes_per_call=500_000)
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    packed = got["moe"]["w_gate"]["packed"]
    assert tuple(packed.sharding.spec)[:2] == (None, "expert")
    assert packed.addressable_shards[0].data.shape == (12, 4, 32, 16)
    for (k, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(k))


def test_verify_catches_a_changed_byte(release, tmp_path):
    src, _ = release
    copy = shutil.copytree(src, tmp_path / "src")
    r = convert(copy, tmp_path / "ck")
    name = "language_model.model.layers.5.block_sparse_moe.experts.3.w3.weight_packed"
    info = SafetensorsIndex(copy).tensors[name]
    with open(info.file, "r+b") as f:
        f.seek(info.start + 7)
        b = f.read(1)
        f.seek(info.start + 7)
        f.write(bytes([b[0] ^ 0x10]))
    with TensorReader() as reader, pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        compare_with_source(r.dst, r.plan, reader, None, 1 << 30)


def test_kimi_linear_layout_through_the_converter(tmp_path):
    """Public Kimi Linear layout: softplus gate, low-rank output gate, bf16 `experts.*.w1/w2/w3`,
    dense layer 0 under `mlp.`; the converted checkpoint holds exactly what the in-memory
    loader (golden-checked against transformers) builds."""
    r = convert(GOLDEN_KL, tmp_path / "kl", verify=True)
    assert r.plan.cfg.expert_weights == "bf16" and r.plan.cfg.kda_gate_lower_bound is None
    loaded = load_checkpoint(r.dst, dtype=jnp.float32)
    ours, ref = params(loaded), params(load_hf_weights(GOLDEN_KL, dtype="float32"))
    for k in ref:
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)
    out = export(r.dst, tmp_path / "kl-out")
    assert (out.out / "model.safetensors").read_bytes() == (GOLDEN_KL / "model.safetensors").read_bytes()


@pytest.mark.skipif(not GOLDEN_K3.exists(), reason="shared K3 golden not present")
def test_k3_golden_through_the_converter(tmp_path):
    r = convert(GOLDEN_K3, tmp_path / "k3")
    loaded = load_checkpoint(r.dst, dtype=jnp.float32)
    ours, ref = params(loaded), params(load_hf_weights(GOLDEN_K3, dtype="float32"))
    for k in ref:
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)


def test_load_checkpoint_rejects_non_checkpoints(tmp_path, converted):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a finalized Orbax checkpoint"):
        load_checkpoint(tmp_path / "empty")
    import orbax.checkpoint.experimental.v1 as ocp1

    ocp1.save(str(tmp_path / "plain"), {"w": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match="not a k31jax checkpoint"):
        load_checkpoint(tmp_path / "plain")


def test_cli_convert_dry_run_and_export(release, converted, tmp_path, capsys):
    from k31jax.cli import main

    src, _ = release
    assert main(["convert", str(src), "--dry-run"]) == 0
    assert "tensors used exactly once" in capsys.readouterr().out
    assert main(["export", str(converted.dst), str(tmp_path / "out"), "--no-progress"]) == 0
    assert (tmp_path / "out" / "model.safetensors.index.json").read_bytes() == \
        (src / "model.safetensors.index.json").read_bytes()
    assert main(["export", str(converted.dst), str(tmp_path / "out"), "--no-progress"]) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err
