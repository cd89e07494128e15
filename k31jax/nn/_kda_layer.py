"""The Kimi Delta Attention mixer as a thin NNX module over `k31jax.ops`. Spec kda.md."""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from ..config import ModelConfig
from ..ops import Backends, kda_chunked, kda_gate, kda_mask_padding, kda_recurrent, l2_normalize, short_conv
from ..sharding import constrain
from ._cache import KDALayerCache
from ._param import constant, dt_bias_init, normal, param, uniform


class KDAMixer(nnx.Module):
    """q/k/v projections + short convs, lower-bound (or softplus) gate, delta rule, gated norm.

    Parameters are stored `[in, out]` (the release's `[out, in]` transposed); convs `[K, C]`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, dk = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        c = h * dk
        dt = jnp.dtype(cfg.dtype)
        std = cfg.initializer_range
        self.num_heads, self.head_dim = h, dk
        self.lower_bound = cfg.kda_gate_lower_bound
        self.full_rank_gate = cfg.kda_full_rank_gate
        self.eps = cfg.rms_norm_eps
        self.chunk_size = cfg.kda_chunk_size
        self.q_proj = normal(rngs, (d, c), std, dt, ("embed", "heads"))
        self.k_proj = normal(rngs, (d, c), std, dt, ("embed", "heads"))
        self.v_proj = normal(rngs, (d, c), std, dt, ("embed", "heads"))
        k = cfg.kda_conv_size
        self.q_conv = uniform(rngs, (k, c), -0.5, 0.5, jnp.float32, ("conv", "heads"))
        self.k_conv = uniform(rngs, (k, c), -0.5, 0.5, jnp.float32, ("conv", "heads"))
        self.v_conv = uniform(rngs, (k, c), -0.5, 0.5, jnp.float32, ("conv", "heads"))
        self.f_a_proj = normal(rngs, (d, dk), std, dt, ("embed", "head_dim"))
        self.f_b_proj = normal(rngs, (dk, c), std, dt, ("head_dim", "heads"))
        self.b_proj = normal(rngs, (d, h), std, dt, ("embed", "heads"))
        if self.lower_bound is None:  # Kimi Linear: A_log = log U(1, 16)
            a = jnp.log(jax.random.uniform(rngs.params(), (cfg.kda_a_log_len,), jnp.float32, 1, 16))
            self.a_log = param(a, ("norm",))
        else:  # K3: A_log = 0, stored zero-padded to kda_a_log_len
            self.a_log = constant((cfg.kda_a_log_len,), 0.0, jnp.float32, ("norm",))
        self.dt_bias = dt_bias_init(rngs, (c,), ("heads",))
        if self.full_rank_gate:
            self.g_proj = normal(rngs, (d, c), std, dt, ("embed", "heads"))
        else:
            self.g_a_proj = normal(rngs, (d, dk), std, dt, ("embed", "head_dim"))
            self.g_b_proj = normal(rngs, (dk, c), std, dt, ("head_dim", "heads"))
        self.o_norm = constant((dk,), 1.0, jnp.float32, ("norm",))
        self.o_proj = normal(rngs, (c, d), std, dt, ("heads", "embed"))

    def __call__(self, x, cache: KDALayerCache | None = None, valid=None, *, backends: Backends | None = None,
                 segment_ids=None, trail: bool = False) -> tuple[jax.Array, KDALayerCache]:
        """x `[B, T, D]` (post input_layernorm) -> (y `[B, T, D]`, the continued cache).

        cache (the recurrent state `[B, H, dk, dv]` fp32 and the conv window `[B, 3, C, K-1]`,
        pre-conv q/k/v inputs, oldest first) continues a sequence; None starts one. `valid`
        `[B, T]` marks real tokens: padded positions become identity steps (no decay, no write,
        zero conv input).
        T == 1 takes the recurrent step, longer inputs the chunked form. backends: `kernels` is
        the ops' seam (default `Backends()`: the Pallas kernels on a GPU, XLA elsewhere).
        segment_ids `[B, T]` int (packed training rows: 1, 2, ... per contiguous document, 0 =
        padding): the state and conv windows reset at each document start, so every document
        computes exactly what it would alone; padding outputs are zero. Fresh rows only (no
        cache); the returned cache is the row's last document's. Runs the XLA path of the
        recurrence (the kernel takes no segments).
        trail (with a cache): run the recurrent step over every token, as T decode steps would,
        and return the state and conv window after each token too (`KDALayerCache.state_trail`,
        `conv_trail`; a speculative verify step).
        """
        if trail and cache is None:
            raise ValueError("KDAMixer: trail=True continues a cache; none was given")
        if segment_ids is not None and cache is not None:
            raise ValueError("KDAMixer: segment_ids (packed rows) start fresh sequences; it cannot "
                             "be combined with a state / conv cache")
        state, conv = (None, None) if cache is None else (cache.state, cache.conv)
        kernels = (backends or Backends()).kernels
        b, t, _ = x.shape
        h, dk = self.num_heads, self.head_dim
        if valid is not None:
            x = jnp.where(valid[:, :, None], x, 0)
        hist = [None] * 3 if conv is None else [jnp.swapaxes(conv[:, j], 1, 2) for j in range(3)]
        branches, new_hist, windows = [], [], []
        for proj, w_conv, hst in zip((self.q_proj, self.k_proj, self.v_proj),
                                     (self.q_conv, self.k_conv, self.v_conv), hist):
            pre = x @ proj[...]
            y, hy = short_conv(pre, w_conv[...], hst, segment_ids=segment_ids)
            branches.append(jax.nn.silu(y).reshape(b, t, h, dk))
            new_hist.append(jnp.swapaxes(hy, 1, 2))
            if trail:  # the window after token i: the K-1 inputs ending there, oldest first
                full = jnp.concatenate([hst.astype(jnp.float32), pre.astype(jnp.float32)], axis=1)
                km1 = hst.shape[1]
                windows.append(jnp.stack([jnp.swapaxes(full[:, i + 1:i + 1 + km1], 1, 2) for i in range(t)], axis=1))
        q, k, v = branches
        q = l2_normalize(q) * dk ** -0.5
        k = l2_normalize(k)
        z = ((x @ self.f_a_proj[...]) @ self.f_b_proj[...]).astype(jnp.float32).reshape(b, t, h, dk)
        g = kda_gate(z, self.a_log[...][:h], self.dt_bias[...].reshape(h, dk), self.lower_bound)
        beta = jax.nn.sigmoid((x @ self.b_proj[...]).astype(jnp.float32))
        if valid is not None:
            g, beta = kda_mask_padding(valid, g, beta)
        state_trail = None
        if trail:
            o, state_trail = kda_recurrent(q, k, v, g, beta, state, every_state=True)
            state = state_trail[:, -1]
        elif t == 1 and state is not None:
            o, state = kda_recurrent(q, k, v, g, beta, state, impl=kernels)
        else:
            # Tokens whole, heads split: the chunk loop reads its chunks in order, so a token split
            # (propagated from the expert-parallel MoE, which splits a row's tokens over `expert`)
            # made the partitioner all-gather every chunked input in every chunk step (K3.1 Pro
            # prefill: 111 GB per 2,048-token chunk); one gather per layer here.
            q, k, v, g = (constrain(a, "batch", "seq", "act_heads", None) for a in (q, k, v, g))
            beta = constrain(beta, "batch", "seq", "act_heads")
            o, state = kda_chunked(q, k, v, g, beta, state, self.chunk_size, impl=kernels,
                                   lower_bound=self.lower_bound, segment_ids=segment_ids)
        gate_in = x @ self.g_proj[...] if self.full_rank_gate else (x @ self.g_a_proj[...]) @ self.g_b_proj[...]
        gate = jax.nn.sigmoid(gate_in.astype(jnp.float32)).reshape(b, t, h, dk)
        o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.eps)
        o = (o * self.o_norm[...] * gate).reshape(b, t, h * dk).astype(x.dtype)
        conv_trail = jnp.stack(windows, axis=2) if trail else None
        return o @ self.o_proj[...], KDALayerCache(state, jnp.stack(new_hist, axis=1), state_trail, conv_trail)
