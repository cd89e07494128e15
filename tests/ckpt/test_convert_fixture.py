"""The release-layout fixture generator, and `--dry-run` on a full-size K3 release layout:
96 sparse shards with the real headers (497,220 tensors, 1.56 TB apparent, a few MB on
disk), generated here from the name table and the spec's inventory."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from helpers.model import kimi_linear_tiny_config, tiny_config
from helpers.paths import SHARED_DATA_DIR
from k31jax.ckpt._release_layout import hf_config_dict, release_layout
from k31jax.ckpt._synthetic import write_synthetic_release
from k31jax import ModelConfig
from k31jax.ckpt import read_header

K3_CONFIG = SHARED_DATA_DIR / "kimi_k3_config.json"
INVENTORY = SHARED_DATA_DIR / "kimi_k3_tensor_inventory.json"


@pytest.mark.parametrize("make", [lambda: ModelConfig.preset("k3"), lambda: ModelConfig.preset("k31_pro"),
                                  lambda: ModelConfig.preset("kimi_linear_48b"), lambda: tiny_config(),
                                  lambda: kimi_linear_tiny_config()], ids=["k3", "k31_pro", "kl48b", "tiny", "kl_tiny"])
def test_config_json_round_trip(make):
    cfg = make()
    assert ModelConfig.from_hf(hf_config_dict(cfg)) == cfg


def test_layout_names_and_placement():
    cfg = tiny_config(expert_weights="mxfp4")
    shards = release_layout(cfg, num_shards=4)
    assert [s for s, _ in shards] == [f"model-{i:05d}-of-000004.safetensors" for i in range(1, 5)]
    names = [n for _, ts in shards for n, _, _ in ts]
    assert names[0].startswith("language_model.model.layers.0.") and "language_model.lm_head.weight" in names
    for _, ts in shards:  # each expert's six tensors sit together in one shard, w1, w2, w3
        ex = [n for n, _, _ in ts if ".experts.7." in n and ".layers.5." in n]
        assert ex in ([], [f"language_model.model.layers.5.block_sparse_moe.experts.7.{w}.{p}"
                           for w in ("w1", "w2", "w3") for p in ("weight_packed", "weight_scale")])
    release = release_layout(cfg, placement="release")
    assert len(release) == cfg.num_hidden_layers + 1


@pytest.mark.skipif(not K3_CONFIG.exists(), reason="shared K3 config not present")
def test_dry_run_on_full_size_k3_release_layout(tmp_path):
    raw = json.loads(K3_CONFIG.read_text())
    cfg = ModelConfig.from_hf(raw)
    src = write_synthetic_release(tmp_path / "kimi-k3", cfg, vision_config=raw["vision_config"], sparse=True,
                        placement="release", config_json=raw)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards = sorted(src.glob("*.safetensors"))
    assert len(shards) == 96 and shards[0].name == "model-00001-of-000096.safetensors"
    assert len(index["weight_map"]) == 497_220
    assert index["metadata"]["total_size"] == 1_560_860_324_864  # checkpoint_format.md §1, exactly
    assert sum(f.stat().st_size for f in shards) > 1.56e12 > 200 * sum(f.stat().st_blocks * 512 for f in shards)
    wm = index["weight_map"]
    assert wm["language_model.model.layers.0.mlp.down_proj.weight"] == "model-00001-of-000096.safetensors"
    assert wm["language_model.lm_head.weight"] == "model-00094-of-000096.safetensors"
    assert wm["mm_projector.proj.0.weight"] == "model-00095-of-000096.safetensors"
    assert wm["vision_tower.encoder.blocks.26.wo.weight"] == "model-00096-of-000096.safetensors"
    if INVENTORY.exists():  # every tensor pattern of the spec's inventory, with its shape and dtype
        headers: dict = {}
        for t in json.loads(INVENTORY.read_text())["tensors"]:
            kind = t["layers"]
            layer = "2" if kind.startswith("KDA") else "0" if kind.startswith("layer 0") else \
                "1" if kind.startswith("1-92") else "3"
            name = t["name"].replace("{i}", layer).replace("{e}", "895").replace("{j}", "26")
            shard = wm[name]
            if shard not in headers:
                headers[shard] = read_header(src / shard)[0]
            info = headers[shard][name]
            assert list(info.shape) == t["shape"] and info.dtype == t["dtype"], name
    # The dry run itself, in a fresh process: time and peak memory as a user would see them.
    code = textwrap.dedent(f"""
        import io, json, sys, time
        t = time.perf_counter()
        from k31jax import convert
        buf = io.StringIO()
        convert({str(src)!r}, dry_run=True, out=buf)
        # VmHWM, not ru_maxrss: Linux carries the parent's peak RSS into ru_maxrss across exec,
        # so a child of a large pytest worker would report the worker's peak.
        peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
        print(json.dumps(dict(seconds=time.perf_counter() - t,
                              rss=peak,
                              report=buf.getvalue())))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    wall = time.perf_counter() - t0
    report = result["report"]
    assert "accounted 497,220 of 497,220 tensors used exactly once, 0 dropped on request, 0 unused" in report
    assert "moe/w_gate/packed            [92, 896, 3072, 1792]  uint8" in report
    assert "vision/ (verbatim)  168 tensors" in report
    assert wall < 60, f"dry run took {wall:.1f} s"
    assert result["rss"] < 2 << 30, f"dry run peak RSS {result['rss'] / 2**30:.2f} GiB"
    print(f"\nfull-size K3 dry run: {result['seconds']:.1f} s in-process ({wall:.1f} s with interpreter start), "
          f"peak RSS {result['rss'] / 2**20:.0f} MiB")
