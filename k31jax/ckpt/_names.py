"""The one name table: release / HF tensor names <-> k31jax parameter paths.

`param_sources(cfg, names)` lists, for every parameter leaf of `K31ForCausalLM(cfg)`, the
checkpoint tensors it is built from and how (spec checkpoint_format.md §2-§6). The same
table drives the weight loader here and the converter; nothing else knows HF names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ..config import ModelConfig

Transform = Literal["linear", "copy", "vector", "row", "conv", "a_log", "experts", "raw"]

# Parts of the release that are not the text model: kept verbatim under their own subtree.
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# Parameters the model keeps in float32 whatever its dtype; the release stores them as F32.
F32_PARAMS = frozenset({("kda", "q_conv"), ("kda", "k_conv"), ("kda", "v_conv"), ("kda", "a_log"),
                        ("kda", "dt_bias"), ("kda", "o_norm"), ("moe", "gate_bias")})
# K3.1 lightning-indexer tensors, nested (`self_attn.indexer.wq_b.weight`) or bare under self_attn.
INDEXER_RE = re.compile(r"\.layers\.(\d+)\.self_attn\.(?:indexer\.|(?:wq_b|wk|weights_proj|k_norm)\.)")
_INDEXER_LEAVES = (("wq_b", "wq_b.weight", "linear"), ("wk", "wk.weight", "linear"),
                   ("k_norm_weight", "k_norm.weight", "copy"), ("k_norm_bias", "k_norm.bias", "copy"),
                   ("weights_proj", "weights_proj.weight", "linear"))


@dataclass(frozen=True)
class Source:
    """Where one k31jax parameter (or one layer's slice of a stacked one) comes from.

    path:   key path into `nnx.to_pure_dict(nnx.state(model, nnx.Param))`.
    slot:   index along the stacked "layers" axis, or None for unstacked leaves.
    names:  checkpoint tensor names (several for stacked routed experts, in expert order;
            alternatives for `linear`/`copy` are tried in order and exactly one must exist).
    transform: linear = [out, in] -> [in, out]; copy = as stored; vector = flatten a 1-D
            vector; row = [1, D] -> [D]; conv = [C, 1, K] -> [K, C]; a_log = flatten, keep the
            zero-padded length; experts = stack `[E, out, in]` (`names` are per-expert
            prefixes: bf16 `.weight`, or MXFP4 `weight_packed/_scale` copied verbatim into
            `packed`/`scale` leaves); raw = kept verbatim (vision tower and projector).
    layer:  the absolute layer index of a stacked slot (None for unstacked leaves).
    """

    path: tuple[str, ...]
    slot: int | None
    names: tuple[str, ...]
    transform: Transform
    layer: int | None = None


def detect_prefix(names) -> tuple[str, str]:
    """(model prefix, lm_head name): K3 nests the text model under `language_model.`."""
    names = set(names)
    if "language_model.lm_head.weight" in names or any(n.startswith("language_model.model.") for n in names):
        return "language_model.model.", "language_model.lm_head.weight"
    return "model.", "lm_head.weight"


def stack_layers(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """For each stacked kind, the absolute layer index of every slot of its leading axis."""
    return {"norms": tuple(range(cfg.num_hidden_layers)), "kda": cfg.kda_layers, "mla": cfg.mla_layers,
            "dense": cfg.dense_layers, "moe": cfg.moe_layers}


def vision_sources(names) -> list[Source]:
    """The vision tower and projector, kept verbatim under `vision/<dotted name as a path>`."""
    return [Source(("vision",) + tuple(n.split(".")), None, (n,), "raw")
            for n in sorted(names) if n.startswith(VISION_PREFIXES)]




def param_sources(cfg: ModelConfig, names) -> list[Source]:
    """Every parameter's sources for `cfg`, given the checkpoint's tensor names.

    `names` decides the prefix and the spellings that vary between releases (dense layer 0
    under `mlp.` or `block_sparse_moe.`).
    """
    names = set(names)
    pre, head = detect_prefix(names)
    out: list[Source] = [
        Source(("embed",), None, (pre + "embed_tokens.weight",), "copy"),
        Source(("lm_head",), None, (head,), "linear"),
        Source(("final_norm",), None, (pre + "norm.weight",), "copy"),
    ]
    if cfg.use_attn_res:
        out += [Source(("out_res_norm",), None, (pre + "output_attn_res_norm.weight",), "copy"),
                Source(("out_res_proj",), None, (pre + "output_attn_res_proj.weight",), "row")]
    kda_slot = mla_slot = dense_slot = moe_slot = 0
    for i, kind in enumerate(cfg.layer_types):
        lp = f"{pre}layers.{i}."
        norms = [("input_norm", "input_layernorm.weight", "copy"),
                 ("post_norm", "post_attention_layernorm.weight", "copy")]
        if cfg.use_attn_res:
            norms += [("attn_res_norm", "self_attention_res_norm.weight", "copy"),
                      ("attn_res_proj", "self_attention_res_proj.weight", "row"),
                      ("mlp_res_norm", "mlp_res_norm.weight", "copy"),
                      ("mlp_res_proj", "mlp_res_proj.weight", "row")]
        out += [Source(("norms", leaf), i, (lp + n,), t, i) for leaf, n, t in norms]
        a = lp + "self_attn."
        if kind == "kda":
            table = [("q_proj", "q_proj.weight", "linear"), ("k_proj", "k_proj.weight", "linear"),
                     ("v_proj", "v_proj.weight", "linear"), ("q_conv", "q_conv1d.weight", "conv"),
                     ("k_conv", "k_conv1d.weight", "conv"), ("v_conv", "v_conv1d.weight", "conv"),
                     ("f_a_proj", "f_a_proj.weight", "linear"), ("f_b_proj", "f_b_proj.weight", "linear"),
                     ("b_proj", "b_proj.weight", "linear"), ("a_log", "A_log", "a_log"),
                     ("dt_bias", "dt_bias", "vector"), ("o_norm", "o_norm.weight", "copy"),
                     ("o_proj", "o_proj.weight", "linear")]
            if cfg.kda_full_rank_gate:
                table.append(("g_proj", "g_proj.weight", "linear"))
            else:
                table += [("g_a_proj", "g_a_proj.weight", "linear"), ("g_b_proj", "g_b_proj.weight", "linear")]
            out += [Source(("kda", leaf), kda_slot, (a + n,), t, i) for leaf, n, t in table]
            kda_slot += 1
        else:
            table = [("kv_a_proj", "kv_a_proj_with_mqa.weight", "linear"),
                     ("kv_a_norm", "kv_a_layernorm.weight", "copy"),
                     ("kv_b_proj", "kv_b_proj.weight", "linear"), ("o_proj", "o_proj.weight", "linear")]
            if cfg.q_lora_rank is not None:
                table += [("q_a_proj", "q_a_proj.weight", "linear"), ("q_a_norm", "q_a_layernorm.weight", "copy"),
                          ("q_b_proj", "q_b_proj.weight", "linear")]
            else:
                table.append(("q_proj", "q_proj.weight", "linear"))
            if cfg.mla_use_output_gate:
                table.append(("g_proj", "g_proj.weight", "linear"))
            out += [Source(("mla", leaf), mla_slot, (a + n,), t, i) for leaf, n, t in table]
            if cfg.use_indexer:  # DeepSeek-V3.2 names, nested under `indexer.` or bare
                out += [Source(("mla", "indexer", leaf), mla_slot, (a + "indexer." + n, a + n), t, i)
                        for leaf, n, t in _INDEXER_LEAVES]
            mla_slot += 1
        if cfg.is_moe_layer(i):
            m = lp + "block_sparse_moe."
            table = [("gate", "gate.weight", "linear"), ("gate_bias", "gate.e_score_correction_bias", "copy")]
            if cfg.latent_moe:
                table += [("latent_down", "routed_expert_down_proj.weight", "linear"),
                          ("latent_up", "routed_expert_up_proj.weight", "linear")]
                if cfg.latent_moe_use_norm:
                    table.append(("latent_norm", "routed_expert_norm.weight", "copy"))
            if cfg.num_shared_experts:
                table += [(("shared", p), f"shared_experts.{p}.weight", "linear")
                          for p in ("gate_proj", "up_proj", "down_proj")]
            for leaf, n, t in table:
                path = ("moe",) + (leaf if isinstance(leaf, tuple) else (leaf,))
                out.append(Source(path, moe_slot, (m + n,), t, i))
            for leaf, w in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
                out.append(Source(("moe", leaf), moe_slot,
                                  tuple(f"{m}experts.{e}.{w}" for e in range(cfg.num_experts)), "experts", i))
            moe_slot += 1
        else:
            spellings = [lp + "mlp.", lp + "block_sparse_moe."]
            base = next((s for s in spellings if s + "gate_proj.weight" in names), spellings[0])
            out += [Source(("dense", p), dense_slot, (base + p + ".weight",), "linear", i)
                    for p in ("gate_proj", "up_proj", "down_proj")]
            dense_slot += 1
    return out
