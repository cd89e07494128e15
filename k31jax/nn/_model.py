"""The K3 / K3.1 Pro causal LM: embedding, the decoder layers, final norm, head (architecture.md §4, §9).

One decoder layer (`_decoder_layer`, architecture.md §4): the Block AttnRes mix of the block
snapshots and the partial sum is the mixer's input (`_attn_res_input`); at a block boundary
the partial sum is pushed as a snapshot and restarted (`Residual.snapshot`); the input norm,
the token mixer (KDA or MLA), its output added to the partial sum; then the AttnRes mix
again, the post-attention norm, the FFN (dense or MoE), added. How the layers' stacked
weights are grouped, scanned and read is `_layer_stack.run_layers`. What every layer of one
forward call shares (graphdefs, backends, cache position, masks) is a `_Call`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from ..config import ModelConfig
from ..ops import Backends, attn_res_mix, rms_norm
from ..sharding import constrain
from ._cache import Cache, KDATrail, constrain_cache, init_cache
from ._ffn import DenseMLP, LatentMoE, MoEOutput, Routing
from ._kda_layer import KDAMixer
from ._layer_stack import Layer, LayerKind, LayerRows, LayerStacks, run_layers, stack_layers
from ._mla_layer import MLAMixer
from ._param import constant, normal

INTERMEDIATES = ("attn_in", "attn_out", "mlp_in", "mlp_out", "partial_sum", "router_idx", "router_weights",
                 "router_scores")


class LayerNorms(nnx.Module):
    """Per-layer norms and, with Block AttnRes, the two (norm, pseudo-query) pairs."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, dt = cfg.hidden_size, jnp.dtype(cfg.dtype)
        self.input_norm = constant((d,), 1.0, dt, ("norm",))
        self.post_norm = constant((d,), 1.0, dt, ("norm",))
        if cfg.use_attn_res:
            self.attn_res_norm = constant((d,), 1.0, dt, ("norm",))
            self.attn_res_proj = constant((d,), 0.0, dt, ("norm",))
            self.mlp_res_norm = constant((d,), 1.0, dt, ("norm",))
            self.mlp_res_proj = constant((d,), 0.0, dt, ("norm",))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Residual:
    """What the layers carry besides the cache (architecture.md §4): the partial sum of the
    sub-layer outputs since the last block snapshot (the spec's `prefix`; without AttnRes, the
    plain residual stream), and the snapshots, a fixed buffer of `n_blocks` valid slots so a
    push scans."""

    partial_sum: Float[Array, "B T D"]
    blocks: Float[Array, "B T N D"]
    n_blocks: Int[Array, ""]

    @classmethod
    def start(cls, cfg: ModelConfig, embeds: Array) -> "Residual":
        """Before layer 0: the partial sum is the embedding, no snapshot yet."""
        b, t, d = embeds.shape
        return cls(embeds, jnp.zeros((b, t, cfg.num_attn_res_slots, d), embeds.dtype), jnp.zeros((), jnp.int32))

    def add(self, y: Array) -> "Residual":
        total = self.partial_sum + y.astype(self.partial_sum.dtype)
        return dataclasses.replace(self, partial_sum=constrain(total, "batch", "seq", "act_embed"))

    def snapshot(self, cfg: ModelConfig, layer_number) -> "Residual":
        """At a block boundary (`layer % block_size == 0`) push the partial sum as a frozen
        snapshot and restart the sum (a traced select over the fixed buffer, so it scans)."""
        boundary = jnp.asarray(layer_number % cfg.attn_res_block_size == 0)
        pushed = jax.lax.dynamic_update_slice_in_dim(self.blocks, self.partial_sum[:, :, None], self.n_blocks, axis=2)
        return Residual(jnp.where(boundary, jnp.zeros_like(self.partial_sum), self.partial_sum),
                        jnp.where(boundary, pushed, self.blocks), self.n_blocks + boundary.astype(jnp.int32))


def _attn_res_input(cfg: ModelConfig, res: Residual, norm, proj):
    """A sub-layer's input: the AttnRes mix of the block snapshots and the partial sum, or the
    plain residual stream without AttnRes."""
    if not cfg.use_attn_res:
        return res.partial_sum
    return attn_res_mix(res.blocks, res.n_blocks, res.partial_sum, norm, proj, cfg.rms_norm_eps)


@dataclasses.dataclass(frozen=True)
class _Call:
    """What every layer step of one forward call shares."""

    cfg: ModelConfig
    backends: Backends
    graphdefs: dict[str, Any]        # "kda" | "mla" | "dense" | "moe" -> the stacked module's graphdef
    valid: jax.Array | None          # [B, T] real (non-padding) new tokens
    segment_ids: jax.Array | None    # [B, T] packed documents (training; no cache)
    key_valid: jax.Array             # [B, S] valid key slots (cache buffer, or the T tokens)
    pos: jax.Array | int             # write position of the first new token
    collect: tuple[str, ...]         # per-layer intermediates to return
    trail: bool = False              # decode forms, every position's KDA state kept (verify)


def _mix_tokens(call: _Call, kind: LayerKind, layer: Layer, x, cache: Cache | None):
    """The layer's token mixer on x, continuing its cache (in the model's cache) when given."""
    mixer = nnx.merge(call.graphdefs[kind.mixer], layer.mixer)
    if kind.mla:
        mine = None if cache is None else cache.mla_layer(layer.cache_slot)
        y, mine = mixer(x, mine, pos=call.pos, key_valid=call.key_valid, backends=call.backends,
                        segment_ids=call.segment_ids, decode_form=call.trail)
        return y, None if cache is None else cache.with_mla_layer(mine)
    mine = None if cache is None else cache.kda_layer(layer.cache_slot)
    y, mine = mixer(x, mine, call.valid, backends=call.backends, segment_ids=call.segment_ids, trail=call.trail)
    return y, None if cache is None else cache.with_kda_layer(layer.cache_slot, mine)


def _feed_forward(call: _Call, kind: LayerKind, layer: Layer, x) -> MoEOutput:
    """The layer's FFN on x; the dense FFN routes nothing (zero routing, for a uniform output)."""
    ffn = nnx.merge(call.graphdefs[kind.ffn], layer.ffn)
    if kind.moe:
        return ffn(x, backends=call.backends, expert_row=layer.expert_row)
    b, t, _ = x.shape
    k = call.cfg.num_experts_per_token if call.cfg.moe_layers else 1
    return MoEOutput(ffn(x), Routing(jnp.zeros((b, t, k), jnp.int32), jnp.zeros((b, t, k), jnp.float32)))


def _router_scores(call: _Call, kind: LayerKind, layer: Layer, x):
    """The router's scores for every expert (the balance loss); zeros for a dense layer."""
    if kind.moe:
        return nnx.merge(call.graphdefs["moe"], layer.ffn).scores(x)
    return jnp.zeros(x.shape[:2] + (max(call.cfg.num_experts, 1),), jnp.float32)


def _decoder_layer(call: _Call, kind: LayerKind, rows: LayerRows, carry, stacks: LayerStacks):
    """One decoder layer of static kinds over the carry (AttnRes `Residual`, cache). Its
    weights are taken from the stacks here, inside the rematerialised step (`run_layers`)."""
    cfg, eps = call.cfg, call.cfg.rms_norm_eps
    res, cache = carry
    layer = stacks.take(rows, kind)
    norms = layer.norms
    attn_in = _attn_res_input(cfg, res, norms.get("attn_res_norm"), norms.get("attn_res_proj"))
    if cfg.use_attn_res:
        res = res.snapshot(cfg, layer.number)  # after the mixer's input mix (architecture.md §4)
    attn_out, cache = _mix_tokens(call, kind, layer, rms_norm(attn_in, norms["input_norm"], eps), cache)
    res, cache = res.add(attn_out), constrain_cache(cache)
    mlp_in = _attn_res_input(cfg, res, norms.get("mlp_res_norm"), norms.get("mlp_res_proj"))
    ffn_in = rms_norm(mlp_in, norms["post_norm"], eps)
    ffn = _feed_forward(call, kind, layer, ffn_in)
    res = res.add(ffn.output)
    if cfg.use_attn_res:
        res = dataclasses.replace(res, blocks=constrain(res.blocks, "batch", "seq", None, "act_embed"))
    seen = dict(attn_in=attn_in, attn_out=attn_out, mlp_in=mlp_in, mlp_out=ffn.output, partial_sum=res.partial_sum,
                router_idx=ffn.routing.experts, router_weights=ffn.routing.weights)
    if "router_scores" in call.collect:
        seen["router_scores"] = _router_scores(call, kind, layer, ffn_in)
    return (res, cache), {name: seen[name] for name in call.collect}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HiddenOutput:
    """What `K31ForCausalLM.hidden_states` returns.

    hidden         `[B, T, D]` final normalised hidden states (the head's input).
    cache          the continued cache (None without one).
    intermediates  the per-layer activations asked for (`collect`), each stacked on a
                   leading layer axis, plus `embed` and `final_attn_res`; empty when none.
    """

    hidden: Float[Array, "B T D"]
    cache: Cache | None
    intermediates: dict[str, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """What `K31ForCausalLM.__call__` returns.

    logits         `[B, T, V]` fp32.
    cache          the continued cache (None without one).
    intermediates  with `return_intermediates`, every name of `INTERMEDIATES` plus `embed`,
                   `final_attn_res` and `final_hidden`; empty otherwise.
    """

    logits: Float[Array, "B T V"]
    cache: Cache | None
    intermediates: dict[str, jax.Array]


def _check_inputs(cfg: ModelConfig, tokens, cache, segment_ids, collect, embeds) -> None:
    unknown = set(collect) - set(INTERMEDIATES)
    if unknown:
        raise ValueError(f"collect={sorted(unknown)}: expected names from {INTERMEDIATES}")
    if segment_ids is not None and cache is not None:
        raise ValueError("segment_ids (packed training rows) cannot continue a cache")
    b, t = tokens.shape
    if embeds is not None and embeds.shape != (b, t, cfg.hidden_size):
        raise ValueError(f"embeds {tuple(embeds.shape)} do not match tokens {(b, t)}: expected "
                         f"[B, T, hidden_size={cfg.hidden_size}]")


class K31ForCausalLM(nnx.Module):
    """Kimi K3 / K3.1 Pro text model (and the Kimi Linear family, through config switches).

    `model(tokens, cache=None) -> ModelOutput(logits fp32 [B, T, V], cache, intermediates)`.
    Create a cache with `model.init_cache(batch, max_len)`, prefill any number of tokens, then
    decode.
    Training uses `hidden_states` (the final normalised hidden states, so the loss can stream
    the vocabulary) with packed rows (`segment_ids`) and a rematerialisation policy.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        cfg = self.config = config
        d, v, dt = cfg.hidden_size, cfg.vocab_size, jnp.dtype(cfg.dtype)
        self.embed = normal(rngs, (v, d), cfg.initializer_range, dt, ("vocab", "embed"))
        self.norms = stack_layers(cfg.num_hidden_layers, lambda r: LayerNorms(cfg, rngs=r), rngs)
        self.kda = stack_layers(len(cfg.kda_layers), lambda r: KDAMixer(cfg, rngs=r), rngs)
        self.mla = stack_layers(len(cfg.mla_layers), lambda r: MLAMixer(cfg, rngs=r), rngs)
        self.dense = stack_layers(len(cfg.dense_layers), lambda r: DenseMLP(cfg, cfg.intermediate_size, rngs=r), rngs)
        self.moe = stack_layers(len(cfg.moe_layers), lambda r: LatentMoE(cfg, rngs=r), rngs)
        self.final_norm = constant((d,), 1.0, dt, ("norm",))
        if cfg.use_attn_res:
            self.out_res_norm = constant((d,), 1.0, dt, ("norm",))
            self.out_res_proj = constant((d,), 0.0, dt, ("norm",))
        self.lm_head = normal(rngs, (d, v), cfg.initializer_range, dt, ("embed", "vocab"))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        return init_cache(self.config, batch, max_len, dtype)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The token embeddings `[B, T, D]` in the activation dtype (what `embeds` replaces)."""
        return jnp.take(self.embed[...], tokens, axis=0).astype(jnp.dtype(self.config.dtype))

    def hidden_states(
        self,
        tokens: jax.Array,
        cache: Cache | None = None,
        *,
        valid: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        backends: Backends | None = None,
        scan_layers: bool = True,
        remat: str = "none",
        collect: tuple[str, ...] = (),
        embeds: jax.Array | None = None,
        trail: bool = False,
    ) -> HiddenOutput:
        """`tokens [B, T]` -> `HiddenOutput` (final normalised hidden states `[B, T, D]`, cache,
        the per-layer intermediates named in `collect` (see `INTERMEDIATES`)).

        embeds `[B, T, D]`, if given, is the layer stack's input instead of `embed_tokens(tokens)`
        (image prompts: the token embeddings with projected image rows spliced in; AttnRes
        snapshot 0 is then this mixed embedding, vision.md §3).

        valid `[B, T]` marks real tokens (False for left padding); padded positions change no
        other token's result. segment_ids `[B, T]` (training, no cache) marks the documents
        of packed rows (1, 2, ... contiguous; 0 = padding): no mixer reads across them.
        backends: the implementation of every hot path (`k31jax.ops.Backends`; default
        `Backends()`). remat: "none" | "full" | "dots" per layer (`REMAT_POLICIES`).
        Under a mesh (`k31jax.sharding.activate`), activations are constrained to their
        logical shardings at layer boundaries; without one that is a no-op.
        trail (with a cache; a speculative verify step): the mixers run their decode forms over
        the T tokens, as T decode steps would, and the returned cache keeps the KDA state after
        each token (`Cache.kda_trail`) for `Cache.rollback`.
        """
        cfg = self.config
        _check_inputs(cfg, tokens, cache, segment_ids, collect, embeds)
        if trail and cache is None:
            raise ValueError("trail=True keeps the KDA state of each new token of a cache; no cache was given")
        b, t = tokens.shape
        act = jnp.dtype(cfg.dtype)
        embeds = self.embed_tokens(tokens) if embeds is None else embeds
        x0 = constrain(embeds.astype(act), "batch", "seq", "act_embed")
        new_valid = jnp.ones((b, t), bool) if valid is None else valid
        if cache is None:
            pos, key_valid = 0, new_valid
        else:  # the new tokens' key slots are valid for the whole call
            pos = cache.pos
            key_valid = jax.lax.dynamic_update_slice_in_dim(cache.key_valid, new_valid, pos, axis=1)
            cache = cache.replace(key_valid=key_valid)
            if trail and cache.kda_state is not None:
                cache = cache.replace(kda_trail=KDATrail.zeros(cache, t))
        graphdefs, stacks = self._layer_stacks()
        call = _Call(cfg, backends or Backends(), graphdefs, valid=valid, segment_ids=segment_ids,
                     key_valid=key_valid, pos=pos, collect=tuple(collect), trail=trail)
        res = Residual.start(cfg, x0)
        (res, cache), per_layer = run_layers(functools.partial(_decoder_layer, call), (res, cache), stacks, cfg,
                                             scan_layers=scan_layers, remat=remat, cached=cache is not None)
        out_norm, out_proj = (self.out_res_norm[...], self.out_res_proj[...]) if cfg.use_attn_res else (None, None)
        h = _attn_res_input(cfg, res, out_norm, out_proj)
        final = rms_norm(h, self.final_norm[...], cfg.rms_norm_eps)
        if cache is not None:
            cache = constrain_cache(cache.replace(pos=cache.pos + t))
        if collect:
            per_layer = dict(per_layer, embed=x0, final_attn_res=h)
        return HiddenOutput(final, cache, per_layer)

    def _layer_stacks(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(graphdef, state) of each layer kind's stack; the norms as a pure dict."""
        graphdefs, stacks = {}, {"norms": nnx.to_pure_dict(nnx.state(self.norms))}
        for kind in ("kda", "mla", "dense", "moe"):
            if getattr(self, kind) is not None:
                graphdefs[kind], stacks[kind] = nnx.split(getattr(self, kind))
        return graphdefs, stacks

    def logits(self, hidden: jax.Array) -> jax.Array:
        """fp32 logits `[B, T, V]` of final hidden states."""
        return constrain(jnp.dot(hidden, self.lm_head[...], preferred_element_type=jnp.float32),
                         "batch", "seq", "act_vocab")

    def __call__(
        self,
        tokens: jax.Array,
        cache: Cache | None = None,
        *,
        valid: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        backends: Backends | None = None,
        scan_layers: bool = True,
        return_intermediates: bool = False,
        embeds: jax.Array | None = None,
        trail: bool = False,
    ) -> ModelOutput:
        """Run `tokens [B, T]`, continuing `cache` when given -> `ModelOutput(logits, cache,
        intermediates)`.

        Arguments as in `hidden_states`. With `return_intermediates`, `intermediates` holds
        every per-layer activation of `INTERMEDIATES` plus `embed`, `final_attn_res` and
        `final_hidden`.
        """
        collect = INTERMEDIATES if return_intermediates else ()
        out = self.hidden_states(tokens, cache, valid=valid, segment_ids=segment_ids, backends=backends,
                                 scan_layers=scan_layers, collect=collect, embeds=embeds, trail=trail)
        intermediates = dict(out.intermediates, final_hidden=out.hidden) if return_intermediates else {}
        return ModelOutput(self.logits(out.hidden), out.cache, intermediates)


def abstract_model(config: ModelConfig) -> K31ForCausalLM:
    """The model with ShapeDtypeStruct leaves: nothing is allocated (`nnx.eval_shape`)."""
    return nnx.eval_shape(lambda: K31ForCausalLM(config, rngs=nnx.Rngs(0)))


def reconfigure(model: K31ForCausalLM, **changes) -> K31ForCausalLM:
    """The same parameter arrays (shared, not copied) under the config with `changes`, which must
    be settings that leave every parameter's shape and dtype as it is: the indexer's top-k,
    `expert_activations="mxfp8"` (the routed experts' GEMM inputs rounded to MXFP8 at
    inference, as K3.1 is deployed), the QAT switches. A change of shapes is refused."""
    config = model.config.replace(**changes)
    if config == model.config:
        return model
    graphdef, target = nnx.split(abstract_model(config))
    state = nnx.state(model)
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), nnx.to_pure_dict(tree))  # noqa: E731
    if shapes(state) != shapes(target):
        raise ValueError(f"reconfigure({', '.join(f'{k}={v!r}' for k, v in changes.items())}) changes parameter "
                         "shapes or dtypes: load the model under that config instead")
    return nnx.merge(graphdef, state)
