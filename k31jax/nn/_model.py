"""The K3 / K3.1 Pro / Kimi Linear causal LM: embedding, the layer stack, head.

Layers of one kind are stacked (`[n, ...]` parameters with a leading "layers" axis). The
stack runs as one `lax.scan` over its repeated groups of layer kinds (`layer_groups`: for K3,
22 groups of four layers from layer 1), with the few layers outside the repeats unrolled, so compile
time does not grow with depth and every layer's kinds are static. `scan_layers=False` unrolls
every layer (for tests and debugging); both give identical numbers.

XLA:CPU copies every row it takes from a stack (a static slice of an unrolled layer or the
dynamic slice of a scan step) before a matmul reads it. An inference program that reads each
weight once therefore takes the stacks split into rows (`unstack_layers`, what the engine
does on CPU): a stack that holds a tuple of per-layer arrays is indexed without a copy, and
the whole stack runs unrolled.

One layer, top to bottom (`_layer_step`): AttnRes mix of the block snapshots and the partial
sum (`_attn_res_input`), the token mixer (`_kda_step` / `_mla_step`), the FFN (`_dense_step`
/ `_moe_step`), each added to the running partial sum. The step functions are module-level;
what they share per call (graphdefs, backends, cache position, masks) is a `_Call`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..ops import Backends, attn_res_mix, rms_norm
from ..quant import words_view
from ..sharding import constrain
from ._cache import Cache, constrain_cache, init_cache
from ._ffn import DenseMLP, LatentMoE
from ._kda_layer import KDAMixer
from ._mla_layer import MLAMixer
from ._param import constant, normal


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


def _stack(n: int, make, rngs: nnx.Rngs):
    """`n` copies of `make(rngs)` with stacked parameters (leading "layers" axis)."""
    if n == 0:
        return None

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(r):
        return make(r)

    return build(rngs)


def _schedule(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Static per-layer tables: kind flags and each layer's slot within its kind's stack."""
    kinds = np.array([t == "mla" for t in cfg.layer_types])
    moe = np.array([cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)])
    return dict(
        index=np.arange(cfg.num_hidden_layers, dtype=np.int32),
        is_mla=kinds,
        mixer_slot=np.where(kinds, np.cumsum(kinds) - 1, np.cumsum(~kinds) - 1).astype(np.int32),
        is_moe=moe,
        ffn_slot=np.where(moe, np.cumsum(moe) - 1, np.cumsum(~moe) - 1).astype(np.int32),
    )


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """The scanned part of the stack: `count` repeats of the same `period` layer kinds from
    layer `start`; the layers before and after it run unrolled."""

    start: int
    period: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.count


MAX_PERIOD = 12


def layer_groups(cfg: ModelConfig) -> LayerGroups:
    """The run of repeated layer groups that leaves the fewest layer bodies to compile
    (unrolled layers + one group), ties going to the shorter period.

    K3 (MLA at 3, 7, ..., 91 and 92, a dense layer 0) scans 22 groups of 4 layers from layer 1
    and unrolls 5. Scanning groups whose kinds are static, rather than single
    layers that switch kind with `lax.cond`, is what keeps the scan's step time near the
    unrolled stack's: a `cond` keeps both branches' residuals for the backward pass, and a
    layer that indexes a closed-over parameter stack accumulates a full-stack gradient per
    layer, where the group's parameters are the scan's inputs (their gradients its outputs)."""
    kinds = list(zip(cfg.layer_types, (cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))))
    n_layers = len(kinds)
    best = LayerGroups(0, 1, 0)
    best_cost = n_layers
    for period in range(1, min(MAX_PERIOD, n_layers // 2) + 1):
        for start in range(n_layers - 2 * period + 1):
            group = kinds[start:start + period]
            count = 1
            while kinds[start + count * period:start + (count + 1) * period] == group:
                count += 1
            cost = n_layers - count * period + period
            if count >= 2 and cost < best_cost:
                best, best_cost = LayerGroups(start, period, count), cost
    return best


REMAT_POLICIES = ("none", "full", "dots")
INTERMEDIATES = ("attn_in", "attn_out", "mlp_in", "mlp_out", "prefix", "router_idx", "router_weights",
                 "router_scores")


def _remat(step, policy: str):
    """The layer step under a rematerialisation policy: "none" (save every activation),
    "full" (save nothing: recompute the layer in the backward pass), "dots" (save only the
    matmul outputs without batch dimensions, recompute the elementwise work)."""
    if policy == "none":
        return step
    if policy == "full":
        return jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable)
    if policy == "dots":
        return jax.checkpoint(step, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    raise ValueError(f"remat={policy!r}: expected one of {REMAT_POLICIES}")


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


def _kda_step(call: _Call, mixer, slot, x, cache: Cache | None):
    state = None if cache is None else cache.kda_state[slot]
    conv = None if cache is None else cache.kda_conv[slot]
    y, state, conv = mixer(x, state, conv, call.valid, backends=call.backends, segment_ids=call.segment_ids)
    if cache is not None:
        cache = cache.replace(kda_state=cache.kda_state.at[slot].set(state),
                              kda_conv=cache.kda_conv.at[slot].set(conv))
    return y, cache


def _mla_step(call: _Call, mixer, slot, x, cache: Cache | None):
    if cache is None:
        y, *_ = mixer(x, key_valid=call.key_valid, backends=call.backends, segment_ids=call.segment_ids)
        return y, cache
    # the whole stacks, updated in place at this layer's row (`MLAMixer(layer=)`)
    y, ckv, kpe, index_keys = mixer(x, cache.mla_ckv, cache.mla_kpe, cache.index_keys, pos=call.pos,
                                    key_valid=call.key_valid, backends=call.backends, layer=slot)
    return y, cache.replace(mla_ckv=ckv, mla_kpe=kpe, index_keys=index_keys)


def _dense_step(call: _Call, ffn, x):
    b, t, _ = x.shape
    k = call.cfg.num_experts_per_token if call.cfg.moe_layers else 1
    route = dict(router_idx=jnp.zeros((b, t, k), jnp.int32), router_weights=jnp.zeros((b, t, k), jnp.float32))
    if "router_scores" in call.collect:
        route["router_scores"] = jnp.zeros((b, t, max(call.cfg.num_experts, 1)), jnp.float32)
    return ffn(x), route


def _moe_step(call: _Call, moe, x, expert_row=None):
    y, idx, weights = moe(x, backends=call.backends, expert_row=expert_row)
    route = dict(router_idx=idx, router_weights=weights)
    if "router_scores" in call.collect:
        route["router_scores"] = moe.scores(x)
    return y, route


def _attn_res_input(cfg: ModelConfig, norm, proj, blocks, n_blocks, prefix):
    """A sub-layer's input: the AttnRes mix of the block snapshots and the partial sum, or the
    plain residual stream without AttnRes."""
    if not cfg.use_attn_res:
        return prefix
    return attn_res_mix(blocks, n_blocks, prefix, norm, proj, cfg.rms_norm_eps)


def _snapshot(cfg: ModelConfig, layer_index, blocks, n_blocks, prefix):
    """At a block boundary (`layer % block_size == 0`) push the partial sum as a frozen block
    snapshot and restart the sum (a traced select over a fixed buffer, so it scans)."""
    snap = jnp.asarray(layer_index % cfg.attn_res_block_size == 0)
    pushed = jax.lax.dynamic_update_slice_in_dim(blocks, prefix[:, :, None], n_blocks, axis=2)
    blocks = jnp.where(snap, pushed, blocks)
    return blocks, n_blocks + snap.astype(jnp.int32), jnp.where(snap, jnp.zeros_like(prefix), prefix)


LAYER_STACKS = ("norms", "kda", "mla", "dense", "moe")


def _is_rows(a) -> bool:
    return isinstance(a, tuple)


def _take_row(stack, row):
    """Row `row` of every leaf of a stacked state: an index into a stacked array, or the
    element of a leaf already split into rows (`unstack_layers`; `row` is then static)."""
    return jax.tree.map(lambda a: a[row], stack, is_leaf=_is_rows)


ROUTED_EXPERTS = ("w_gate", "w_up", "w_down")


def _take_ffn_row(stack, row, is_moe: bool):
    """`_take_row` of an FFN stack, except packed routed experts held as stacked arrays: those
    stay whole, and the MoE reads its experts at `[row, e]` from them (`LatentMoE(expert_row=)`),
    so no layer's experts are copied out of the stack (returns (state, expert_row or None))."""
    keep = [name for name in ROUTED_EXPERTS if is_moe and isinstance(stack.get(name), nnx.State)
            and "packed" in stack[name] and not _is_rows(stack[name]["packed"].get_value())]
    if not keep:
        return _take_row(stack, row), None
    rest = nnx.State({k: v for k, v in stack.items() if k not in keep})
    return nnx.State({**_take_row(rest, row), **{k: stack[k] for k in keep}}), row


def _holds_rows(states: dict) -> bool:
    return any(_is_rows(a) for a in jax.tree.leaves(states["norms"], is_leaf=_is_rows))


def unstack_layers(state: nnx.State) -> nnx.State:
    """The model state with every layer stack's array `[n, ...]` replaced by the tuple of its
    n rows (new arrays: one copy of the layer weights, made once).

    `nnx.merge(graphdef, unstack_layers(state))` runs like the model with every layer unrolled
    (scan_layers is ignored) and reads each layer's weights where they lie: on XLA:CPU a
    matmul on a row of a stack reads a fresh copy of that row, three times the bytes of the
    weight in every call (benchmarks/RESULTS.md "## scan" and "## generate"). Inference only:
    the training step differentiates the stacked state.
    """
    def split(a):
        return a if _is_rows(a) else tuple(a[i] for i in range(a.shape[0]))

    return nnx.State({key: jax.tree.map(split, sub, is_leaf=_is_rows) if key in LAYER_STACKS else sub
                      for key, sub in state.items()})


def expert_words(state: nnx.State) -> nnx.State:
    """The model state with the packed routed experts' codes held as uint32 words `[..., n/4]`
    (the same bytes, `MXFP4Weight`): the accelerator inference layout. XLA:TPU retiles a uint8
    stack that a loop reads, one copy of every layer's experts per call; words it reads in
    place. Leaves may be arrays or ShapeDtypeStructs (ahead-of-time compilation); shardings
    are kept (the words split where the bytes did, when the split divides them)."""
    def words(a):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape[:-1] + (a.shape[-1] // 4,), jnp.uint32, sharding=a.sharding)
        out = words_view(a)
        return jax.device_put(out, a.sharding) if isinstance(a, jax.Array) else out

    if "moe" not in state:
        return state
    moe = dict(state["moe"])
    for name in ROUTED_EXPERTS:
        w = moe.get(name)
        if isinstance(w, nnx.State) and "packed" in w and w["packed"].get_value().dtype == jnp.uint8:
            w = nnx.State(dict(w))
            w["packed"] = w["packed"].replace(words(w["packed"].get_value()))
            moe[name] = w
    return nnx.State({**state, "moe": nnx.State(moe)})


def _layer_step(call: _Call, is_mla: bool, is_moe: bool, at: tuple[int, int, int], carry, source):
    """One decoder layer of static kinds over the carry (partial sum, block snapshots, their
    count, cache). `source` holds stacks: "index" / "mixer_slot" / "norms" (row `at[0]`), the
    mixer kind's parameter state (row `at[1]`) and the FFN kind's (row `at[2]`). The rows are
    taken here, inside the rematerialised step, so remat saves no copy of a layer's weights:
    the stacks it saves are the step's inputs (the scan's own inputs, or the model's)."""
    cfg = call.cfg
    act = jnp.dtype(cfg.dtype)
    prefix, blocks, n_blocks, cache = carry
    layer, mixer_row, ffn_row = at
    ffn_state, expert_row = _take_ffn_row(source["ffn"], ffn_row, is_moe)
    row = dict(index=source["index"][layer], mixer_slot=source["mixer_slot"][layer],
               norms=_take_row(source["norms"], layer), mixer=_take_row(source["mixer"], mixer_row),
               ffn=ffn_state)
    norms = row["norms"]
    attn_in = _attn_res_input(cfg, norms.get("attn_res_norm"), norms.get("attn_res_proj"), blocks, n_blocks, prefix)
    if cfg.use_attn_res:
        blocks, n_blocks, prefix = _snapshot(cfg, row["index"], blocks, n_blocks, prefix)
    mixer = nnx.merge(call.graphdefs["mla" if is_mla else "kda"], row["mixer"])
    attn_out, cache = (_mla_step if is_mla else _kda_step)(
        call, mixer, row["mixer_slot"], rms_norm(attn_in, norms["input_norm"], cfg.rms_norm_eps), cache)
    prefix = constrain(prefix + attn_out.astype(act), "batch", "seq", "act_embed")
    cache = constrain_cache(cache)
    mlp_in = _attn_res_input(cfg, norms.get("mlp_res_norm"), norms.get("mlp_res_proj"), blocks, n_blocks, prefix)
    ffn = nnx.merge(call.graphdefs["moe" if is_moe else "dense"], row["ffn"])
    ffn_in = rms_norm(mlp_in, norms["post_norm"], cfg.rms_norm_eps)
    mlp_out, route = _moe_step(call, ffn, ffn_in, expert_row) if is_moe else _dense_step(call, ffn, ffn_in)
    prefix = constrain(prefix + mlp_out.astype(act), "batch", "seq", "act_embed")
    if cfg.use_attn_res:
        blocks = constrain(blocks, "batch", "seq", None, "act_embed")
    seen = dict(attn_in=attn_in, attn_out=attn_out, mlp_in=mlp_in, mlp_out=mlp_out, prefix=prefix, **route)
    return (prefix, blocks, n_blocks, cache), {k: seen[k] for k in call.collect}


def _run_layers(call: _Call, carry, states: dict, *, scan_layers: bool, remat: str):
    """All layers over the carry. `states`: "norms" and each kind's stacked parameter state.

    With `scan_layers`, the repeated layer groups (`layer_groups`) run as one `lax.scan` whose
    inputs are each group's slices of the stacks, and the layers around them unrolled;
    without, or when the stacks are split into rows (`unstack_layers`), every layer is
    unrolled. All give identical numbers."""
    cfg = call.cfg
    sched = _schedule(cfg)
    groups = layer_groups(cfg) if scan_layers and not _holds_rows(states) else LayerGroups(0, 1, 0)

    def kinds(i):
        mixer = "mla" if sched["is_mla"][i] else "kda"
        ffn = "moe" if sched["is_moe"][i] else "dense"
        return mixer, ffn

    def step(i, at):
        mixer, ffn = kinds(i)
        return _remat(functools.partial(_layer_step, call, mixer == "mla", ffn == "moe", at), remat)

    layer_tables = dict(index=jnp.asarray(sched["index"]), mixer_slot=jnp.asarray(sched["mixer_slot"]))

    def unrolled(carry, layers):
        outs = []
        for i in layers:
            mixer, ffn = kinds(i)
            source = dict(layer_tables, norms=states["norms"], mixer=states[mixer], ffn=states[ffn])
            at = (i, int(sched["mixer_slot"][i]), int(sched["ffn_slot"][i]))
            carry, out = step(i, at)(carry, source)
            outs.append(out)
        return carry, jax.tree.map(lambda *a: jnp.stack(a), *outs) if outs and call.collect else None

    carry, before = unrolled(carry, range(groups.start))
    scanned = None
    if groups.count:
        first, period, count = groups.start, groups.period, groups.count
        layer_ids = np.arange(first, groups.stop)
        group_kinds = [kinds(i) for i in range(first, first + period)]
        xs = dict(index=jnp.asarray(layer_ids.reshape(count, period)),
                  mixer_slot=jnp.asarray(sched["mixer_slot"][layer_ids].reshape(count, period)),
                  norms=jax.tree.map(lambda a: a[first:groups.stop].reshape(count, period, *a.shape[1:]),
                                     states["norms"]))
        # Weights reach the scanned layers in one of two ways. Without remat, as scan inputs:
        # each group's slice of every stack, so their gradients are the scan's outputs (a layer
        # that indexes a closed-over stack instead adds a full-stack gradient per step); the
        # sliced copy costs nothing extra there, since the backward pass keeps every layer's
        # weights anyway. Under remat, indexed from the closed-over stacks: the scan inputs
        # would be a copy of the weights kept through the backward pass. With a cache
        # (inference), indexed too: a slice of a stack that feeds the scan is materialised, a
        # copy of the weights in every call (at decode it tripled the bytes read per step).
        by_slices = remat == "none" and carry[3] is None
        first_row = {}  # kind -> (its stack row of the first scanned layer of that kind, rows per group)
        for kind in {k for pair in group_kinds for k in pair}:
            mine = [i for i in layer_ids if kind in kinds(i)]
            slots = sched["mixer_slot" if kind in ("kda", "mla") else "ffn_slot"]
            lo, per = first_row[kind] = (int(slots[mine[0]]), len(mine) // count)
            if by_slices:  # the scanned layers of this kind hold consecutive rows of its stack
                xs[kind] = jax.tree.map(lambda a, lo=lo, per=per: a[lo:lo + per * count].reshape(
                    count, per, *a.shape[1:]), states[kind])
        xs["group"] = jnp.arange(count)

        def body(carry, group):
            ys = []
            used = dict.fromkeys(first_row, 0)  # kind -> this group's next row of that kind
            for p, (mixer, ffn) in enumerate(group_kinds):
                rows = []
                for kind in (mixer, ffn):
                    lo, per = first_row[kind]
                    rows.append(used[kind] if by_slices else lo + group["group"] * per + used[kind])
                    used[kind] += 1
                stacks = group if by_slices else states
                source = dict(index=group["index"], mixer_slot=group["mixer_slot"], norms=group["norms"],
                              mixer=stacks[mixer], ffn=stacks[ffn])
                carry, out = step(first + p, (p, rows[0], rows[1]))(carry, source)
                ys.append(out)
            return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys) if call.collect else None

        carry, scanned = jax.lax.scan(body, carry, xs)
        if call.collect:  # [count, period, ...] -> [count * period, ...]
            scanned = jax.tree.map(lambda a: a.reshape(count * period, *a.shape[2:]), scanned)
    carry, after = unrolled(carry, range(groups.stop, cfg.num_hidden_layers))
    if not call.collect:
        return carry, {}
    parts = [part for part in (before, scanned, after) if part is not None]
    return carry, jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


class K31ForCausalLM(nnx.Module):
    """Kimi K3 / K3.1 Pro text model (and the Kimi Linear family, through config switches).

    `model(tokens, cache=None) -> (logits fp32 [B, T, V], cache)`. Create a cache with
    `model.init_cache(batch, max_len)`, prefill any number of tokens, then decode.
    Training uses `hidden_states` (the final normalised hidden states, so the loss can stream
    the vocabulary) with packed rows (`segment_ids`) and a rematerialisation policy.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        cfg = self.config = config
        d, v, dt = cfg.hidden_size, cfg.vocab_size, jnp.dtype(cfg.dtype)
        self.embed = normal(rngs, (v, d), cfg.initializer_range, dt, ("vocab", "embed"))
        self.norms = _stack(cfg.num_hidden_layers, lambda r: LayerNorms(cfg, rngs=r), rngs)
        self.kda = _stack(len(cfg.kda_layers), lambda r: KDAMixer(cfg, rngs=r), rngs)
        self.mla = _stack(len(cfg.mla_layers), lambda r: MLAMixer(cfg, rngs=r), rngs)
        self.dense = _stack(len(cfg.dense_layers), lambda r: DenseMLP(cfg, cfg.intermediate_size, rngs=r), rngs)
        self.moe = _stack(len(cfg.moe_layers), lambda r: LatentMoE(cfg, rngs=r), rngs)
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
    ) -> tuple[jax.Array, Cache | None, dict[str, Any]]:
        """`tokens [B, T]` -> (final normalised hidden states `[B, T, D]`, cache, per-layer
        intermediates named in `collect` (see `INTERMEDIATES`), stacked on a leading layer axis).

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
        """
        cfg = self.config
        unknown = set(collect) - set(INTERMEDIATES)
        if unknown:
            raise ValueError(f"collect={sorted(unknown)}: expected names from {INTERMEDIATES}")
        if segment_ids is not None and cache is not None:
            raise ValueError("segment_ids (packed training rows) cannot continue a cache")
        b, t = tokens.shape
        act = jnp.dtype(cfg.dtype)
        if embeds is None:
            embeds = self.embed_tokens(tokens)
        elif embeds.shape != (b, t, cfg.hidden_size):
            raise ValueError(f"embeds {tuple(embeds.shape)} do not match tokens {(b, t)}: expected "
                             f"[B, T, hidden_size={cfg.hidden_size}]")
        x0 = constrain(embeds.astype(act), "batch", "seq", "act_embed")
        new_valid = jnp.ones((b, t), bool) if valid is None else valid
        if cache is not None:
            pos = cache.pos
            key_valid = jax.lax.dynamic_update_slice_in_dim(cache.key_valid, new_valid, pos, axis=1)
            cache = cache.replace(key_valid=key_valid)
        else:
            pos, key_valid = 0, new_valid
        graphdefs, states = {}, {"norms": nnx.to_pure_dict(nnx.state(self.norms))}
        for kind in ("kda", "mla", "dense", "moe"):
            if getattr(self, kind) is not None:
                graphdefs[kind], states[kind] = nnx.split(getattr(self, kind))
        call = _Call(cfg, backends or Backends(), graphdefs, valid=valid, segment_ids=segment_ids,
                     key_valid=key_valid, pos=pos, collect=tuple(collect))
        blocks0 = jnp.zeros((b, t, cfg.num_attn_res_slots, cfg.hidden_size), act)
        carry = (x0, blocks0, jnp.zeros((), jnp.int32), cache)
        (prefix, blocks, n_blocks, cache), per_layer = _run_layers(call, carry, states, scan_layers=scan_layers,
                                                                   remat=remat)
        out_norm = self.out_res_norm[...] if cfg.use_attn_res else None
        out_proj = self.out_res_proj[...] if cfg.use_attn_res else None
        h = _attn_res_input(cfg, out_norm, out_proj, blocks, n_blocks, prefix)
        final = rms_norm(h, self.final_norm[...], cfg.rms_norm_eps)
        if cache is not None:
            cache = constrain_cache(cache.replace(pos=cache.pos + t))
        if collect:
            per_layer = dict(per_layer, embed=x0, final_attn_res=h)
        return final, cache, per_layer

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
    ) -> tuple[jax.Array, Cache | None] | tuple[jax.Array, Cache | None, dict[str, Any]]:
        """Run `tokens [B, T]`, continuing `cache` when given -> (logits, cache).

        Arguments as in `hidden_states`. With `return_intermediates`, a third output holds
        every per-layer activation of `INTERMEDIATES` plus `embed`, `final_attn_res` and
        `final_hidden`.
        """
        collect = INTERMEDIATES if return_intermediates else ()
        hidden, cache, per_layer = self.hidden_states(tokens, cache, valid=valid, segment_ids=segment_ids,
                                                      backends=backends, scan_layers=scan_layers, collect=collect,
                                                      embeds=embeds)
        logits = self.logits(hidden)
        if return_intermediates:
            return logits, cache, dict(per_layer, final_hidden=hidden)
        return logits, cache


def abstract_model(config: ModelConfig) -> K31ForCausalLM:
    """The model with ShapeDtypeStruct leaves: nothing is allocated (`nnx.eval_shape`)."""
    return nnx.eval_shape(lambda: K31ForCausalLM(config, rngs=nnx.Rngs(0)))
