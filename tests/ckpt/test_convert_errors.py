"""Bad input, one test per case: each fails with an error naming the file, the tensor and
what was expected vs found, and leaves no checkpoint (and no temporary folder) at DST."""

import json
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from helpers.model import tiny_config
from helpers.release import copy_release, edit_config, edit_header, leftovers, rewrite, shard_of, tensors_of
from k31jax import convert
from k31jax.ckpt._synthetic import write_synthetic_release
from k31jax.ckpt import CheckpointError, SafetensorsError, checkpoint_info
from k31jax.ckpt._orbax import load_stored
from k31jax.cli import main as cli_main
from k31jax.config import ConfigError

L = "language_model.model.layers."
Q = L + "2.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cfg = tiny_config(expert_weights="mxfp4", dtype="bfloat16")
    return write_synthetic_release(tmp_path_factory.mktemp("base") / "release", cfg, seed=1, num_shards=3)


@pytest.fixture
def src(base, tmp_path):
    return copy_release(base, tmp_path / "src")


def fails(src: Path, *patterns, exc=(CheckpointError, SafetensorsError, ConfigError), **kw):
    """Convert `src` into a fresh DST, expect an error matching every pattern, and check that
    DST holds nothing and no temporary folder is left."""
    dst = src.parent / "dst"
    with pytest.raises(exc) as info:
        convert(src, dst, **kw)
    msg = str(info.value)
    for p in patterns:
        assert re.search(p, msg), f"{p!r} not in:\n{msg}"
    assert not dst.exists() and leftovers(dst.parent, "dst") == []
    return msg


def test_missing_shard(src):
    gone = src / "model-00002-of-000003.safetensors"
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != gone.name}
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    gone.unlink()
    fails(src, r"model\.safetensors\.index\.json: missing shard model-00002-of-000003\.safetensors \(absent",
          r"only to shards \[1, 3\] of 3")


def test_shard_listed_in_index_but_absent(src):
    (src / "model-00003-of-000003.safetensors").unlink()
    fails(src, r"shard 'model-00003-of-000003\.safetensors' is listed \(for \d+ tensors, e\.g\. '[^']+'\)",
          r"does not exist")


def test_truncated_file(src):
    f = src / "model-00002-of-000003.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    fails(src, r"model-00002-of-000003\.safetensors: truncated file: the header describes (\d+) data bytes but "
               r"the file holds \d+ \(100 missing; tensor '[^']+' and later are cut short\)")


def test_corrupt_json_header(src):
    f = src / "model-00001-of-000003.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8 + 30:8 + 34] = b'"{:,'  # no longer JSON
    f.write_bytes(bytes(raw))
    fails(src, r"model-00001-of-000003\.safetensors: corrupt JSON header")


def test_header_offsets_outside_the_file(src):
    f = shard_of(src, Q)

    def push(h):
        h[Q]["data_offsets"] = [h[Q]["data_offsets"][0] + 10**9, h[Q]["data_offsets"][1] + 10**9]
    edit_header(f, push)
    fails(src, rf"{f.name}: tensor '{re.escape(Q)}' data_offsets \[\d+, \d+\] lie outside the file's \d+-byte "
               "data section")


def test_wrong_shape(src):
    w = tensors_of(src)[Q]
    rewrite(src, replace={Q: ("BF16", np.ascontiguousarray(w.T[:, :32]))})
    fails(src, rf"{shard_of(src, Q).name}: tensor '{re.escape(Q)}': expected shape \[64, 64\] dtype BF16\|F32\|F16, "
               r"got shape \[64, 32\] dtype BF16 \(for parameter kda/q_proj\[2\]")


def test_wrong_dtype_f32_tensor_as_bf16(src):
    name = L + "1.self_attn.A_log"
    a = tensors_of(src)[name]
    rewrite(src, replace={name: ("BF16", a.astype(ml_dtypes.bfloat16))})
    fails(src, rf"tensor '{re.escape(name)}': expected shape \[16\] or \[4\] or \[1, 1, 4, 1\] dtype F32, "
               r"got shape \[16\] dtype BF16 \(for parameter kda/a_log\[1\]")


def test_quantised_tensor_where_bf16_expected(src):
    rewrite(src, replace={Q: ("U8", np.zeros((64, 64), np.uint8))})
    fails(src, rf"tensor '{re.escape(Q)}': expected .* dtype BF16\|F32\|F16, got shape \[64, 64\] dtype U8 "
               r"\(a quantised tensor where a float one is expected\)")


def test_float_expert_where_mxfp4_expected(src):
    e = L + "3.block_sparse_moe.experts.7.w2."
    rewrite(src, drop={e + "weight_packed", e + "weight_scale"}, add={e + "weight": ("BF16", np.zeros((32, 32),
                                                                                                ml_dtypes.bfloat16))})
    fails(src, rf"tensor '{re.escape(e)}weight': a float expert where MXFP4 weight_packed/weight_scale are "
               r"expected .* --expert-weights bf16", expert_weights="mxfp4")


def test_unknown_tensor_name(src):
    extra = L + "0.self_attn.q_rope.weight"
    rewrite(src, add={extra: ("BF16", np.zeros((4, 4), ml_dtypes.bfloat16))})
    fails(src, r"unknown or unused tensors \(1\)", rf"model-00001-of-000003\.safetensors: tensor '{re.escape(extra)}'")


def test_missing_tensor(src):
    name = L + "7.self_attn.kv_b_proj.weight"
    rewrite(src, drop={name})
    fails(src, r"missing tensors \(1\)", rf"'{re.escape(name)}' \(for parameter mla/kv_b_proj\[1\]\)")


def test_config_layer_count_disagrees(src):
    edit_config(src, lambda t: t.update(num_hidden_layers=12, linear_attn_config=dict(
        t["linear_attn_config"], full_attn_layers=[4, 8, 12])))
    fails(src, r"config\.json num_hidden_layers=12, but the weights have layers up to 12 \(e\.g\. "
               r"model-\d+-of-000003\.safetensors: tensor 'language_model\.model\.layers\.12\.[^']+'\)")


def test_config_has_more_layers_than_the_weights(src):
    edit_config(src, lambda t: t.update(num_hidden_layers=14, linear_attn_config=dict(
        t["linear_attn_config"], kda_layers=t["linear_attn_config"]["kda_layers"] + [14])))
    fails(src, r"num_hidden_layers=14, but the weights have no tensors for layers \[13\]")


def test_mtp_layer_is_rejected(src):
    extra = L + "13.input_layernorm.weight"
    rewrite(src, add={extra: ("BF16", np.ones(64, ml_dtypes.bfloat16))})
    fails(src, r"layers up to 13 .* \(MTP / extra layers are not supported\)")


def test_config_expert_count_disagrees(src):
    edit_config(src, lambda t: t.update(num_experts=8))
    fails(src, r"config\.json num_experts=8, but the weights have experts up to 15 \(e\.g\. model-\d+-of-000003"
               r"\.safetensors: tensor 'language_model\.model\.layers\.\d+\.block_sparse_moe\.experts\.15\.")


def test_config_has_more_experts_than_the_weights(src):
    edit_config(src, lambda t: t.update(num_experts=32))
    fails(src, r"num_experts=32, but the weights have only experts 0\.\.15")


def test_config_asks_for_indexer_the_weights_lack(src):
    rewrite(src, drop={n for n in tensors_of(src) if ".indexer." in n})
    fails(src, r"asks for the K3\.1 lightning indexer \(index_topk=8", r"--no-indexer", r"--init-missing-indexer")


def test_weights_hold_indexer_the_config_lacks(src):
    edit_config(src, lambda t: [t.pop(k) for k in ("index_topk", "index_n_heads", "index_head_dim")])
    fails(src, r"the weights hold 20 lightning-indexer tensors \(e\.g\. model-\d+-of-000003\.safetensors: tensor "
               r"'language_model\.model\.layers\.\d+\.self_attn\.indexer\.", r"config\.json has no index_topk",
          r"--no-indexer")


def test_nonzero_a_log_padding(src):
    name = L + "4.self_attn.A_log"
    a = tensors_of(src)[name].copy()
    a[9] = 0.5
    rewrite(src, replace={name: ("F32", a)})
    fails(src, rf"tensor '{re.escape(name)}': entries 4\.\. must be zero padding")


def test_nan_scale_byte_fails_mid_stream_and_leaves_nothing(src):
    name = L + "6.block_sparse_moe.experts.11.w3.weight_scale"
    s = tensors_of(src)[name].copy()
    s[5, 0] = 0xFF
    rewrite(src, replace={name: ("U8", s)})
    fails(src, rf"{shard_of(src, name).name}: tensor '{re.escape(name)}' holds the E8M0 NaN scale byte 0xFF "
               r"\(first at \(5, 0\); expected bytes 0x00\.\.0xFE\)")


def test_dst_exists_without_overwrite(src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"dst: already exists; pass --overwrite"):
        convert(src, dst)
    assert (dst / "keep.txt").read_text() == "mine" and leftovers(tmp_path, "dst") == []


def test_failed_overwrite_keeps_the_previous_checkpoint(src, tmp_path):
    dst = tmp_path / "dst"
    convert(src, dst)
    before = load_stored(dst, [("embed",)])[("embed",)]
    name = L + "9.block_sparse_moe.experts.0.w1.weight_scale"
    s = tensors_of(src)[name].copy()
    s[0, 0] = 0xFF
    rewrite(src, replace={name: ("U8", s)})
    with pytest.raises(CheckpointError, match="0xFF"):
        convert(src, dst, overwrite=True)
    checkpoint_info(dst)  # still the complete previous conversion, never a partial one
    assert np.array_equal(load_stored(dst, [("embed",)])[("embed",)], before)
    assert leftovers(tmp_path, "dst") == []


def test_cli_reports_errors_without_traceback(src, capsys):
    (src / "model-00003-of-000003.safetensors").unlink()
    assert cli_main(["convert", str(src), str(src.parent / "dst"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("k31jax convert: error: ") and "Traceback" not in err
    assert "model-00003-of-000003.safetensors" in err
