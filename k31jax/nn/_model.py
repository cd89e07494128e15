"""The K3 / K3.1 Pro / Kimi Linear causal LM: embedding, the layer stack, head.

Layers of one kind are stacked (`[n, ...]` parameters with a leading "layers" axis) and the
stack is run by one `lax.scan` over all layers, switching between the KDA and MLA mixers
(and the dense and MoE FFNs) with `lax.cond` on a static schedule, so compile time does not
grow with depth. `scan_layers=False` unrolls the same step in Python (for tests and
debugging); both give identical numbers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..cache import Cache, init_cache
from ..config import ModelConfig
from ..ops import _norms
from ..ops._attn_res import attn_res_mix
from ..sharding._rules import constrain
from ..sharding._state import constrain_cache
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


class _Split:
    """A stacked module split once per call, and re-merged per layer slot."""

    def __init__(self, module):
        self.graphdef, self.state = nnx.split(module)

    def __getitem__(self, slot):
        return nnx.merge(self.graphdef, jax.tree.map(lambda a: a[slot], self.state))


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


class K31ForCausalLM(nnx.Module):
    """Kimi K3 / K3.1 Pro text model (and the Kimi Linear family, through config switches).

    `model(tokens, cache=None) -> (logits fp32 [B, T, V], cache)`. Create a cache with
    `model.init_cache(batch, max_len)`, prefill any number of tokens, then decode.
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

    def __call__(
        self,
        tokens: jax.Array,
        cache: Cache | None = None,
        *,
        valid: jax.Array | None = None,
        scan_layers: bool = True,
        return_intermediates: bool = False,
        moe_impl: str = "auto",
        sparse_impl: str = "auto",
        ep: str = "auto",
        kernels: str | None = None,
    ) -> tuple[jax.Array, Cache | None] | tuple[jax.Array, Cache | None, dict[str, Any]]:
        """Run `tokens [B, T]`, continuing `cache` when given.

        valid `[B, T]` marks real tokens (False for left padding); padded positions change
        no other token's result. With `return_intermediates`, a third output holds per-layer
        activations stacked on a leading layer axis (attn_in, attn_out, mlp_in, mlp_out,
        prefix, router_idx, router_weights).

        Under a mesh (`jax.set_mesh`, see `k31jax.sharding`), activations are constrained to
        their logical shardings at layer boundaries and the routed experts run expert-parallel
        (`ep`: "auto" | "ragged" | "dense" | "allgather" | "off", see `LatentMoE`). Without a
        mesh both are no-ops.

        kernels: the ops' `impl` seam for the hot paths — KDA chunk / decode step, sparse MLA
        attention, indexer top-k, MXFP4 grouped matmul: None / "auto" (the Pallas kernels on a
        GPU outside an auto-partitioned mesh, XLA elsewhere), "xla", "pallas", "interpret".
        """
        cfg = self.config
        b, t = tokens.shape
        act = jnp.dtype(cfg.dtype)
        x0 = constrain(jnp.take(self.embed[...], tokens, axis=0).astype(act), "batch", "seq", "act_embed")
        if cache is not None:
            pos = cache.pos
            new_valid = jnp.ones((b, t), bool) if valid is None else valid
            key_valid = jax.lax.dynamic_update_slice_in_dim(cache.key_valid, new_valid, pos, axis=1)
            cache = cache.replace(key_valid=key_valid)
        else:
            pos = 0
            key_valid = jnp.ones((b, t), bool) if valid is None else valid

        kda = _Split(self.kda) if self.kda is not None else None
        mla = _Split(self.mla) if self.mla is not None else None
        dense = _Split(self.dense) if self.dense is not None else None
        moe = _Split(self.moe) if self.moe is not None else None
        k_route = cfg.num_experts_per_token if cfg.moe_layers else 1

        def run_kda(slot, x, c):
            st = None if c is None else c.kda_state[slot]
            cv = None if c is None else c.kda_conv[slot]
            y, st, cv = kda[slot](x, st, cv, valid, kernels=kernels)
            if c is not None:
                c = c.replace(kda_state=c.kda_state.at[slot].set(st), kda_conv=c.kda_conv.at[slot].set(cv))
            return y, c

        def run_mla(slot, x, c):
            if c is None:
                y, *_ = mla[slot](x, key_valid=key_valid, sparse_impl=sparse_impl, kernels=kernels)
                return y, c
            ik = None if c.index_keys is None else c.index_keys[slot]
            y, ckv, kpe, ik = mla[slot](x, c.mla_ckv[slot], c.mla_kpe[slot], ik, pos=pos,
                                        key_valid=key_valid, sparse_impl=sparse_impl, kernels=kernels)
            c = c.replace(mla_ckv=c.mla_ckv.at[slot].set(ckv), mla_kpe=c.mla_kpe.at[slot].set(kpe),
                          index_keys=None if ik is None else c.index_keys.at[slot].set(ik))
            return y, c

        def run_dense(slot, x):
            no_route = (jnp.zeros((b, t, k_route), jnp.int32), jnp.zeros((b, t, k_route), jnp.float32))
            return dense[slot](x), *no_route

        def run_moe(slot, x):
            return moe[slot](x, impl=moe_impl, ep=ep, kernels=kernels)

        def mixer(is_mla, slot, x, c):
            if kda is None or mla is None or isinstance(is_mla, (bool, np.bool_)):
                return (run_mla if (kda is None or (mla is not None and is_mla)) else run_kda)(slot, x, c)
            return jax.lax.cond(is_mla, run_mla, run_kda, slot, x, c)

        def ffn(is_moe, slot, x):
            if dense is None or moe is None or isinstance(is_moe, (bool, np.bool_)):
                return (run_moe if (dense is None or (moe is not None and is_moe)) else run_dense)(slot, x)
            return jax.lax.cond(is_moe, run_moe, run_dense, slot, x)

        block = cfg.attn_res_block_size
        n_slots = cfg.num_attn_res_slots

        def layer(carry, row):
            prefix, blocks, n_blocks, c = carry
            norms = row["norms"]
            if cfg.use_attn_res:
                h = attn_res_mix(blocks, n_blocks, prefix, norms.attn_res_norm, norms.attn_res_proj, cfg.rms_norm_eps)
                snap = jnp.asarray(row["index"] % block == 0)
                pushed = jax.lax.dynamic_update_slice_in_dim(blocks, prefix[:, :, None], n_blocks, axis=2)
                blocks = jnp.where(snap, pushed, blocks)
                n_blocks = n_blocks + snap.astype(jnp.int32)
                prefix = jnp.where(snap, jnp.zeros_like(prefix), prefix)
            else:
                h = prefix
            attn_out, c = mixer(row["is_mla"], row["mixer_slot"],
                                _norms.rms_norm(h, norms.input_norm, cfg.rms_norm_eps), c)
            prefix = constrain(prefix + attn_out.astype(act), "batch", "seq", "act_embed")
            c = constrain_cache(c)
            if cfg.use_attn_res:
                h2 = attn_res_mix(blocks, n_blocks, prefix, norms.mlp_res_norm, norms.mlp_res_proj, cfg.rms_norm_eps)
            else:
                h2 = prefix
            mlp_out, r_idx, r_w = ffn(row["is_moe"], row["ffn_slot"],
                                      _norms.rms_norm(h2, norms.post_norm, cfg.rms_norm_eps))
            prefix = constrain(prefix + mlp_out.astype(act), "batch", "seq", "act_embed")
            if cfg.use_attn_res:
                blocks = constrain(blocks, "batch", "seq", None, "act_embed")
            out = None
            if return_intermediates:
                out = dict(attn_in=h, attn_out=attn_out, mlp_in=h2, mlp_out=mlp_out, prefix=prefix,
                           router_idx=r_idx, router_weights=r_w)
            return (prefix, blocks, n_blocks, c), out

        sched = _schedule(cfg)
        norms_state = nnx.to_pure_dict(nnx.state(self.norms))
        blocks0 = jnp.zeros((b, t, n_slots, cfg.hidden_size), act)
        carry = (x0, blocks0, jnp.zeros((), jnp.int32), cache)
        norms_view = _Namespace
        if scan_layers:
            rows = {k: jnp.asarray(v) for k, v in sched.items()}
            rows["norms"] = norms_state

            def body(carry, row):
                row = dict(row, norms=norms_view(row["norms"]))
                return layer(carry, row)

            carry, inter = jax.lax.scan(body, carry, rows)
        else:
            outs = []
            for i in range(cfg.num_hidden_layers):
                row = {k: v[i] for k, v in sched.items()}
                row = {k: (bool(v) if v.dtype == bool else int(v)) for k, v in row.items()}
                row["norms"] = norms_view(jax.tree.map(lambda a: a[i], norms_state))
                carry, o = layer(carry, row)
                outs.append(o)
            inter = jax.tree.map(lambda *a: jnp.stack(a), *outs) if return_intermediates else None
        prefix, blocks, n_blocks, cache = carry
        if cfg.use_attn_res:
            h = attn_res_mix(blocks, n_blocks, prefix, self.out_res_norm[...], self.out_res_proj[...], cfg.rms_norm_eps)
        else:
            h = prefix
        final = _norms.rms_norm(h, self.final_norm[...], cfg.rms_norm_eps)
        logits = constrain(jnp.dot(final, self.lm_head[...], preferred_element_type=jnp.float32),
                           "batch", "seq", "act_vocab")
        if cache is not None:
            cache = constrain_cache(cache.replace(pos=cache.pos + t))
        if return_intermediates:
            inter = dict(inter, embed=x0, final_attn_res=h, final_hidden=final)
            return logits, cache, inter
        return logits, cache


class _Namespace:
    """Attribute access to one layer's norm vectors."""

    def __init__(self, d):
        self.__dict__.update(d)

