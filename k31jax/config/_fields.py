"""What a config field may hold: its type, its sane range, and `ConfigError`. Both `ModelConfig`
and the `config.json` reader check with these, so a bad value fails the same way whichever way
it came in."""

from __future__ import annotations

import math
from typing import Any, Literal

LayerType = Literal["kda", "mla"]


class ConfigError(ValueError):
    """A config that k31jax cannot build a model from; the message names the field."""


# Sane bounds of the integer fields (inclusive): far above any Kimi model (K3: 93 layers,
# hidden 7168, 896 experts, vocab 163,840), so only a typo or a unit mix-up fails here, and it
# fails before anything is allocated (1e9 layers would exhaust memory building the schedule).
INT_BOUNDS: dict[str, tuple[int, int]] = {
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
OPTIONAL_FIELDS = frozenset({"q_lora_rank", "index_topk", "routed_expert_hidden_size", "attn_res_block_size",
                             "bos_token_id", "eos_token_id", "pad_token_id", "activation_situ_linear_beta",
                             "kda_gate_lower_bound"})
# Float fields: finite, and (low, high, low excluded) where a range applies.
FLOAT_BOUNDS: dict[str, tuple[float | None, float | None, bool]] = {
    "rms_norm_eps": (0.0, 1.0, True), "activation_situ_beta": (0.0, None, True),
    "activation_situ_linear_beta": (0.0, None, True), "kda_gate_lower_bound": (None, None, False),
    "routed_scaling_factor": (0.0, None, True), "initializer_range": (0.0, None, False),
}
BOOL_FIELDS = ("mla_use_output_gate", "kda_full_rank_gate", "latent_moe_use_norm", "moe_renormalize",
               "tie_word_embeddings", "expert_qat")
STR_FIELDS = ("hidden_act", "moe_router_activation_func", "dtype", "expert_weights", "expert_activations")


def shown(value) -> str:
    """A value as an error message shows it: JSON's null, else its repr and type."""
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


def check_int(name: str, value, *, optional: bool = False, bounds_of: str | None = None) -> int | None:
    """`value` if it is an integer within the bounds of field `bounds_of` (default `name`;
    bool, float, str rejected), else a `ConfigError` naming `name` and what was expected."""
    if value is None and optional:
        return None
    low, high = INT_BOUNDS.get(bounds_of or name, (0, 1 << 40))
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer in [{low}, {high}]{' or null' if optional else ''}, "
                          f"got {shown(value)}")
    if not low <= value <= high:
        raise ConfigError(f"{name}: {value} is outside [{low}, {high}]")
    return value


def check_float(name: str, value, *, optional: bool = False, bounds_of: str | None = None) -> float | None:
    """`value` as a float if it is a finite number within the bounds of field `bounds_of`
    (default `name`), else a `ConfigError` (bool, str, NaN and Infinity rejected)."""
    if value is None and optional:
        return None
    low, high, low_open = FLOAT_BOUNDS.get(bounds_of or name, (None, None, False))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name}: expected a finite number{' or null' if optional else ''}, got {shown(value)}")
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"<= {high}"
        raise ConfigError(f"{name}: {value} is out of range (expected {' and '.join(x for x in (lo, hi) if x)})")
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {shown(value)}")
    return value


def check_field_types(config: Any) -> None:
    """Every typed field of a `ModelConfig` (read as attributes of `config`): its type and
    sane range, before any check that computes with them."""
    for name in INT_BOUNDS:
        check_int(name, getattr(config, name), optional=name in OPTIONAL_FIELDS)
    for name in FLOAT_BOUNDS:
        check_float(name, getattr(config, name), optional=name in OPTIONAL_FIELDS)
    for name in BOOL_FIELDS:
        check_bool(name, getattr(config, name))
    for name in STR_FIELDS:
        if not isinstance(getattr(config, name), str):
            raise ConfigError(f"{name}: expected a string, got {shown(getattr(config, name))}")
    if not isinstance(config.layer_types, (tuple, list)):
        raise ConfigError(f"layer_types: expected a sequence of 'kda' / 'mla', got {shown(config.layer_types)}")
