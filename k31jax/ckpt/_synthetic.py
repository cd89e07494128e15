"""Write a synthetic (random or given) model of any config in the exact K3 release layout.

The layout is the release's (checkpoint_format.md §1-§3): `config.json` with the
multimodal wrapper (`text_config`, plus `quantization_config` when the experts are MXFP4),
numbered shards `model-00001-of-000096.safetensors` (5-digit index, 6-digit total) with
`model.safetensors.index.json`, `language_model.` names (or Kimi Linear `model.` names),
per-expert compressed-tensors MXFP4 (`weight_packed` / `weight_scale`, each expert's
tensors contiguous), `A_log` zero-padded, the f32 tensors as F32 and everything else BF16,
optionally the vision tower and projector.

Values come either from a model's parameters (`params=`: the exact inverse of the
converter's transforms, so converting the fixture gives those parameters back) or from a
per-tensor seeded RNG (any size, streamed to disk tensor by tensor). `sparse=True` writes
the real headers over unwritten (zero-cost) data: a full-size 1.56 TB K3 layout in seconds.

    python convert/make_synthetic_release.py OUT --config tiny --shards 3
    python convert/make_synthetic_release.py OUT --config k3 --vision --sparse --placement release
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from ._plan import make_plan
from ._transforms import get_path, unbuild_value
from ._release_layout import hf_config_dict, release_layout, tensor_nbytes
from ._safetensors import SAFETENSORS_DTYPES, ShardWriter, no_gc
from ..config import ModelConfig

def random_tensor(name: str, dtype: str, shape, seed: int, cfg: ModelConfig) -> np.ndarray:
    """Plausible random values for one release tensor (finite, no NaN scales, zero A_log tail)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    n = int(np.prod(shape, dtype=np.int64))
    if name.endswith(".weight_packed"):
        return np.frombuffer(rng.bytes(n), np.uint8).reshape(shape)
    if name.endswith(".weight_scale"):
        return rng.integers(118, 125, size=shape, dtype=np.uint8)
    if name.endswith("A_log"):
        a = np.zeros(n, np.float32)
        h = cfg.kda_num_heads
        a[:h] = np.log(rng.uniform(1, 16, h)) if cfg.kda_gate_lower_bound is None else rng.uniform(-0.5, 0.5, h)
        return a.reshape(shape)
    if "conv1d" in name:
        std, mean = 0.3, 0.0
    elif name.endswith(("norm.weight", "layernorm.weight", "norm0.weight", "norm1.weight")):
        std, mean = 0.05, 1.0
    elif name.endswith(("res_proj.weight", "dt_bias", "e_score_correction_bias", "k_norm.bias")):
        std, mean = 0.05, 0.0
    else:
        std, mean = 0.02, 0.0
    out = np.empty(n, SAFETENSORS_DTYPES[dtype])
    step = 1 << 24
    for s in range(0, n, step):
        m = min(step, n - s)
        out[s:s + m] = (rng.standard_normal(m, np.float32) * std + mean).astype(out.dtype)
    return out.reshape(shape)


def write_synthetic_release(
    out: str | os.PathLike,
    cfg: ModelConfig,
    *,
    params: dict | None = None,
    seed: int = 0,
    num_shards: int = 3,
    placement: str = "size",
    vision_config: dict | None = None,
    vision_params: dict[str, np.ndarray] | None = None,
    sparse: bool = False,
    config_json: dict | None = None,
) -> Path:
    """Write `cfg` as a release-layout folder at `out` and return it.

    params: `nnx.to_pure_dict(nnx.state(model, nnx.Param))` of a model built with `cfg`
    (values are written through the converter's inverse transforms; F32 release tensors stay
    F32, the rest become BF16, so use bf16-representable values for an exact round trip);
    None: random values from `seed`. sparse: headers only, data left as file holes.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with no_gc():
        layout = release_layout(cfg, vision_config=vision_config, num_shards=num_shards, placement=placement)
    (out / "config.json").write_text(json.dumps(config_json or hf_config_dict(cfg, vision_config=vision_config),
                                                indent=2) + "\n")
    with no_gc():
        writers = {shard: ShardWriter(out / shard, tensors, {"format": "pt"}) for shard, tensors in layout}
    try:
        if len(writers) > 1:
            weight_map = {name: shard for shard, tensors in layout for name, _, _ in tensors}
            total = sum(tensor_nbytes(t) for _, ts in layout for t in ts)
            with no_gc():
                (out / "model.safetensors.index.json").write_text(json.dumps(
                    {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        if sparse:
            return out
        infos = {n: i for w in writers.values() for n, i in w.infos.items()}
        where = {n: writers[s] for s, ts in layout for n, _, _ in ts}
        if params is None:
            for shard, tensors in layout:
                for name, dtype, shape in tensors:
                    where[name].write(name, random_tensor(name, dtype, shape, seed, cfg))
            return out
        plan = make_plan(cfg, infos, root=out, expert_weights=cfg.expert_weights)
        for entry in plan.entries:
            if entry.source.transform == "raw":
                name = entry.tensors[0].name
                value = (vision_params or {}).get(name)
                if value is None:
                    value = random_tensor(name, entry.tensors[0].dtype, entry.shape, seed, cfg)
                where[name].write(name, np.asarray(value).astype(SAFETENSORS_DTYPES[entry.tensors[0].dtype]))
                continue
            value = np.asarray(get_path(params, entry.source.path + ((entry.part,) if entry.part else ())))
            if entry.source.slot is not None:
                value = value[entry.source.slot]
            for info, arr in unbuild_value(entry, value, cfg):
                where[info.name].write(info.name, arr)
        return out
    finally:
        for w in writers.values():
            w.close()


def synthetic_config(layers: int = 24, experts: int = 128) -> ModelConfig:
    """A K3-shaped model scaled down (hidden 1024, latent 512, MXFP4 experts dominating the
    bytes like the release: ~0.84 MB per expert, ~25 MB of bf16 per layer besides): with the
    defaults ~133 MB per layer, ~3.2 GB in all. For memory and throughput measurements."""
    types = tuple("mla" if (i + 1) % 4 == 0 or i == layers - 1 else "kda" for i in range(layers))
    return ModelConfig.preset("tiny").replace(
        vocab_size=8192, hidden_size=1024, num_hidden_layers=layers, layer_types=types, intermediate_size=2048,
        moe_intermediate_size=1024, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, kda_num_heads=8, kda_head_dim=128, kda_a_log_len=128,
        num_experts=experts, num_experts_per_token=8, num_shared_experts=2, routed_expert_hidden_size=512,
        index_topk=None, index_n_heads=0, index_head_dim=0, attn_res_block_size=4, dtype="bfloat16",
        expert_weights="mxfp4")


def bf16_exact(params: dict) -> dict:
    """`params` with every float leaf rounded to bfloat16 values (kept in its dtype), so a
    release written from them (BF16 weights) converts back to exactly the same numbers."""
    def r(x):
        x = np.asarray(x)
        if x.dtype.kind == "f":
            return x.astype(ml_dtypes.bfloat16).astype(x.dtype)
        return x
    return jax.tree.map(r, params)
