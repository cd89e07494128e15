"""Gated NoPE MLA, with the optional K3.1 lightning indexer (Gated DSA). Spec attention.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..config import ModelConfig
from ..ops import (Backends, indexer_keys, indexer_queries, mla_attention, mla_attention_absorbed,
                   mla_attention_sparse, rms_norm, select_topk, selection_mask)
from ._cache import MLALayerCache, constrain_new_rows
from ._param import constant, normal

_LATENT_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the class default, not rms_norm_eps


class Indexer(nnx.Module):
    """DeepSeek-V3.2-style lightning indexer without RoPE (architecture.md §10.1)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt, std = jnp.dtype(cfg.dtype), cfg.initializer_range
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        self.n_heads, self.top_k = hi, cfg.index_topk
        self.wq_b = normal(rngs, (cfg.q_lora_rank, hi * di), std, dt, ("q_lora", "index_heads"))
        self.wk = normal(rngs, (cfg.hidden_size, di), std, dt, ("embed", "head_dim"))
        self.k_norm_weight = constant((di,), 1.0, dt, ("norm",))
        self.k_norm_bias = constant((di,), 0.0, dt, ("norm",))
        self.weights_proj = normal(rngs, (cfg.hidden_size, hi), std, dt, ("embed", "index_heads"))

    def keys(self, x):
        return indexer_keys(x, self.wk[...], self.k_norm_weight[...], self.k_norm_bias[...])

    def queries(self, c_q, x):
        return indexer_queries(c_q, self.wq_b[...], x, self.weights_proj[...], self.n_heads)


class MLAMixer(nnx.Module):
    """`y = o_proj(o ⊙ σ(g_proj x))` with NoPE MLA attention (naive prefill, absorbed decode).

    Weights are `[in, out]`; `q_b` / `kv_b` columns keep the release's head-major order
    ([nope | pe] and [k_nope | v] per head).
    """

    # Prefill with a selection uses the [T, S] mask when T*S is at most this, else the gather.
    mask_path_max_elements = 1 << 22
    # Prefill scores the indexer keys this many at a time with a running top-k, so the
    # [B, T, heads, S] index logits of a long context are never built (1M keys: 4 GB per
    # query at 64 heads in fp32; a block of 4096 keys: 1 MB).
    index_key_block = 4096

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h = cfg.hidden_size, cfg.num_attention_heads
        dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        dt, std = jnp.dtype(cfg.dtype), cfg.initializer_range
        self.num_heads, self.dn, self.dr, self.dv, self.r = h, dn, dr, dv, r
        self.scale = (dn + dr) ** -0.5
        self.use_q_lora = cfg.q_lora_rank is not None
        if self.use_q_lora:
            self.q_a_proj = normal(rngs, (d, cfg.q_lora_rank), std, dt, ("embed", "q_lora"))
            self.q_a_norm = constant((cfg.q_lora_rank,), 1.0, dt, ("norm",))
            self.q_b_proj = normal(rngs, (cfg.q_lora_rank, h * (dn + dr)), std, dt, ("q_lora", "heads"))
        else:
            self.q_proj = normal(rngs, (d, h * (dn + dr)), std, dt, ("embed", "heads"))
        self.kv_a_proj = normal(rngs, (d, r + dr), std, dt, ("embed", "kv_lora"))
        self.kv_a_norm = constant((r,), 1.0, dt, ("norm",))
        self.kv_b_proj = normal(rngs, (r, h * (dn + dv)), std, dt, ("kv_lora", "heads"))
        self.use_gate = cfg.mla_use_output_gate
        if self.use_gate:
            self.g_proj = normal(rngs, (d, h * dv), std, dt, ("embed", "heads"))
        self.o_proj = normal(rngs, (h * dv, d), std, dt, ("heads", "embed"))
        self.indexer = Indexer(cfg, rngs=rngs) if cfg.use_indexer else None

    def latents(self, x):
        """c_q (or None), the normalised c_kv, and the raw k_pe for x `[B, T, D]`."""
        c_q = rms_norm(x @ self.q_a_proj[...], self.q_a_norm[...], _LATENT_EPS) if self.use_q_lora else None
        kv = x @ self.kv_a_proj[...]
        c_kv = rms_norm(kv[..., :self.r], self.kv_a_norm[...], _LATENT_EPS)
        return c_q, c_kv, kv[..., self.r:]

    def queries(self, x, c_q):
        """Per-head queries `(q_nope [B, T, H, dn], q_pe [B, T, H, dr])` from x or the q-latent."""
        b, t, _ = x.shape
        q = (c_q @ self.q_b_proj[...] if self.use_q_lora else x @ self.q_proj[...]).reshape(
            b, t, self.num_heads, self.dn + self.dr)
        return q[..., :self.dn], q[..., self.dn:]

    def dense_heads(self, x):
        """The naive (MHA) form's inputs for x `[B, T, D]` attending among itself (no cache):
        `(c_q, q_nope, q_pe, k_nope [B, T, H, dn], k_pe [B, T, dr])`. Indexer distillation
        reads the dense attention distribution from them (`ops.mla_attention_logits`)."""
        b, t, _ = x.shape
        c_q, c_kv, k_pe = self.latents(x)
        q_nope, q_pe = self.queries(x, c_q)
        k_nope = (c_kv @ self.kv_b_proj[...]).reshape(b, t, self.num_heads, self.dn + self.dv)[..., :self.dn]
        return c_q, q_nope, q_pe, k_nope, k_pe

    def _split_kv_b(self):
        w = self.kv_b_proj[...].reshape(self.r, self.num_heads, self.dn + self.dv)
        return w[..., :self.dn], w[..., self.dn:]  # W_UK [r, H, dn], W_UV [r, H, dv]

    def __call__(self, x, cache: MLALayerCache | None = None, *, pos=0, key_valid=None,
                 backends: Backends | None = None, segment_ids=None,
                 decode_form: bool = False) -> tuple[jax.Array, MLALayerCache | None]:
        """x `[B, T, D]` -> (y, the cache with the new latents written).

        Without a cache the T tokens attend among themselves (and None comes back). With one
        (`[B, S, ·]` buffers), the new latents are written at `pos` and the queries (absolute
        positions pos..pos+T-1) attend over the whole buffer; `key_valid [B, S]` marks written,
        non-padding slots (it must already include the new tokens). A cache with `layer` set
        holds the stacks of every MLA layer: the new latents are written into row `layer` in
        place and the keys read from it (`MLALayerCache`). backends: `sparse` picks the
        selected attention's form, `kernels` the ops' seam for the sparse attention and the
        top-k (default `Backends()`). segment_ids `[B, T]` int (packed training rows: 1, 2, ...
        per contiguous document, 0 = padding; no cache): a query attends, and the indexer
        selects, only within its own document, so every document computes exactly what it
        would alone; padding outputs are zero before o_proj.
        decode_form: a few queries over a long cache (a speculative verify step): the decode
        step's forms for any T (absorbed attention over the latent cache, the gathered
        selection, the index keys scored whole), which read the cache once instead of
        expanding every key to per-head keys and values as a prefill chunk does.
        """
        if segment_ids is not None and cache is not None:
            raise ValueError("MLAMixer: segment_ids (packed rows) is for the no-cache path; it "
                             "cannot be combined with c_kv / k_pe / index caches")
        backends = backends or Backends()
        sparse_form = backends.sparse
        b, t, _ = x.shape
        h, dn = self.num_heads, self.dn
        c_q, c_kv, k_pe = self.latents(x)
        q_nope, q_pe = self.queries(x, c_q)
        idx_k = self.indexer.keys(x).astype(x.dtype) if self.indexer is not None else None
        if cache is None:
            keys_ckv, keys_kpe, keys_idx = c_kv, k_pe, idx_k
            if key_valid is None:
                key_valid = jnp.ones((b, t), bool)
        else:
            layer = cache.layer

            def upd(leaf, buf, new):
                lanes = buf.shape[-1] - new.shape[-1]  # k_pe rows are padded (`kpe_width`)
                new = jnp.pad(new, ((0, 0), (0, 0), (0, lanes))) if lanes else new
                new = constrain_new_rows(leaf, new.astype(buf.dtype))
                if layer is None:
                    return jax.lax.dynamic_update_slice_in_dim(buf, new, pos, axis=1)
                return jax.lax.dynamic_update_slice(buf, new[None], (layer, 0, pos, 0))

            def row(buf):
                return buf if layer is None or buf is None else jax.lax.dynamic_index_in_dim(buf, layer, keepdims=False)

            cache = MLALayerCache(upd("mla_ckv", cache.ckv, c_kv), upd("mla_kpe", cache.kpe, k_pe),
                                  cache.index_keys if idx_k is None else upd("index_keys", cache.index_keys, idx_k),
                                  layer)
            keys_ckv, keys_kpe, keys_idx = row(cache.ckv), row(cache.kpe)[..., :k_pe.shape[-1]], row(cache.index_keys)
        s_len = keys_ckv.shape[1]
        q_pos = pos + jnp.arange(t)
        mask = (jnp.arange(s_len)[None, None, :] <= q_pos[None, :, None]) & key_valid[:, None, :]

        w_uk, w_uv = self._split_kv_b()
        select = self.indexer is not None and self.indexer.top_k < s_len
        if select:
            qi, wi = self.indexer.queries(c_q, x)
            key_block = self.index_key_block if t > 1 and not decode_form and s_len > self.index_key_block else None
            # a cache that is a row of the stacks is read there (`select_topk`'s layer)
            in_stack = cache is not None and cache.layer is not None
            sel_idx, sel_valid = select_topk(qi, wi, cache.index_keys if in_stack else keys_idx, q_pos,
                                             key_valid, self.indexer.top_k, key_block, impl=backends.kernels,
                                             segment_ids=segment_ids, layer=cache.layer if in_stack else None)
            if sparse_form == "auto":
                sparse_form = "gather" if t == 1 or decode_form or t * s_len > self.mask_path_max_elements else "mask"
        if select and sparse_form == "gather":
            # a cache that is a row of the stacks is read there (`mla_attention_sparse`'s layer)
            stacked = cache is not None and cache.layer is not None
            o = mla_attention_sparse(q_nope, q_pe, cache.ckv if stacked else keys_ckv,
                                     cache.kpe if stacked else keys_kpe, w_uk, w_uv, sel_idx, sel_valid,
                                     self.scale, impl=backends.kernels, segment_ids=segment_ids,
                                     layer=cache.layer if stacked else None)
        else:
            if select:
                mask = mask & selection_mask(sel_idx, sel_valid, s_len)
            if t == 1 or decode_form:  # decode: absorbed (MQA) form over the latent cache
                o = mla_attention_absorbed(q_nope, q_pe, keys_ckv, keys_kpe, w_uk, w_uv, mask, self.scale,
                                           segment_ids=segment_ids)
            else:  # prefill: naive (MHA) form with per-head keys/values expanded from the latent
                kv = (keys_ckv @ self.kv_b_proj[...]).reshape(b, s_len, h, dn + self.dv)
                o = mla_attention(q_nope, q_pe, kv[..., :dn], keys_kpe, kv[..., dn:], mask, self.scale,
                                  segment_ids=segment_ids)
        o = o.reshape(b, t, h * self.dv)
        if self.use_gate:
            o = o * jax.nn.sigmoid((x @ self.g_proj[...]).astype(jnp.float32))
        return o.astype(x.dtype) @ self.o_proj[...], cache
