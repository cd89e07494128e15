"""Decode caches as an explicit pytree (spec kda.md §8, attention.md §1.4, architecture.md §10.3).

Per layer kind, one stacked array per entry, indexed by the layer's slot among layers of
that kind. Block AttnRes needs no persistent state: every step rebuilds its snapshots.
Every leaf names its logical axes (`CACHE_AXES`), as every parameter does.

A mixer takes and returns its own layer's cache: `KDALayerCache` (that layer's rows) and
`MLALayerCache` (the whole MLA stacks plus the layer's row index, so the mixer writes its new
latents into the stacks in place; see `MLAMixer`).
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
    "mla_kpe": ("layers", "batch", "cache_seq", None),          # [Lm, B, S, dr padded to KPE_LANES]
    "index_keys": ("layers", "batch", "cache_seq", None),       # [Lm, B, S, dI]
    "key_valid": ("batch", "cache_seq"),                        # [B, S]
    "pos": (),                                                  # []
}
# A verify call's `KDATrail` (speculative decoding): each new position's KDA state.
TRAIL_AXES: dict[str, tuple[str | None, ...]] = {
    "state": ("layers", "batch", None, "act_heads", None, None),  # [Lk, B, T, H, dk, dv] fp32
    "conv": ("layers", "batch", None, None, "act_heads", None),   # [Lk, B, T, 3, H·dk, K-1] fp32
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDATrail:
    """The KDA state after each of a call's T new tokens (`K31ForCausalLM(trail=True)`): what a
    speculative verify step rolls back to once it knows how many of its tokens a row keeps
    (`Cache.rollback`). A recurrent state cannot be truncated; keeping every position's costs
    T times the KDA state for the length of one call (docs/speculative.md §4).

    state  `[Lk, B, T, H, dk, dv]` fp32: the recurrent state after new token t.
    conv   `[Lk, B, T, 3, H·dk, K-1]` fp32: the conv window after new token t.
    """

    state: Float[Array, "Lk B T H dk dv"]
    conv: Float[Array, "Lk B T 3 C Km1"]

    @classmethod
    def zeros(cls, cache: "Cache", t: int) -> "KDATrail":
        s, c = cache.kda_state, cache.kda_conv
        return cls(jnp.zeros(s.shape[:2] + (t,) + s.shape[2:], s.dtype),
                   jnp.zeros(c.shape[:2] + (t,) + c.shape[2:], c.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cache:
    """State carried between `model(tokens, cache)` calls.

    kda_state   `[n_kda, B, H, dk, dv]` fp32, key-major recurrent state.
    kda_conv    `[n_kda, B, 3, H·dk, K-1]` fp32, last K-1 pre-conv q/k/v inputs, oldest first.
    mla_ckv     `[n_mla, B, S, kv_lora_rank]` post-norm latent, activation dtype.
    mla_kpe     `[n_mla, B, S, kpe_width(cfg)]` raw k_pe in the first qk_rope_head_dim lanes,
                zeros after (`kpe_width`).
    index_keys  `[n_mla, B, S, index_head_dim]` indexer keys (None without the indexer).
    key_valid   `[B, S]` slots holding real (written, non-padding) tokens.
    pos         `[]` int32, tokens written so far (the next write position).
    kda_trail   the KDA state after each token of the last call, kept by a call made with
                `trail=True` until `rollback` (`KDATrail`); None otherwise.
    """

    kda_state: Float[Array, "Lk B H dk dv"] | None
    kda_conv: Float[Array, "Lk B 3 C Km1"] | None
    mla_ckv: Float[Array, "Lm B S r"] | None
    mla_kpe: Float[Array, "Lm B S dr"] | None
    index_keys: Float[Array, "Lm B S dI"] | None
    key_valid: Bool[Array, "B S"]
    pos: Int[Array, ""]
    kda_trail: KDATrail | None = None

    @property
    def max_len(self) -> int:
        return self.key_valid.shape[1]

    def replace(self, **changes) -> "Cache":
        return dataclasses.replace(self, **changes)

    def kda_layer(self, slot) -> "KDALayerCache":
        """The cache of the KDA layer at `slot` of the KDA stack."""
        return KDALayerCache(self.kda_state[slot], self.kda_conv[slot])

    def with_kda_layer(self, slot, layer: "KDALayerCache") -> "Cache":
        new = self.replace(kda_state=self.kda_state.at[slot].set(layer.state),
                           kda_conv=self.kda_conv.at[slot].set(layer.conv))
        if self.kda_trail is None:
            return new
        trail = KDATrail(self.kda_trail.state.at[slot].set(layer.state_trail),
                         self.kda_trail.conv.at[slot].set(layer.conv_trail))
        return new.replace(kda_trail=trail)

    def rollback(self, kept: Int[Array, " B"], t: int) -> "Cache":
        """After a call of `t` new tokens made with `trail=True`: row b keeps only its first
        ``kept[b]`` (1..t) of them. Its KDA state and conv window become the trail's at token
        ``kept[b] - 1``; its later tokens' MLA and indexer rows stop being valid keys (left in
        place: a gap of invalid keys, as between slots). The trail is dropped."""
        new = self
        if self.kda_trail is not None:
            at = (kept - 1)[None, :, None]

            def pick(trail):  # [Lk, B, t, ...] -> [Lk, B, ...] at each row's last kept token
                index = at.reshape(at.shape + (1,) * (trail.ndim - 3))
                return jnp.take_along_axis(trail, index, axis=2)[:, :, 0]

            new = new.replace(kda_state=pick(self.kda_trail.state), kda_conv=pick(self.kda_trail.conv),
                              kda_trail=None)
        slots = jnp.arange(self.max_len)[None, :]
        dropped = (slots >= self.pos - t + kept[:, None]) & (slots < self.pos)
        return new.replace(key_valid=self.key_valid & ~dropped)

    def mla_layer(self, slot) -> "MLALayerCache":
        """The cache of the MLA layer at `slot`: the whole stacks and the row it owns."""
        return MLALayerCache(self.mla_ckv, self.mla_kpe, self.index_keys, slot)

    def with_mla_layer(self, layer: "MLALayerCache") -> "Cache":
        return self.replace(mla_ckv=layer.ckv, mla_kpe=layer.kpe, index_keys=layer.index_keys)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDALayerCache:
    """One KDA layer's cache (kda.md §8).

    state  `[B, H, dk, dv]` fp32, key-major recurrent state.
    conv   `[B, 3, H·dk, K-1]` fp32, last K-1 pre-conv q/k/v inputs, oldest first.
    state_trail, conv_trail  the same after each new token `[B, T, ...]` (`KDATrail`), when
           the call keeps them.
    """

    state: Float[Array, "B H dk dv"]
    conv: Float[Array, "B 3 C Km1"]
    state_trail: Float[Array, "B T H dk dv"] | None = None
    conv_trail: Float[Array, "B T 3 C Km1"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLALayerCache:
    """One MLA layer's cache (attention.md §1.4). In the model: the stacks of every MLA layer
    and this layer's row in them (`layer`). Handing a layer its own rows would copy them out
    of the stacks, and writing them back copy the stacks: 3.2 GB per step on a TPU chip at
    128k tokens (`k31jax compile`); the mixer instead writes its row of the stacks in place.
    With `layer` None the arrays are the layer's own, without the leading `Lm` axis.

    ckv         `[Lm, B, S, kv_lora_rank]` post-norm latents.
    kpe         `[Lm, B, S, ≥ qk_rope_head_dim]` raw k_pe (first dr lanes; the model's cache pads
                its rows, `kpe_width`).
    index_keys  `[Lm, B, S, index_head_dim]` indexer keys (None without the indexer).
    layer       this layer's row (an int, or traced inside the scan over layers), or None.
    """

    ckv: Float[Array, "*Lm B S r"]
    kpe: Float[Array, "*Lm B S dr"]
    index_keys: Float[Array, "*Lm B S dI"] | None
    layer: Int[Array, ""] | int | None = None


KPE_LANES = 128


def kpe_width(cfg: ModelConfig) -> int:
    """Lanes of a k_pe cache row: qk_rope_head_dim rounded up to `KPE_LANES`. A TPU array's
    minor dimension is tiled in 128 lanes; a 64-wide leaf gets a sequence-minor default
    layout instead (no padding), which the gather of selected rows cannot read, so the
    compiler relaid the whole stack out and back every decode step (2 x 3.2 GB per chip at
    1M tokens, `k31jax compile`). Padded rows cost what the gather's layout costs anyway:
    64 more lanes per token (K3: 576 -> 640 per MLA row, +11%)."""
    return -(-cfg.qk_rope_head_dim // KPE_LANES) * KPE_LANES


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
        mla_kpe=zeros((nm, batch, max_len, kpe_width(cfg)), act) if nm else None,
        index_keys=zeros((nm, batch, max_len, cfg.index_head_dim), act) if nm and cfg.use_indexer else None,
        key_valid=zeros((batch, max_len), bool),
        pos=jnp.zeros((), jnp.int32),
    )


def constrain_new_rows(leaf: str, rows: jax.Array) -> jax.Array:
    """New tokens' rows `[B, T, d]` for cache leaf `leaf` (one of the MLA stacks), sharded as
    that leaf is but along the sequence (a few new tokens are not split). Writing rows sharded
    otherwise into the stacks (the latent as its projection leaves it, split over `tensor`)
    makes XLA's SPMD partitioner re-split the whole stack to match the update and all-gather
    it back: K3.1 Pro's 1M-token decode did not fit a 64-chip tpu7x slice (114 GB of
    temporaries per chip, `k31jax compile`)."""
    _, batch, _, last = CACHE_AXES[leaf]
    return constrain(rows, batch, None, last)


def constrain_cache(cache: Cache | None) -> Cache | None:
    """Pin every cache leaf to its logical sharding (no-op without a mesh)."""
    if cache is None:
        return None
    trail = cache.kda_trail
    if trail is not None:
        trail = KDATrail(**{name: constrain(getattr(trail, name), *axes) for name, axes in TRAIL_AXES.items()})
    return Cache(**{name: None if getattr(cache, name) is None else constrain(getattr(cache, name), *axes)
                    for name, axes in CACHE_AXES.items()}, kda_trail=trail)
