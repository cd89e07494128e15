"""What a model config is: the frozen `ModelConfig` (the text model) and `VisionConfig` (the
vision tower and projector), their derived quantities, and the checks every instance passes.

`ModelConfig.from_hf(path_or_dict)` reads a release / transformers `config.json` (the key
parsing is `_hf_config`'s); `ModelConfig.preset(name)` loads a named preset from `configs/`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from ._fields import ConfigError, LayerType, check_field_types
from ._hf_config import model_fields, read_config_json, vision_config_json, vision_fields
from ._presets import preset_path


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
    def from_hf(cls, vision_config: dict, *, media_placeholder_token_id: int | None = None) -> "VisionConfig":
        """From a release `vision_config` object; a key with an unsupported value is an error
        (unknown keys are `ModelConfig.from_hf`'s check)."""
        return cls(**vision_fields(vision_config, media_placeholder_token_id=media_placeholder_token_id))

    def to_hf(self) -> dict:
        """The `vision_config` object (`from_hf` of it gives this config back)."""
        return vision_config_json(dataclasses.asdict(self))


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
    # LoRA on packed routed experts (k31jax's, no release field): rank > 0 gives every packed
    # expert weight low-rank factors applied beside it, unmerged (`W x + a (b x)`), so the
    # packed bytes stay as shipped. Requires expert_weights="mxfp4" (float experts merge).
    expert_adapter_rank: int = 0
    # The vision tower and projector (None: a text-only checkpoint).
    vision: VisionConfig | None = None

    def __post_init__(self):
        if isinstance(self.vision, dict):  # from `from_hf`, dataclasses.asdict or JSON
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
        if self.expert_adapter_rank and self.expert_weights != "mxfp4":
            fail("expert_adapter_rank", f"{self.expert_adapter_rank}: adapters beside the experts are for packed "
                 "MXFP4 experts (expert_weights='mxfp4'); LoRA merges into float experts")
        if self.expert_weights == "mxfp4" and self.moe_layers and (
                self.moe_intermediate_size % 32 or self.expert_in_dim % 32):
            fail("expert_weights", f"mxfp4 needs expert widths divisible by 32, got "
                 f"moe_intermediate_size={self.moe_intermediate_size}, expert input={self.expert_in_dim}")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            fail("dtype", f"{self.dtype!r}, expected 'bfloat16', 'float32' or 'float16'")

    def _check_types(self) -> None:
        """Every field's type and sane range, before any check that computes with them."""
        try:
            check_field_types(self)
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
        where, raw = read_config_json(source)
        try:
            return cls(**{**model_fields(raw, allow_unknown=allow_unknown), **overrides})
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A named preset from `configs/` (`k3`, `k31_pro`, `kimi_linear_48b`, `tiny`)."""
        return cls.from_hf(preset_path(name), **overrides)
