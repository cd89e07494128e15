"""Decode caches as an explicit pytree (spec kda.md §8, attention.md §1.4, architecture.md §10.3).

Per layer kind, one stacked array per entry, indexed by the layer's slot among layers of
that kind. Block AttnRes needs no persistent state: every step rebuilds its snapshots.
Every leaf names its logical axes (`CACHE_AXES`), as every parameter does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..config import ModelConfig
from ..sharding import constrain

# Logical axes of every cache leaf, resolved on a mesh by the rule tables of `k31jax.sharding`.
CACHE_AXES: dict[str, tuple[str | None, ...]] = {
    "kda_state": ("layers", "batch", "act_heads", None, None),  # [Lk, B, H, dk, dv] fp32
    "kda_conv": ("layers", "batch", None, "act_heads", None),   # [Lk, B, 3, H·dk, K-1] fp32
    "mla_ckv": ("layers", "batch", "cache_seq", "kv_lora"),     # [Lm, B, S, r]
    "mla_kpe": ("layers", "batch", "cache_seq", None),          # [Lm, B, S, dr]
    "index_keys": ("layers", "batch", "cache_seq", None),       # [Lm, B, S, dI]
    "key_valid": ("batch", "cache_seq"),                        # [B, S]
    "pos": (),                                                  # []
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cache:
    """State carried between `model(tokens, cache)` calls.

    kda_state   `[n_kda, B, H, dk, dv]` fp32, key-major recurrent state.
    kda_conv    `[n_kda, B, 3, H·dk, K-1]` fp32, last K-1 pre-conv q/k/v inputs, oldest first.
    mla_ckv     `[n_mla, B, S, kv_lora_rank]` post-norm latent, activation dtype.
    mla_kpe     `[n_mla, B, S, qk_rope_head_dim]` raw k_pe.
    index_keys  `[n_mla, B, S, index_head_dim]` indexer keys (None without the indexer).
    key_valid   `[B, S]` slots holding real (written, non-padding) tokens.
    pos         `[]` int32, tokens written so far (the next write position).
    """

    kda_state: Float[Array, "Lk B H dk dv"] | None
    kda_conv: Float[Array, "Lk B 3 C Km1"] | None
    mla_ckv: Float[Array, "Lm B S r"] | None
    mla_kpe: Float[Array, "Lm B S dr"] | None
    index_keys: Float[Array, "Lm B S dI"] | None
    key_valid: Bool[Array, "B S"]
    pos: Int[Array, ""]

    @property
    def max_len(self) -> int:
        return self.key_valid.shape[1]

    def replace(self, **changes) -> "Cache":
        return dataclasses.replace(self, **changes)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> Cache:
    """Zeroed caches for `batch` sequences of up to `max_len` tokens."""
    act = jnp.dtype(dtype or cfg.dtype)
    nk, nm = len(cfg.kda_layers), len(cfg.mla_layers)
    c = cfg.kda_num_heads * cfg.kda_head_dim
    zeros = jnp.zeros
    return Cache(
        kda_state=zeros((nk, batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32) if nk else None,
        kda_conv=zeros((nk, batch, 3, c, cfg.kda_conv_size - 1), jnp.float32) if nk else None,
        mla_ckv=zeros((nm, batch, max_len, cfg.kv_lora_rank), act) if nm else None,
        mla_kpe=zeros((nm, batch, max_len, cfg.qk_rope_head_dim), act) if nm else None,
        index_keys=zeros((nm, batch, max_len, cfg.index_head_dim), act) if nm and cfg.use_indexer else None,
        key_valid=zeros((batch, max_len), bool),
        pos=jnp.zeros((), jnp.int32),
    )


def constrain_cache(cache: Cache | None) -> Cache | None:
    """Pin every cache leaf to its logical sharding (no-op without a mesh)."""
    if cache is None:
        return None
    return Cache(**{name: None if getattr(cache, name) is None else constrain(getattr(cache, name), *axes)
                    for name, axes in CACHE_AXES.items()})
