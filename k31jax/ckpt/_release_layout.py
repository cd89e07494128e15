"""The canonical K3 release layout of a config (checkpoint_format.md §1-§3): its
`config.json` (`hf_config_dict`), and its shards with their tensors in the release order
(`release_layout`). `export` writes a checkpoint without a recorded source layout this way;
the synthetic-release writer of `k31jax.ckpt` fills it with values.
"""

from __future__ import annotations

import json
import math

import numpy as np

from ..config import ModelConfig
from ._safetensors import SAFETENSORS_DTYPES
from ._transforms import canonical_tensors

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "global_compression_ratio": None, "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": None,
        "output_activations": None,
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                    "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": None, "observer": "minmax",
                    "observer_kwargs": {}, "actorder": None, "block_structure": None}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


def _style(cfg: ModelConfig) -> str:
    return "k3" if cfg.kda_gate_lower_bound is not None or cfg.use_attn_res else "kimi_linear"


def hf_config_dict(cfg: ModelConfig, *, vision_config: dict | None = None) -> dict:
    """A release `config.json` for `cfg` (`ModelConfig.from_hf` of it gives `cfg` back)."""
    expected_a_log = cfg.kda_head_dim if cfg.kda_gate_lower_bound is not None else cfg.kda_num_heads
    if cfg.kda_layers and cfg.kda_a_log_len != max(expected_a_log, cfg.kda_num_heads):
        raise ValueError(f"kda_a_log_len={cfg.kda_a_log_len} cannot be expressed in a release config.json")
    lac = {"full_attn_layers": [i + 1 for i in cfg.mla_layers], "kda_layers": [i + 1 for i in cfg.kda_layers],
           "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim,
           "short_conv_kernel_size": cfg.kda_conv_size, "use_full_rank_gate": cfg.kda_full_rank_gate}
    if cfg.kda_gate_lower_bound is not None:
        lac["gate_lower_bound"] = cfg.kda_gate_lower_bound
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "hidden_act": cfg.hidden_act, "activation_situ_beta": cfg.activation_situ_beta,
        "activation_situ_linear_beta": cfg.activation_situ_linear_beta,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "mla_use_nope": True, "mla_use_output_gate": cfg.mla_use_output_gate,
        "linear_attn_config": lac,
        "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts,
        "latent_moe_use_norm": cfg.latent_moe_use_norm, "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq, "moe_renormalize": cfg.moe_renormalize,
        "moe_router_activation_func": cfg.moe_router_activation_func,
        "routed_scaling_factor": cfg.routed_scaling_factor, "use_grouped_topk": True,
        "num_expert_group": cfg.num_expert_group, "topk_group": cfg.topk_group, "topk_method": "noaux_tc",
        "attn_res_block_size": cfg.attn_res_block_size, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": False, "max_position_embeddings": cfg.max_position_embeddings,
        "num_nextn_predict_layers": 0, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id, "initializer_range": cfg.initializer_range, "dtype": cfg.dtype,
    }
    if cfg.routed_expert_hidden_size is not None:
        text["routed_expert_hidden_size"] = cfg.routed_expert_hidden_size
    if cfg.use_indexer:
        text.update(index_topk=cfg.index_topk, index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim)
    if cfg.expert_weights == "mxfp4" and cfg.moe_layers:
        text["quantization_config"] = json.loads(json.dumps(QUANTIZATION_CONFIG))
    if vision_config is None and cfg.vision is not None:
        vision_config = cfg.vision.to_hf()
    if _style(cfg) == "kimi_linear" and vision_config is None:
        return text
    out = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
           "vision_config": vision_config, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
           "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": False, "dtype": "bfloat16"}
    if cfg.vision is not None:
        out["media_placeholder_token_id"] = cfg.vision.media_placeholder_token_id
    return out


def vision_tensors(vc: dict, text_hidden: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """MoonViT tower + patch-merger projector tensors for a `vision_config` (vision.md)."""
    d, p, inner = vc["vt_hidden_size"], vc["patch_size"], vc["vt_intermediate_size"]
    qkv = vc.get("qkv_hidden_size", d)
    merge = int(np.prod(vc.get("merge_kernel_size", [2, 2])))
    mm = vc.get("mm_hidden_size", d) * merge
    tower = [("vision_tower.patch_embed.proj.weight", (d, 3, p, p)),
             ("vision_tower.patch_embed.pos_emb.weight", (vc["init_pos_emb_height"], vc["init_pos_emb_width"], d))]
    for j in range(vc["vt_num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{j}."
        tower += [(b + "norm0.weight", (d,)), (b + "wqkv.weight", (3 * qkv, d)), (b + "wo.weight", (d, qkv)),
                  (b + "norm1.weight", (d,)), (b + "mlp.fc0.weight", (inner, d)), (b + "mlp.fc1.weight", (d, inner))]
    tower.append(("vision_tower.encoder.final_layernorm.weight", (d,)))
    proj = [("mm_projector.proj.0.weight", (mm, mm)), ("mm_projector.proj.2.weight", (text_hidden, mm)),
            ("mm_projector.post_norm.weight", (text_hidden,))]
    return [(n, "BF16", s) for n, s in proj + tower]


def tensor_nbytes(t) -> int:
    """Bytes of a `(name, dtype, shape)` release tensor."""
    return math.prod(t[2]) * SAFETENSORS_DTYPES[t[1]].itemsize


def _units(tensors):
    """Tensors grouped so that no unit is split across shards (one expert's tensors stay together)."""
    units, cur, key = [], [], None
    for t in tensors:
        k = t[0].split(".weight")[0].rsplit(".w", 1)[0] if ".experts." in t[0] else None
        if cur and (k is None or k != key):
            units.append(cur)
            cur = []
        cur.append(t)
        key = k
    if cur:
        units.append(cur)
    return units


def release_layout(cfg: ModelConfig, *, vision_config: dict | None = None, num_shards: int = 3,
                   placement: str = "size") -> list[tuple[str, list]]:
    """[(shard file name, [(name, dtype, shape), ...])] in the release order: layers, then the
    embedding / head / final norms, then the projector, then the vision tower.

    placement="release": one shard per layer + one for the globals (+ projector + tower), as
    the 96-shard K3 release; "size": `num_shards` shards of about equal bytes."""
    text = canonical_tensors(cfg, style=_style(cfg))
    layers = [t for t in text if ".layers." in t[0]]
    glob = [t for t in text if ".layers." not in t[0]]
    vis = vision_tensors(vision_config, cfg.hidden_size) if vision_config else []
    proj = [t for t in vis if t[0].startswith("mm_projector.")]
    tower = [t for t in vis if t[0].startswith("vision_tower.")]
    if placement == "release":
        by_layer: dict[int, list] = {}
        for t in layers:
            by_layer.setdefault(int(t[0].split(".layers.")[1].split(".")[0]), []).append(t)
        groups = [by_layer[i] for i in sorted(by_layer)] + [glob] + [g for g in (proj, tower) if g]
    else:
        ordered = layers + glob + proj + tower
        total = sum(map(tensor_nbytes, ordered))
        groups, cur, size = [], [], 0
        for unit in _units(ordered):
            b = sum(map(tensor_nbytes, unit))
            if cur and size + b > total / num_shards * (len(groups) + 1) and len(groups) < num_shards - 1:
                groups.append(cur)
                cur = []
            cur += unit
            size += b
        groups.append(cur)
    n = len(groups)
    if n == 1:
        return [("model.safetensors", groups[0])]
    return [(f"model-{i + 1:05d}-of-{n:06d}.safetensors", g) for i, g in enumerate(groups)]
