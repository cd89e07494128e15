"""The K3.1 guard and the spellings the converter accepts: indexer tensors converted into the
indexer parameters (nested or bare names, exactly on the MLA layers), `--no-indexer` (load
as dense gated MLA, dropping indexer tensors), `init_missing_indexer`, and dense layer 0
under `block_sparse_moe.`."""

import io
import re

import jax.numpy as jnp
import numpy as np
import pytest

from helpers.model import tiny_config
from helpers.release import copy_release, edit_config, rewrite, tensors_of
from k31jax import convert
from k31jax.ckpt._synthetic import write_synthetic_release
from k31jax.ckpt import CheckpointError, checkpoint_config, checkpoint_info, load_checkpoint
from k31jax.ckpt._orbax import load_stored

L = "language_model.model.layers."


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cfg = tiny_config(expert_weights="mxfp4", dtype="bfloat16")
    return write_synthetic_release(tmp_path_factory.mktemp("base") / "release", cfg, seed=2, num_shards=2)


@pytest.fixture
def src(base, tmp_path):
    return copy_release(base, tmp_path / "src")


def indexer_names(folder):
    return sorted(n for n in tensors_of(folder) if ".indexer." in n)


def test_indexer_tensors_become_indexer_parameters(base, tmp_path):
    r = convert(base, tmp_path / "ck")
    assert r.plan.cfg.use_indexer and r.plan.cfg.mla_layers == (3, 7, 11, 12)
    model = load_checkpoint(r.dst, dtype=jnp.float32)
    t = tensors_of(base)
    got = np.asarray(model.mla.indexer.wq_b[...])
    for slot, layer in enumerate((3, 7, 11, 12)):
        want = t[f"{L}{layer}.self_attn.indexer.wq_b.weight"].astype(np.float32).T
        np.testing.assert_array_equal(got[slot], want)
    np.testing.assert_array_equal(np.asarray(model.mla.indexer.k_norm_bias[...])[2],
                                  t[L + "11.self_attn.indexer.k_norm.bias"].astype(np.float32))


def test_no_indexer_drops_the_tensors_and_loads_dense_mla(base, tmp_path):
    r = convert(base, tmp_path / "ck", no_indexer=True)
    assert not r.plan.cfg.use_indexer and r.plan.dropped == indexer_names(base)
    info = checkpoint_info(r.dst)
    assert info["overrides"]["index_topk"] is None and not checkpoint_config(info).use_indexer
    assert "indexer" not in info["stored"]["layers"]["layer_003"]["mla"]


def test_no_indexer_when_the_weights_lack_it(src):
    rewrite(src, drop=set(indexer_names(src)))
    buf = io.StringIO()
    r = convert(src, dry_run=True, no_indexer=True, out=buf)
    assert not r.plan.cfg.use_indexer and "MLA)" in buf.getvalue()


def test_init_missing_indexer(src, tmp_path):
    rewrite(src, drop=set(indexer_names(src)))
    r = convert(src, tmp_path / "ck", init_missing_indexer=True)
    assert r.plan.options["init_missing_indexer"]
    assert sum(e.mode == "init" for e in r.plan.entries) == 4 * 5
    model = load_checkpoint(r.dst, dtype=jnp.float32)
    idx = model.mla.indexer
    np.testing.assert_array_equal(np.asarray(idx.k_norm_weight[...]), 1)
    np.testing.assert_array_equal(np.asarray(idx.k_norm_bias[...]), 0)
    wq = np.asarray(idx.wq_b[...])
    assert 0.01 < wq.std() < 0.03 and not np.array_equal(wq[0], wq[1])


def test_bare_indexer_names_are_accepted(src):
    names = indexer_names(src)
    rewrite(src, rename={n: n.replace(".indexer.", ".") for n in names})
    r = convert(src, dry_run=True, out=io.StringIO())
    assert sum(e.source.path[:2] == ("mla", "indexer") for e in r.plan.entries) == len(names)


def test_indexer_on_a_non_mla_layer(src):
    n = L + "0.self_attn.indexer.wk.weight"
    rewrite(src, add={n: ("BF16", tensors_of(src)[L + "3.self_attn.indexer.wk.weight"])})
    with pytest.raises(CheckpointError, match=re.escape("indexer tensors sit on non-MLA layers [0]")):
        convert(src, dry_run=True, out=io.StringIO())


def test_unknown_indexer_tensor_name(src):
    n = L + "3.self_attn.indexer.rope_freqs"
    rewrite(src, add={n: ("F32", np.zeros(8, np.float32))})
    with pytest.raises(CheckpointError, match=re.escape(f"tensor '{n}' (an indexer tensor with an unexpected name")):
        convert(src, dry_run=True, out=io.StringIO())


def test_unknown_indexer_config_key(src):
    edit_config(src, lambda t: t.update(index_rope_dim=64))
    with pytest.raises(ValueError, match="unknown indexer keys"):
        convert(src, dry_run=True, out=io.StringIO())


def test_dense_layer_zero_under_block_sparse_moe(src):
    rename = {n: n.replace(".mlp.", ".block_sparse_moe.") for n in tensors_of(src) if ".layers.0.mlp." in n}
    assert len(rename) == 3
    rewrite(src, rename=rename)
    r = convert(src, dry_run=True, out=io.StringIO())
    dense = [e for e in r.plan.entries if e.source.path[0] == "dense"]
    assert sorted(e.tensors[0].name for e in dense) == sorted(rename.values())


def test_kimi_linear_config_without_attn_res(tmp_path):
    """A Kimi Linear style model written by the fixture generator (`model.` prefix, bf16
    experts, A_log as [1, 1, H, 1]) converts with bf16 experts."""
    from helpers.model import kimi_linear_tiny_config

    cfg = kimi_linear_tiny_config(dtype="bfloat16")
    src = write_synthetic_release(tmp_path / "kl", cfg, seed=4, num_shards=2)
    t = tensors_of(src)
    assert "model.layers.0.self_attn.A_log" in t and t["model.layers.0.self_attn.A_log"].shape == (1, 1, 4, 1)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in t and "lm_head.weight" in t
    r = convert(src, tmp_path / "ck")
    assert r.plan.cfg.expert_weights == "bf16" and not r.plan.cfg.use_attn_res
    a_log = load_stored(r.dst, [("layers", "layer_000", "kda", "a_log")])
    np.testing.assert_array_equal(a_log[("layers", "layer_000", "kda", "a_log")],
                                  t["model.layers.0.self_attn.A_log"].reshape(-1))
