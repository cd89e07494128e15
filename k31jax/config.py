"""The k31jax model configuration: one frozen dataclass, read from the release `config.json`.

`ModelConfig.from_hf(path_or_dict)` accepts the multimodal release wrapper (`text_config`
nested inside), a bare `text_config`, or a re-saved Kimi Linear config. Layer lists in the
file are 1-indexed; `layer_types` here is 0-indexed (spec architecture.md §1-§2).

Presets live as release-format JSON files in `configs/` and are loaded by name with
`ModelConfig.preset(name)` (`k3`, `k31_pro`, `kimi_linear_48b`, `tiny`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Literal

LayerType = Literal["kda", "mla"]

_INDEX_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
_LINEAR_ATTN_KEYS = frozenset(
    {"full_attn_layers", "kda_layers", "head_dim", "num_heads", "short_conv_kernel_size",
     "gate_lower_bound", "use_full_rank_gate", "head_k_dim", "head_v_dim"}
)
# Keys of a release / transformers config.json that carry nothing for this model: transformers'
# generic PretrainedConfig fields (generation defaults, bookkeeping) and training-only knobs.
# Any other key that `from_hf` does not read or check is an error (`allow_unknown=True` skips it).
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
# Keys the text model reads (or checks for consistency) in `_fields_from_hf`.
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


class ConfigError(ValueError):
    """A config that k31jax cannot build a model from; the message names the field."""


# Sane bounds of the integer fields (inclusive): far above any Kimi model (K3: 93 layers,
# hidden 7168, 896 experts, vocab 163,840), so only a typo or a unit mix-up fails here, and it
# fails before anything is allocated (1e9 layers would exhaust memory building the schedule).
_INT_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24), "hidden_size": (1, 1 << 17), "num_hidden_layers": (1, 4096),
    "intermediate_size": (0, 1 << 20), "first_k_dense_replace": (0, 4096), "moe_layer_freq": (1, 4096),
    "num_attention_heads": (0, 4096), "q_lora_rank": (1, 1 << 17), "kv_lora_rank": (0, 1 << 17),
    "qk_nope_head_dim": (0, 1 << 14), "qk_rope_head_dim": (0, 1 << 14), "v_head_dim": (0, 1 << 14),
    "kda_num_heads": (0, 4096), "kda_head_dim": (0, 1 << 14), "kda_conv_size": (0, 1024),
    "kda_a_log_len": (0, 1 << 17), "kda_chunk_size": (1, 1 << 16), "index_topk": (1, 1 << 30),
    "index_n_heads": (0, 4096), "index_head_dim": (0, 1 << 14), "num_experts": (0, 1 << 16),
    "num_experts_per_token": (0, 1 << 16), "num_shared_experts": (0, 1024), "moe_intermediate_size": (0, 1 << 20),
    "routed_expert_hidden_size": (1, 1 << 17), "num_expert_group": (1, 1 << 16), "topk_group": (1, 1 << 16),
    "attn_res_block_size": (1, 4096), "bos_token_id": (0, 1 << 24), "eos_token_id": (0, 1 << 24),
    "pad_token_id": (0, 1 << 24), "max_position_embeddings": (1, 1 << 40),
}
# Fields that may be None (their annotation says `| None`).
_OPTIONAL = frozenset({"q_lora_rank", "index_topk", "routed_expert_hidden_size", "attn_res_block_size",
                       "bos_token_id", "eos_token_id", "pad_token_id", "activation_situ_linear_beta",
                       "kda_gate_lower_bound"})
# Float fields: finite, and (low, high, low excluded) where a range applies.
_FLOAT_BOUNDS: dict[str, tuple[float | None, float | None, bool]] = {
    "rms_norm_eps": (0.0, 1.0, True), "activation_situ_beta": (0.0, None, True),
    "activation_situ_linear_beta": (0.0, None, True), "kda_gate_lower_bound": (None, None, False),
    "routed_scaling_factor": (0.0, None, True), "initializer_range": (0.0, None, False),
}
_BOOL_FIELDS = ("mla_use_output_gate", "kda_full_rank_gate", "latent_moe_use_norm", "moe_renormalize",
                "tie_word_embeddings", "expert_qat")
_STR_FIELDS = ("hidden_act", "moe_router_activation_func", "dtype", "expert_weights", "expert_activations")


def _shown(value) -> str:
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


def check_int(name: str, value, *, optional: bool = False) -> int | None:
    """`value` if it is an integer within `_INT_BOUNDS[name]` (bool, float, str rejected),
    else a `ConfigError` naming `name` and what was expected."""
    if value is None and optional:
        return None
    low, high = _INT_BOUNDS.get(name, (0, 1 << 40))
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer in [{low}, {high}]{' or null' if optional else ''}, "
                          f"got {_shown(value)}")
    if not low <= value <= high:
        raise ConfigError(f"{name}: {value} is outside [{low}, {high}]")
    return value


def check_float(name: str, value, *, optional: bool = False) -> float | None:
    """`value` as a float if it is a finite number within `_FLOAT_BOUNDS[name]`, else a
    `ConfigError` (bool, str, NaN and Infinity rejected)."""
    if value is None and optional:
        return None
    low, high, low_open = _FLOAT_BOUNDS.get(name, (None, None, False))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name}: expected a finite number{' or null' if optional else ''}, got {_shown(value)}")
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"<= {high}"
        raise ConfigError(f"{name}: {value} is out of range (expected {' and '.join(x for x in (lo, hi) if x)})")
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {_shown(value)}")
    return value


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


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """MoonViT-V2 tower + patch-merger projector (vision.md §1), read from `vision_config`."""

    patch_size: int = 14
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_attention_heads: int = 12
    qkv_hidden_size: int = 1536
    num_hidden_layers: int = 27
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    # Only video uses the temporal table; K3 takes images (T = 1), so this is recorded, not used.
    pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)
    mm_hidden_size: int = 1024
    text_hidden_size: int = 7168
    projector_ln_eps: float = 1e-5
    # The tower norms are torch `nn.RMSNorm(dim)` without eps: float32's eps whatever the dtype.
    norm_eps: float = 2.0 ** -23
    media_placeholder_token_id: int = 163605

    def __post_init__(self):
        object.__setattr__(self, "merge_kernel_size", tuple(int(k) for k in self.merge_kernel_size))
        def fail(field: str, msg: str):
            raise ConfigError(f"VisionConfig.{field}: {msg}")

        for f in ("patch_size", "hidden_size", "intermediate_size", "num_attention_heads", "qkv_hidden_size",
                  "num_hidden_layers", "pos_emb_height", "pos_emb_width", "text_hidden_size"):
            if getattr(self, f) <= 0:
                fail(f, f"must be > 0, got {getattr(self, f)}")
        if self.qkv_hidden_size % self.num_attention_heads:
            fail("qkv_hidden_size", f"{self.qkv_hidden_size} is not a multiple of num_attention_heads="
                 f"{self.num_attention_heads}")
        if self.head_dim % 4:
            fail("qkv_hidden_size", f"head_dim {self.head_dim} must be a multiple of 4 for the 2-D RoPE")
        if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) <= 0:
            fail("merge_kernel_size", f"{list(self.merge_kernel_size)}, expected two positive ints")
        if self.mm_hidden_size != self.hidden_size:
            fail("mm_hidden_size", f"{self.mm_hidden_size}: the projector reads the tower's output, expected "
                 f"hidden_size={self.hidden_size}")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_attention_heads

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token: the kh x kw patches' features side by side."""
        return self.hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_hf(cls, vc: dict, *, media_placeholder_token_id: int | None = None) -> "VisionConfig":
        """From a release `vision_config` object; a key with an unsupported value is an error
        (unknown keys are `ModelConfig.from_hf`'s check)."""
        if not isinstance(vc, dict):
            raise ConfigError(f"vision_config: expected an object, got {type(vc).__name__}")
        for key, want in _VISION_FIXED.items():
            if key in vc and vc[key] != want:
                raise ConfigError(f"vision_config.{key}={vc[key]!r}: k31jax implements {want!r} (vision.md §1)")
        fields = {f: vc[k] for k, f in _VISION_FIELDS.items() if k in vc}
        if media_placeholder_token_id is not None:
            fields["media_placeholder_token_id"] = int(media_placeholder_token_id)
        return cls(**fields)

    def to_hf(self) -> dict:
        """The `vision_config` object (`from_hf` of it gives this config back)."""
        out = {k: getattr(self, f) for k, f in _VISION_FIELDS.items()}
        out["merge_kernel_size"] = list(self.merge_kernel_size)
        return {**_VISION_FIXED, **out}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Text-model hyper-parameters. HF field names wherever HF has a flat field."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[LayerType, ...]
    rms_norm_eps: float = 1e-5
    # FFN activation: "situ" (SiTU-GLU) or "silu" (SwiGLU).
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    intermediate_size: int = 0
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    # Gated NoPE MLA.
    num_attention_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_use_output_gate: bool = True
    # Kimi Delta Attention.
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    kda_conv_size: int = 4
    kda_gate_lower_bound: float | None = -5.0
    kda_full_rank_gate: bool = True
    kda_a_log_len: int = 0
    kda_chunk_size: int = 64
    # K3.1 Gated DSA lightning indexer (None: dense gated MLA).
    index_topk: int | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    # Mixture of experts.
    num_experts: int = 0
    num_experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    # Depth mixing: Block AttnRes block size, or None for plain pre-norm residuals.
    attn_res_block_size: int | None = 12
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int = 1 << 20
    initializer_range: float = 0.02
    # Storage dtype of the non-f32 parameters and the activation dtype.
    dtype: str = "bfloat16"
    # Routed experts: "mxfp4" keeps them packed (uint8 E2M1 pairs + E8M0 scales, dequantised
    # inside the jitted matmul); "bf16" holds them unquantised in `dtype`.
    expert_weights: str = "bf16"
    # "mxfp8" quantise-dequantises the routed experts' GEMM inputs per 32-block (E4M3, rceil),
    # as the served model does; "bf16" leaves them alone.
    expert_activations: str = "bf16"
    # QAT: float master expert weights, fake-quantised to MXFP4 (floor rule, straight-through
    # gradient) in the forward pass. Requires expert_weights="bf16".
    expert_qat: bool = False
    # The vision tower and projector (None: a text-only checkpoint).
    vision: VisionConfig | None = None

    def __post_init__(self):
        if isinstance(self.vision, dict):  # from dataclasses.asdict / JSON
            object.__setattr__(self, "vision", VisionConfig(**self.vision))
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i))

    @property
    def latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_in_dim(self) -> int:
        """Width the routed experts read and write: the latent ℓ, or D without a latent."""
        return self.routed_expert_hidden_size if self.latent_moe else self.hidden_size

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def use_indexer(self) -> bool:
        return self.index_topk is not None

    @property
    def use_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def num_attn_res_slots(self) -> int:
        """Snapshots pushed over the whole stack (at layers 0, S, 2S, ...)."""
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size) if self.use_attn_res else 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def fail(field: str, msg: str):
            raise ConfigError(f"ModelConfig.{field}: {msg}")

        self._check_types()
        if len(self.layer_types) != self.num_hidden_layers:
            fail("layer_types", f"has {len(self.layer_types)} entries, expected "
                 f"num_hidden_layers={self.num_hidden_layers}")
        bad = [t for t in self.layer_types if t not in ("kda", "mla")]
        if bad:
            fail("layer_types", f"unknown layer types {sorted(set(bad))}, expected 'kda' or 'mla'")
        if self.hidden_act not in ("situ", "silu"):
            fail("hidden_act", f"{self.hidden_act!r}, expected 'situ' or 'silu'")
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            fail("moe_router_activation_func", f"{self.moe_router_activation_func!r}, "
                 "expected 'sigmoid' or 'softmax'")
        if self.kda_layers:
            for f in ("kda_num_heads", "kda_head_dim", "kda_conv_size"):
                if getattr(self, f) <= 0:
                    fail(f, f"must be > 0 when the schedule has KDA layers, got {getattr(self, f)}")
            if self.kda_a_log_len < self.kda_num_heads:
                fail("kda_a_log_len", f"{self.kda_a_log_len} < kda_num_heads={self.kda_num_heads}: "
                     "A_log holds one scalar per head")
            if self.kda_chunk_size <= 0:
                fail("kda_chunk_size", f"must be > 0, got {self.kda_chunk_size}")
        if self.mla_layers:
            for f in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                if getattr(self, f) <= 0:
                    fail(f, f"must be > 0 when the schedule has MLA layers, got {getattr(self, f)}")
        if self.use_indexer:
            if self.index_topk <= 0:
                fail("index_topk", f"must be a positive int or None, got {self.index_topk}")
            if self.index_n_heads <= 0 or self.index_head_dim <= 0:
                fail("index_n_heads", "index_n_heads and index_head_dim must be > 0 with "
                     f"index_topk set, got {self.index_n_heads} and {self.index_head_dim}")
            if self.q_lora_rank is None:
                fail("q_lora_rank", "the lightning indexer reads the MLA q-latent, so it needs "
                     "q_lora_rank; got None")
        if self.moe_layers:
            if not 0 < self.num_experts_per_token <= self.num_experts:
                fail("num_experts_per_token", f"{self.num_experts_per_token}, expected 1.."
                     f"num_experts={self.num_experts}")
            if self.num_experts % self.num_expert_group:
                fail("num_expert_group", f"{self.num_expert_group} does not divide "
                     f"num_experts={self.num_experts}")
            if self.topk_group > self.num_expert_group:
                fail("topk_group", f"{self.topk_group} > num_expert_group={self.num_expert_group}")
            if self.moe_intermediate_size <= 0:
                fail("moe_intermediate_size", f"must be > 0, got {self.moe_intermediate_size}")
        if self.dense_layers and self.intermediate_size <= 0:
            fail("intermediate_size", f"must be > 0 for the dense layers {self.dense_layers}")
        if self.use_attn_res and self.attn_res_block_size <= 0:
            fail("attn_res_block_size", f"must be > 0 or None, got {self.attn_res_block_size}")
        if self.expert_weights not in ("bf16", "mxfp4"):
            fail("expert_weights", f"{self.expert_weights!r}, expected 'bf16' or 'mxfp4'")
        if self.expert_activations not in ("bf16", "mxfp8"):
            fail("expert_activations", f"{self.expert_activations!r}, expected 'bf16' or 'mxfp8'")
        if self.expert_qat and self.expert_weights != "bf16":
            fail("expert_qat", "QAT trains float master weights: set expert_weights='bf16'")
        if self.expert_weights == "mxfp4" and self.moe_layers and (
                self.moe_intermediate_size % 32 or self.expert_in_dim % 32):
            fail("expert_weights", f"mxfp4 needs expert widths divisible by 32, got "
                 f"moe_intermediate_size={self.moe_intermediate_size}, expert input={self.expert_in_dim}")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            fail("dtype", f"{self.dtype!r}, expected 'bfloat16', 'float32' or 'float16'")

    def _check_types(self) -> None:
        """Every field's type and sane range, before any check that computes with them."""
        try:
            for name in _INT_BOUNDS:
                check_int(name, getattr(self, name), optional=name in _OPTIONAL)
            for name in _FLOAT_BOUNDS:
                check_float(name, getattr(self, name), optional=name in _OPTIONAL)
            for name in _BOOL_FIELDS:
                check_bool(name, getattr(self, name))
            for name in _STR_FIELDS:
                if not isinstance(getattr(self, name), str):
                    raise ConfigError(f"{name}: expected a string, got {_shown(getattr(self, name))}")
            if not isinstance(self.layer_types, (tuple, list)):
                raise ConfigError(f"layer_types: expected a sequence of 'kda' / 'mla', got {_shown(self.layer_types)}")
        except ConfigError as e:
            raise ConfigError(f"ModelConfig.{e}") from None

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_hf(cls, source: str | os.PathLike | dict, *, allow_unknown: bool = False,
                **overrides: Any) -> "ModelConfig":
        """Build from a release/HF `config.json` (a path to the file or its folder, or a dict):
        the release's multimodal wrapper (`text_config`) or a flat transformers `kimi_linear`
        config. A key that is neither read, checked, nor in `IGNORED_HF_KEYS` (transformers'
        generic fields) is an error naming it, unless `allow_unknown=True`."""
        where = "<dict>"
        if not isinstance(source, dict):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            where = str(path)
            try:
                source = json.loads(path.read_bytes().decode("utf-8"))
            except FileNotFoundError:
                raise ConfigError(f"{where}: no such config file") from None
            except OSError as e:
                raise ConfigError(f"{where}: cannot be read ({e.strerror or e})") from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(source, dict):
            raise ConfigError(f"{where}: expected a JSON object (the config.json fields), got a "
                              f"{type(source).__name__}")
        try:
            if not allow_unknown:
                _check_known_keys(source)
            fields = _fields_from_hf(source)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        fields.update(overrides)
        try:
            return cls(**fields)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A named preset from `configs/` (`k3`, `k31_pro`, `kimi_linear_48b`, `tiny`)."""
        path = preset_dir() / f"{name}.json"
        if not path.exists():
            known = sorted(p.stem for p in preset_dir().glob("*.json"))
            raise ConfigError(f"unknown preset {name!r}; known presets: {known}")
        return cls.from_hf(path, **overrides)




def preset_dir() -> Path:
    """The folder of preset JSON files (inside the package, a link to the repo's configs/)."""
    return Path(__file__).resolve().parent / "configs"


def preset_names() -> list[str]:
    return sorted(p.stem for p in preset_dir().glob("*.json"))


def _check_known_keys(raw: dict) -> None:
    text = raw.get("text_config", raw)
    # index_* / indexer_* keys get the indexer's own, more specific check in `_fields_from_hf`
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


def _moe_schedule(text: dict, num_layers: int, num_experts: int, num) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq). A null key is an absent one (transformers 5.x
    writes both as null beside `mlp_layer_types`); absent keys are read off `mlp_layer_types`
    when it is given (the first MoE layer, the smallest period that reproduces it), else they
    take the defaults 0 and 1."""
    given = {key: text.get(key) for key in ("first_k_dense_replace", "moe_layer_freq")}
    mlp = text.get("mlp_layer_types")
    if mlp is None or all(v is not None for v in given.values()):
        return (num("first_k_dense_replace", 0, null_default=True), num("moe_layer_freq", 1, null_default=True))
    if not isinstance(mlp, list) or any(n not in ("dense", "sparse") for n in mlp):
        raise ConfigError(f"mlp_layer_types: expected a list of 'dense' / 'sparse', got {_shown(mlp)}")
    if len(mlp) != num_layers:
        raise ConfigError(f"mlp_layer_types has {len(mlp)} entries, expected num_hidden_layers={num_layers}")
    sparse = [i for i, name in enumerate(mlp) if name == "sparse"]
    first = num("first_k_dense_replace", 0) if given["first_k_dense_replace"] is not None else (
        sparse[0] if sparse else num_layers)
    if given["moe_layer_freq"] is not None:
        freqs = [num("moe_layer_freq", 1)]
    else:  # MoE layers are consecutive multiples of the period: two of them give it
        freqs = [sparse[1] - sparse[0]] if len(sparse) > 1 else range(1, num_layers + 1)
    for freq in freqs:
        if _mlp_layer_types(num_layers, num_experts, first, freq) == mlp:
            return first, freq
    raise ConfigError(f"mlp_layer_types {mlp}: not a schedule of first_k_dense_replace dense layers then MoE "
                      "every moe_layer_freq-th layer, the one k31jax builds")


def _fields_from_hf(raw: dict) -> dict[str, Any]:
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError("text_config: expected an object")
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

    def need(key: str, container: dict = text, name: str | None = None):
        if key not in container:
            raise ConfigError(f"missing required field {name or key!r}")
        return container[key]

    def num(key: str, default, *, field: str | None = None, container: dict = text, null_default: bool = False):
        """An integer field read without conversion: 13.7, "13", true or null are errors naming
        the key (null means `default` where the release writes null for "absent")."""
        value = container.get(key, default)
        if value is None and null_default:
            value = default
        shown = key if container is text else f"linear_attn_config.{key}"
        try:
            return check_int(field or key, value, optional=default is None)
        except ConfigError as e:
            raise ConfigError(f"{shown}{str(e)[len(field or key):]}") from None

    def real(key: str, default, container: dict = text):
        try:
            return check_float(key, container.get(key, default), optional=default is None)
        except ConfigError as e:
            raise ConfigError(str(e)) from None

    def flag(key: str, default, container: dict = text):
        value = container.get(key, default)
        shown = key if container is text else f"linear_attn_config.{key}"
        if not isinstance(value, bool):
            raise ConfigError(f"{shown}: expected true or false, got {_shown(value)}")
        return value

    for key in ("num_hidden_layers", "vocab_size", "hidden_size"):
        need(key)
    num_layers = num("num_hidden_layers", 0)
    lac = text.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ConfigError(f"linear_attn_config: expected an object, got {_shown(lac)}")
    unknown_lac = sorted(set(lac) - _LINEAR_ATTN_KEYS)
    if unknown_lac:
        raise ConfigError(f"linear_attn_config has unknown keys {unknown_lac}")
    layer_types = _layer_types(text, lac, num_layers)

    # transformers' re-saved Kimi Linear configs also spell these flat (linear_*)
    kda_heads = (num("num_heads", 0, field="kda_num_heads", container=lac, null_default=True) if "num_heads" in lac
                 else num("linear_num_heads", 0, field="kda_num_heads", null_default=True))
    head_key = "head_dim" if "head_dim" in lac else "head_k_dim" if "head_k_dim" in lac else None
    kda_head_dim = (num(head_key, 0, field="kda_head_dim", container=lac, null_default=True) if head_key
                    else num("linear_head_dim", 0, field="kda_head_dim", null_default=True))
    lower_bound = real("gate_lower_bound", None, lac)
    # The K3 release pads A_log to head_dim; Kimi Linear stores one value per head.
    a_log_len = kda_head_dim if lower_bound is not None else kda_heads
    if "kda" in layer_types and a_log_len < kda_heads:
        a_log_len = kda_heads

    act = text.get("hidden_act", "silu")
    first_k_dense, moe_freq = _moe_schedule(text, num_layers, num("num_experts", 0, null_default=True), num)
    fields: dict[str, Any] = dict(
        vocab_size=num("vocab_size", 0),
        hidden_size=num("hidden_size", 0),
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        rms_norm_eps=real("rms_norm_eps", 1e-5),
        hidden_act=act,
        activation_situ_beta=real("activation_situ_beta", 4.0),
        activation_situ_linear_beta=real("activation_situ_linear_beta", None),
        intermediate_size=num("intermediate_size", 0),
        first_k_dense_replace=first_k_dense,
        moe_layer_freq=moe_freq,
        num_attention_heads=num("num_attention_heads", 0),
        q_lora_rank=num("q_lora_rank", None),
        kv_lora_rank=num("kv_lora_rank", 0, null_default=True),
        qk_nope_head_dim=num("qk_nope_head_dim", 0, null_default=True),
        qk_rope_head_dim=num("qk_rope_head_dim", 0, null_default=True),
        v_head_dim=num("v_head_dim", 0, null_default=True),
        mla_use_output_gate=flag("mla_use_output_gate", False),
        kda_num_heads=kda_heads,
        kda_head_dim=kda_head_dim,
        kda_conv_size=(num("short_conv_kernel_size", 4, field="kda_conv_size", container=lac) if "short_conv_kernel_size" in lac
                       else num("linear_conv_kernel_dim", 4, field="kda_conv_size")),
        kda_gate_lower_bound=lower_bound,
        kda_full_rank_gate=flag("use_full_rank_gate", False, lac),
        kda_a_log_len=a_log_len,
        index_topk=num("index_topk", None),
        index_n_heads=num("index_n_heads", 0, null_default=True),
        index_head_dim=num("index_head_dim", 0, null_default=True),
        num_experts=num("num_experts", 0, null_default=True),
        num_experts_per_token=num("num_experts_per_token", 0, null_default=True),
        num_shared_experts=num("num_shared_experts", 0, null_default=True),
        moe_intermediate_size=num("moe_intermediate_size", 0, null_default=True),
        routed_expert_hidden_size=num("routed_expert_hidden_size", None),
        latent_moe_use_norm=flag("latent_moe_use_norm", True),
        moe_renormalize=flag("moe_renormalize", True),
        moe_router_activation_func=text.get("moe_router_activation_func", "sigmoid"),
        routed_scaling_factor=real("routed_scaling_factor", 1.0),
        num_expert_group=num("num_expert_group", 1, null_default=True),
        topk_group=num("topk_group", 1, null_default=True),
        attn_res_block_size=num("attn_res_block_size", None),
        tie_word_embeddings=flag("tie_word_embeddings", raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id", text.get("bos_token_id")),
        eos_token_id=raw.get("eos_token_id", text.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id", text.get("pad_token_id")),
        max_position_embeddings=num("max_position_embeddings", 1 << 20),
        initializer_range=real("initializer_range", 0.02),
        dtype=str(text.get("dtype", raw.get("dtype", "bfloat16"))),
        expert_weights="mxfp4" if _is_mxfp4(text.get("quantization_config")) else "bf16",
    )
    if fields["index_topk"] is not None and (not fields["index_n_heads"] or not fields["index_head_dim"]):
        raise ConfigError("index_topk is set but index_n_heads / index_head_dim are missing")
    if fields["tie_word_embeddings"]:
        raise ConfigError("tie_word_embeddings=true: every Kimi checkpoint has an untied lm_head")
    if act == "silu":
        fields["activation_situ_linear_beta"] = None
    _check_consistent(text, fields)
    if raw.get("vision_config") is not None:
        fields["vision"] = VisionConfig.from_hf(raw["vision_config"],
                                                media_placeholder_token_id=raw.get("media_placeholder_token_id"))
    return fields


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
        raise ConfigError(f"linear_attn_config.{key}: expected a list of 1-indexed layer numbers, got {_shown(value)}")
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
            raise ConfigError(f"layer_types: expected a list of names, got {_shown(names)}")
        if len(names) != num_layers:
            raise ConfigError(f"layer_types has {len(names)} entries, expected {num_layers}")
        unknown = sorted({n for n in names if n not in _LAYER_TYPE_ALIASES})
        if unknown:
            raise ConfigError(f"layer_types: unknown names {unknown}, expected one of "
                              f"{sorted(_LAYER_TYPE_ALIASES)}")
        return tuple(_LAYER_TYPE_ALIASES[n] for n in names)
    raise ConfigError("missing the layer schedule: expected linear_attn_config.full_attn_layers / "
                      "kda_layers (1-indexed) or layer_types")
