"""Reading a release / transformers `config.json` into `ModelConfig` / `VisionConfig` fields.

Accepted layouts: the multimodal release wrapper (`text_config` nested inside, `vision_config`
beside it), a bare `text_config`, or a re-saved transformers Kimi Linear config (flat
`linear_*` keys, `layer_types`, `mlp_layer_types`). Layer lists in the file are 1-indexed;
`layer_types` is 0-indexed (spec architecture.md §1-§2). Every key is read, checked against
the keys that restate it, or named in `IGNORED_HF_KEYS`; any other key is an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._fields import ConfigError, LayerType, check_bool, check_float, check_int, shown

_INDEX_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
_LINEAR_ATTN_KEYS = frozenset(
    {"full_attn_layers", "kda_layers", "head_dim", "num_heads", "short_conv_kernel_size",
     "gate_lower_bound", "use_full_rank_gate", "head_k_dim", "head_v_dim"}
)
# Keys of a release / transformers config.json that carry nothing for this model: transformers'
# generic PretrainedConfig fields (generation defaults, bookkeeping) and training-only knobs.
# Any other key that `model_fields` does not read or check is an error (`allow_unknown=True` skips it).
IGNORED_HF_KEYS = frozenset({
    "_name_or_path", "add_cross_attention", "architectures", "auto_map", "bad_words_ids",
    "begin_suppress_tokens", "chunk_size_feed_forward", "cross_attention_hidden_size",
    "decoder_start_token_id", "diversity_penalty", "do_sample", "early_stopping",
    "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "finetuning_task",
    "forced_bos_token_id", "forced_eos_token_id", "id2label", "is_decoder", "is_encoder_decoder",
    "label2id", "length_penalty", "max_length", "min_length", "model_type", "no_repeat_ngram_size",
    "num_beam_groups", "num_beams", "num_return_sequences", "output_attentions", "output_hidden_states",
    "output_scores", "prefix", "problem_type", "pruned_heads", "remove_invalid_values", "repetition_penalty",
    "return_dict", "return_dict_in_generate", "sep_token_id", "suppress_tokens", "task_specific_params",
    "temperature", "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class", "top_k", "top_p", "torchscript",
    "transformers_version", "typical_p", "use_bfloat16", "use_cache", "attention_dropout",
    "output_router_logits", "pretraining_tp", "model_max_length", "ignore_index", "image_placeholder",
    "media_placeholder_token_id", "vision_config",
})
# Keys the text model reads (or checks for consistency) in `model_fields`.
_READ_HF_KEYS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "hidden_act", "activation_situ_beta",
    "activation_situ_linear_beta", "intermediate_size", "first_k_dense_replace", "moe_layer_freq",
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "qk_head_dim", "head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate",
    "attention_bias", "linear_attn_config", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
    "layer_types", "mlp_layer_types", "index_topk", "index_n_heads", "index_head_dim", "num_experts",
    "num_experts_per_token", "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size",
    "latent_moe_use_norm", "moe_renormalize", "moe_router_activation_func", "routed_scaling_factor",
    "num_expert_group", "topk_group", "use_grouped_topk", "topk_method", "attn_res_block_size",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
    "initializer_range", "dtype", "quantization_config", "num_nextn_predict_layers", "text_config",
})
_LAYER_TYPE_ALIASES = {"kda": "kda", "linear_attention": "kda", "mla": "mla",
                       "full_attention": "mla"}

# vision_config keys with one supported value (vision.md §1): anything else is a different tower.
_VISION_FIXED = {"pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
                 "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm",
                 "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh", "projector_hidden_act": "gelu",
                 "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False}
# vision_config key -> VisionConfig field.
_VISION_FIELDS = {"patch_size": "patch_size", "vt_hidden_size": "hidden_size",
                  "vt_intermediate_size": "intermediate_size", "vt_num_attention_heads": "num_attention_heads",
                  "qkv_hidden_size": "qkv_hidden_size", "vt_num_hidden_layers": "num_hidden_layers",
                  "init_pos_emb_height": "pos_emb_height", "init_pos_emb_width": "pos_emb_width",
                  "init_pos_emb_time": "pos_emb_time", "merge_kernel_size": "merge_kernel_size",
                  "mm_hidden_size": "mm_hidden_size", "text_hidden_size": "text_hidden_size",
                  "projector_ln_eps": "projector_ln_eps", "vt_norm_eps": "norm_eps"}
_VISION_IGNORED = frozenset({"_attn_implementation", "model_type", "transformers_version"})


def read_config_json(source: str | os.PathLike | dict) -> tuple[str, dict]:
    """(where, the config dict) of a `config.json` path, its folder, or a dict already read;
    `where` (the file, or `<dict>`) prefixes every error about it."""
    if isinstance(source, dict):
        return "<dict>", source
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    where = str(path)
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such config file") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object (the config.json fields), got a {type(raw).__name__}")
    return where, raw


@dataclasses.dataclass(frozen=True)
class _Keys:
    """One object of the config (the text config, or its `linear_attn_config`) read key by key:
    values are checked, never converted (13.7, "13" and true are not integers), and an error
    names the key as `prefix + key`."""

    values: dict
    prefix: str = ""

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def require(self, *keys: str) -> None:
        for key in keys:
            if key not in self.values:
                raise ConfigError(f"missing required field {self.prefix + key!r}")

    def integer(self, key: str, default: int | None, *, field: str | None = None,
                null_is_default: bool = False) -> int | None:
        """An integer within the bounds of ModelConfig's `field` (default: the key's name).
        null is allowed where `default` is None, and means `default` where `null_is_default`
        (the release writes null for "absent" there)."""
        value = self.values.get(key, default)
        if value is None and null_is_default:
            value = default
        return check_int(self.prefix + key, value, optional=default is None, bounds_of=field or key)

    def real(self, key: str, default: float | None) -> float | None:
        return check_float(self.prefix + key, self.values.get(key, default), optional=default is None)

    def flag(self, key: str, default: bool) -> bool:
        return check_bool(self.prefix + key, self.values.get(key, default))


def model_fields(raw: dict, *, allow_unknown: bool = False) -> dict[str, Any]:
    """`ModelConfig`'s fields from a config dict; `vision` (when the config has a
    `vision_config`) is a dict of `VisionConfig`'s fields. A key that is neither read, checked,
    nor in `IGNORED_HF_KEYS` is an error naming it, unless `allow_unknown`."""
    if not allow_unknown:
        _check_known_keys(raw)
    text_config = raw.get("text_config", raw)
    if not isinstance(text_config, dict):
        raise ConfigError("text_config: expected an object")
    _check_supported(text_config)
    text = _Keys(text_config)
    text.require("num_hidden_layers", "vocab_size", "hidden_size")
    num_layers = text.integer("num_hidden_layers", 0)
    lac = _linear_attn_config(text_config)
    layer_types = _layer_types(text_config, lac.values, num_layers)
    kda = _kda_fields(text, lac, layer_types)
    first_k_dense, moe_freq = _moe_schedule(text, num_layers, text.integer("num_experts", 0, null_is_default=True))
    act = text_config.get("hidden_act", "silu")
    fields: dict[str, Any] = dict(
        vocab_size=text.integer("vocab_size", 0),
        hidden_size=text.integer("hidden_size", 0),
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        rms_norm_eps=text.real("rms_norm_eps", 1e-5),
        hidden_act=act,
        activation_situ_beta=text.real("activation_situ_beta", 4.0),
        activation_situ_linear_beta=text.real("activation_situ_linear_beta", None),
        intermediate_size=text.integer("intermediate_size", 0),
        first_k_dense_replace=first_k_dense,
        moe_layer_freq=moe_freq,
        num_attention_heads=text.integer("num_attention_heads", 0),
        q_lora_rank=text.integer("q_lora_rank", None),
        kv_lora_rank=text.integer("kv_lora_rank", 0, null_is_default=True),
        qk_nope_head_dim=text.integer("qk_nope_head_dim", 0, null_is_default=True),
        qk_rope_head_dim=text.integer("qk_rope_head_dim", 0, null_is_default=True),
        v_head_dim=text.integer("v_head_dim", 0, null_is_default=True),
        mla_use_output_gate=text.flag("mla_use_output_gate", False),
        **kda,
        index_topk=text.integer("index_topk", None),
        index_n_heads=text.integer("index_n_heads", 0, null_is_default=True),
        index_head_dim=text.integer("index_head_dim", 0, null_is_default=True),
        num_experts=text.integer("num_experts", 0, null_is_default=True),
        num_experts_per_token=text.integer("num_experts_per_token", 0, null_is_default=True),
        num_shared_experts=text.integer("num_shared_experts", 0, null_is_default=True),
        moe_intermediate_size=text.integer("moe_intermediate_size", 0, null_is_default=True),
        routed_expert_hidden_size=text.integer("routed_expert_hidden_size", None),
        latent_moe_use_norm=text.flag("latent_moe_use_norm", True),
        moe_renormalize=text.flag("moe_renormalize", True),
        moe_router_activation_func=text_config.get("moe_router_activation_func", "sigmoid"),
        routed_scaling_factor=text.real("routed_scaling_factor", 1.0),
        num_expert_group=text.integer("num_expert_group", 1, null_is_default=True),
        topk_group=text.integer("topk_group", 1, null_is_default=True),
        attn_res_block_size=text.integer("attn_res_block_size", None),
        # the wrapper may carry these beside text_config (checked by ModelConfig)
        tie_word_embeddings=text.flag("tie_word_embeddings", raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id", text_config.get("bos_token_id")),
        eos_token_id=raw.get("eos_token_id", text_config.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id", text_config.get("pad_token_id")),
        max_position_embeddings=text.integer("max_position_embeddings", 1 << 20),
        initializer_range=text.real("initializer_range", 0.02),
        dtype=str(text_config.get("dtype", raw.get("dtype", "bfloat16"))),
        expert_weights="mxfp4" if _is_mxfp4(text_config.get("quantization_config")) else "bf16",
    )
    if fields["index_topk"] is not None and (not fields["index_n_heads"] or not fields["index_head_dim"]):
        raise ConfigError("index_topk is set but index_n_heads / index_head_dim are missing")
    if fields["tie_word_embeddings"]:
        raise ConfigError("tie_word_embeddings=true: every Kimi checkpoint has an untied lm_head")
    if act == "silu":  # SwiGLU has no linear branch to clip
        fields["activation_situ_linear_beta"] = None
    _check_consistent(text_config, fields)
    if raw.get("vision_config") is not None:
        fields["vision"] = vision_fields(raw["vision_config"],
                                         media_placeholder_token_id=raw.get("media_placeholder_token_id"))
    return fields


def vision_fields(vision_config: dict, *, media_placeholder_token_id: int | None = None) -> dict[str, Any]:
    """`VisionConfig`'s fields from a release `vision_config` object; a key with an unsupported
    value is an error (unknown keys are `model_fields`' check)."""
    if not isinstance(vision_config, dict):
        raise ConfigError(f"vision_config: expected an object, got {type(vision_config).__name__}")
    for key, want in _VISION_FIXED.items():
        if key in vision_config and vision_config[key] != want:
            raise ConfigError(f"vision_config.{key}={vision_config[key]!r}: k31jax implements {want!r} (vision.md §1)")
    fields = {field: vision_config[key] for key, field in _VISION_FIELDS.items() if key in vision_config}
    if media_placeholder_token_id is not None:
        fields["media_placeholder_token_id"] = int(media_placeholder_token_id)
    return fields


def vision_config_json(fields: Mapping[str, Any]) -> dict:
    """The release `vision_config` object of `VisionConfig`'s fields (`vision_fields` of it
    gives them back)."""
    out = {key: fields[field] for key, field in _VISION_FIELDS.items()}
    out["merge_kernel_size"] = list(out["merge_kernel_size"])
    return {**_VISION_FIXED, **out}


def _check_known_keys(raw: dict) -> None:
    text = raw.get("text_config", raw)
    # index_* / indexer_* keys get the indexer's own, more specific check in `_check_supported`
    unknown = sorted(k for k in text if k not in _READ_HF_KEYS and k not in IGNORED_HF_KEYS
                     and not k.startswith(("index_", "indexer_")))
    if isinstance(raw.get("text_config"), dict):
        unknown += sorted(f"(top level) {k}" for k in raw if k not in _READ_HF_KEYS and k not in IGNORED_HF_KEYS)
    vision = raw.get("vision_config")
    if isinstance(vision, dict):
        unknown += sorted(f"vision_config.{k}" for k in vision
                          if k not in _VISION_FIXED and k not in _VISION_FIELDS and k not in _VISION_IGNORED)
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}: not part of this architecture (k31jax has no RoPE, "
                          "sliding window or GQA); pass allow_unknown=True to ignore them")


def _check_supported(text: dict) -> None:
    """Keys that name a feature this model does not have (or that no spec describes)."""
    unknown_index = [k for k in text if (k.startswith("index_") or k.startswith("indexer_"))
                     and k not in _INDEX_KEYS]
    if unknown_index:
        raise ConfigError(f"unknown indexer keys {sorted(unknown_index)}: only {list(_INDEX_KEYS)} "
                          "are specified (architecture.md §10.5)")
    if text.get("num_nextn_predict_layers", 0):
        raise ConfigError(f"num_nextn_predict_layers={text['num_nextn_predict_layers']}: MTP "
                          "layers are not supported (the release ships none), expected 0")
    if text.get("mla_use_nope") is False:
        raise ConfigError("mla_use_nope=false: rotary MLA is not specified for this model, "
                          "expected true")


def _linear_attn_config(text: dict) -> _Keys:
    lac = text.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ConfigError(f"linear_attn_config: expected an object, got {shown(lac)}")
    unknown = sorted(set(lac) - _LINEAR_ATTN_KEYS)
    if unknown:
        raise ConfigError(f"linear_attn_config has unknown keys {unknown}")
    return _Keys(lac, "linear_attn_config.")


def _kda_fields(text: _Keys, lac: _Keys, layer_types: tuple[LayerType, ...]) -> dict[str, Any]:
    """The `kda_*` fields, from `linear_attn_config` or from the flat `linear_*` keys that
    transformers' re-saved Kimi Linear configs use instead."""
    heads = (lac.integer("num_heads", 0, field="kda_num_heads", null_is_default=True) if "num_heads" in lac
             else text.integer("linear_num_heads", 0, field="kda_num_heads", null_is_default=True))
    head_key = "head_dim" if "head_dim" in lac else "head_k_dim" if "head_k_dim" in lac else None
    head_dim = (lac.integer(head_key, 0, field="kda_head_dim", null_is_default=True) if head_key
                else text.integer("linear_head_dim", 0, field="kda_head_dim", null_is_default=True))
    lower_bound = lac.real("gate_lower_bound", None)
    # The K3 release pads A_log to head_dim; Kimi Linear stores one value per head.
    a_log_len = head_dim if lower_bound is not None else heads
    if "kda" in layer_types and a_log_len < heads:
        a_log_len = heads
    conv_size = (lac.integer("short_conv_kernel_size", 4, field="kda_conv_size") if "short_conv_kernel_size" in lac
                 else text.integer("linear_conv_kernel_dim", 4, field="kda_conv_size"))
    return dict(kda_num_heads=heads, kda_head_dim=head_dim, kda_conv_size=conv_size,
                kda_gate_lower_bound=lower_bound, kda_full_rank_gate=lac.flag("use_full_rank_gate", False),
                kda_a_log_len=a_log_len)


def _check_consistent(text: dict, fields: dict) -> None:
    """Keys that restate what other keys define must agree (MLA has one kv head per query head)."""
    heads = fields["num_attention_heads"]
    if text.get("num_key_value_heads") not in (None, heads):
        raise ConfigError(f"num_key_value_heads={text['num_key_value_heads']}: MLA has no grouped kv heads, "
                          f"expected num_attention_heads={heads}")
    qk = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
    if text.get("qk_head_dim") not in (None, qk):
        raise ConfigError(f"qk_head_dim={text['qk_head_dim']}: expected qk_nope_head_dim + qk_rope_head_dim = {qk}")
    # transformers' kimi_linear stores the (here unrotated) k_pe width as head_dim
    if text.get("head_dim") not in (None, fields["qk_rope_head_dim"]):
        raise ConfigError(f"head_dim={text['head_dim']}: expected qk_rope_head_dim = {fields['qk_rope_head_dim']}")
    lac = text.get("linear_attn_config") or {}
    for flat, nested, value in (("linear_num_heads", "num_heads", fields["kda_num_heads"]),
                                ("linear_head_dim", "head_dim", fields["kda_head_dim"]),
                                ("linear_conv_kernel_dim", "short_conv_kernel_size", fields["kda_conv_size"])):
        if text.get(flat) not in (None, value):
            raise ConfigError(f"{flat}={text[flat]} disagrees with linear_attn_config.{nested}={value}")
    if "layer_types" in text and lac:
        named = tuple(_LAYER_TYPE_ALIASES.get(n, n) for n in text["layer_types"])
        if named != fields["layer_types"]:
            raise ConfigError(f"layer_types {list(text['layer_types'])} disagrees with linear_attn_config's "
                              "full_attn_layers / kda_layers")
    if text.get("attention_bias"):
        raise ConfigError("attention_bias=true: Kimi projections have no biases")
    if text.get("use_grouped_topk") is False and fields["num_expert_group"] > 1:
        raise ConfigError("use_grouped_topk=false with num_expert_group > 1")
    if text.get("topk_method") not in (None, "noaux_tc"):
        raise ConfigError(f"topk_method={text['topk_method']!r}: k31jax routes with 'noaux_tc' (sigmoid scores, "
                          "selection-only bias)")
    mlp = text.get("mlp_layer_types")
    if mlp is not None:
        want = _mlp_layer_types(fields["num_hidden_layers"], fields["num_experts"], fields["first_k_dense_replace"],
                                fields["moe_layer_freq"])
        if list(mlp) != want:
            raise ConfigError(f"mlp_layer_types {list(mlp)} disagrees with first_k_dense_replace / moe_layer_freq "
                              f"({want})")


def _mlp_layer_types(num_layers: int, num_experts: int, first_k_dense: int, freq: int) -> list[str]:
    """transformers' per-layer names of the MoE schedule (`ModelConfig.is_moe_layer`)."""
    return ["sparse" if num_experts and i >= first_k_dense and i % freq == 0 else "dense" for i in range(num_layers)]


def _moe_schedule(text: _Keys, num_layers: int, num_experts: int) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq). A null key is an absent one (transformers 5.x
    writes both as null beside `mlp_layer_types`); absent keys are read off `mlp_layer_types`
    when it is given (the first MoE layer, the smallest period that reproduces it), else they
    take the defaults 0 and 1."""
    given = {key: text.values.get(key) for key in ("first_k_dense_replace", "moe_layer_freq")}
    mlp = text.values.get("mlp_layer_types")
    if mlp is None or all(v is not None for v in given.values()):
        return (text.integer("first_k_dense_replace", 0, null_is_default=True),
                text.integer("moe_layer_freq", 1, null_is_default=True))
    if not isinstance(mlp, list) or any(n not in ("dense", "sparse") for n in mlp):
        raise ConfigError(f"mlp_layer_types: expected a list of 'dense' / 'sparse', got {shown(mlp)}")
    if len(mlp) != num_layers:
        raise ConfigError(f"mlp_layer_types has {len(mlp)} entries, expected num_hidden_layers={num_layers}")
    sparse = [i for i, name in enumerate(mlp) if name == "sparse"]
    first = text.integer("first_k_dense_replace", 0) if given["first_k_dense_replace"] is not None else (
        sparse[0] if sparse else num_layers)
    if given["moe_layer_freq"] is not None:
        freqs = [text.integer("moe_layer_freq", 1)]
    else:  # MoE layers are consecutive multiples of the period: two of them give it
        freqs = [sparse[1] - sparse[0]] if len(sparse) > 1 else range(1, num_layers + 1)
    for freq in freqs:
        if _mlp_layer_types(num_layers, num_experts, first, freq) == mlp:
            return first, freq
    raise ConfigError(f"mlp_layer_types {mlp}: not a schedule of first_k_dense_replace dense layers then MoE "
                      "every moe_layer_freq-th layer, the one k31jax builds")


def _is_mxfp4(qc) -> bool:
    """Whether a compressed-tensors quantization_config declares MXFP4 (experts only, in
    practice: the converter decides per tensor, checkpoint_format.md §4)."""
    if not isinstance(qc, dict):
        return False
    formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()
                                    if isinstance(g, dict)}
    if "mxfp4-pack-quantized" in formats:
        return True
    if qc.get("quant_method") in ("compressed-tensors", "mxfp4") or formats - {None}:
        raise ConfigError(f"quantization_config: unsupported format {sorted(f for f in formats if f)} / "
                          f"quant_method {qc.get('quant_method')!r}; k31jax reads mxfp4-pack-quantized")
    return False


def _layer_list(lac: dict, key: str) -> list[int]:
    """A 1-indexed layer list of `linear_attn_config` (integers only)."""
    value = lac.get(key, [])
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise ConfigError(f"linear_attn_config.{key}: expected a list of 1-indexed layer numbers, got {shown(value)}")
    return value


def _layer_types(text: dict, lac: dict, num_layers: int) -> tuple[LayerType, ...]:
    if "full_attn_layers" in lac or "kda_layers" in lac:
        full = _layer_list(lac, "full_attn_layers")
        kda = _layer_list(lac, "kda_layers")
        both = sorted(set(full) & set(kda))
        if both:
            raise ConfigError(f"linear_attn_config: layers {both} are in both full_attn_layers and "
                              "kda_layers (1-indexed lists must be disjoint)")
        expected = set(range(1, num_layers + 1))
        missing = sorted(expected - set(full) - set(kda))
        extra = sorted((set(full) | set(kda)) - expected)
        if missing or extra:
            raise ConfigError(
                f"linear_attn_config: full_attn_layers + kda_layers must cover 1..{num_layers} "
                f"exactly (1-indexed); missing {missing}, out of range {extra}")
        return tuple("mla" if i + 1 in full else "kda" for i in range(num_layers))
    if "layer_types" in text:
        names = text["layer_types"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"layer_types: expected a list of names, got {shown(names)}")
        if len(names) != num_layers:
            raise ConfigError(f"layer_types has {len(names)} entries, expected {num_layers}")
        unknown = sorted({n for n in names if n not in _LAYER_TYPE_ALIASES})
        if unknown:
            raise ConfigError(f"layer_types: unknown names {unknown}, expected one of "
                              f"{sorted(_LAYER_TYPE_ALIASES)}")
        return tuple(_LAYER_TYPE_ALIASES[n] for n in names)
    raise ConfigError("missing the layer schedule: expected linear_attn_config.full_attn_layers / "
                      "kda_layers (1-indexed) or layer_types")
