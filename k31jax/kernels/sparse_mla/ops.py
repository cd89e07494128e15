"""The kernel paths of `ops.mla_attention_sparse` and `ops.select_topk` (`impl` "pallas" |
"interpret"), plus the fused masked indexer scores (Pallas-Triton); and the latent attention
over the selected rows and the indexer's masked scores as Pallas TPU (Mosaic) kernels
(`latent_attention_sparse_tpu`, `indexer_topk_tpu`), which the ops run for "pallas" on a TPU
and for "interpret_tpu" anywhere.

Dtype policy: the absorbed query `W_UKᵀ q_nope` and the `W_UV` up-projection are the XLA op's
fp32 einsums. Inside the kernel, fp32 caches give fp32 (IEEE) matmuls; bf16 caches give bf16
operands (query and softmax weights rounded to bf16) with fp32 accumulation and an fp32
softmax. Outputs are fp32. Indexer scores are fp32 throughout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._common import pad_axis, pow2_at_least
from .mosaic_indexer import indexer_scores_tpu
from .mosaic_sparse_mla import LANES, sparse_mla_tpu, tile_rows
from .pallas_indexer import indexer_scores_masked
from .pallas_sparse_mla import combine_splits, sparse_latent_attention

H200_SMS = 132
BLOCK_K = 32


def head_block(h: int) -> int:
    """Heads per program: the fewest padded heads, then the fewest blocks (96 -> 32)."""
    return min((16, 32, 64), key=lambda bh: (-(-h // bh) * bh, -(-h // bh)))


def mla_attention_sparse(
    q_nope: Float[Array, "B T H dn"],
    q_pe: Float[Array, "B T H dr"],
    c_kv: Float[Array, "B S r"],
    k_pe: Float[Array, "B S dr"],
    w_uk: Float[Array, "r H dn"],
    w_uv: Float[Array, "r H dv"],
    idx: Int[Array, "B T K"],
    valid: Bool[Array, "B T K"],
    scale: float,
    *,
    impl: str = "pallas",
    n_split: int | None = None,
) -> Float[Array, "B T H dv"]:
    """The kernel path of `ops.mla_attention_sparse` (absorbed form over the selected rows).

    T == 1 is the decode kernel: the K slots are split over `n_split` programs (default: enough
    to give the H200's 132 SMs two programs each) and merged; T > 1 is the prefill kernel, one
    program per (query, head block) with its own selection.
    """
    b, t, h, _ = q_nope.shape
    r, dr = c_kv.shape[-1], k_pe.shape[-1]
    kk = idx.shape[-1]
    cdt = jnp.float32 if c_kv.dtype == jnp.float32 else c_kv.dtype
    bh = head_block(h)
    hp = -(-h // bh) * bh
    rp, pp = pow2_at_least(r), pow2_at_least(dr)
    n = b * t
    # W_UK_hᵀ q_nope_h in fp32, as the XLA op's `absorb_query` (kernels never import ops)
    q_lat = jnp.einsum("bthd,rhd->bthr", q_nope.astype(jnp.float32), w_uk.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    q_lat = pad_axis(pad_axis(q_lat.reshape(n, h, r), 1, hp), 2, rp).astype(cdt)
    qpe = pad_axis(pad_axis(q_pe.reshape(n, h, dr), 1, hp), 2, pp).astype(cdt)
    ckv = pad_axis(c_kv, 2, rp).astype(cdt)
    kpe = pad_axis(k_pe, 2, pp).astype(cdt)
    n_kb = -(-kk // BLOCK_K)
    if n_split is None:
        n_split = 1 if t > 1 else max(1, min(n_kb, -(-2 * H200_SMS // (b * (hp // bh)))))
    kp = -(-kk // (BLOCK_K * n_split)) * BLOCK_K * n_split
    ids = pad_axis(idx.reshape(n, kk).astype(jnp.int32), 1, kp)
    code = jnp.pad(valid.reshape(n, kk).astype(jnp.int32), [(0, 0), (0, kp - kk)], constant_values=-1)
    o, m, l = sparse_latent_attention(q_lat, qpe, ckv, kpe, ids, code, seq_len=t, scale=scale,
                                      n_split=n_split, impl=impl, block_h=bh, block_k=BLOCK_K)
    o_lat = combine_splits(o, m, l)[:, :h, :r].reshape(b, t, h, r)
    return jnp.einsum("bthr,rhd->bthd", o_lat, w_uv.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def latent_attention_sparse_tpu(
    q_lat: Float[Array, "B T H r"],
    q_pe: Float[Array, "B T H dr"],
    c_kv: Float[Array, "Lm B S r"],
    k_pe: Float[Array, "Lm B S dp"],
    idx: Int[Array, "B T K"],
    valid: Bool[Array, "B T K"],
    layer: Int[Array, ""],
    *,
    scale: float,
    interpret: bool = False,
) -> Float[Array, "B T H r"]:
    """The softmax-weighted selected latent rows `ô` (fp32) by the Mosaic kernel, for the
    absorbed query q̃ = `W_UKᵀ q_nope` (the op absorbs it and applies `W_UV`), reading the layer
    stacks' row `layer` in place (k_pe's rows may be padded past dr; q_pe is padded to match).

    Heads are padded to 8 and r, dr to whole 128-lane rows with zeros (exact). A cache whose
    rows or length are not tile-aligned (`tile_rows`) is padded here, a copy of the stacks: the
    model's K3.1 caches (r 512, k_pe at 128 lanes, `nn.kpe_width`) need no padding at lengths
    that are multiples of 16. `interpret`: the kernel body with TPU semantics on any backend."""
    b, t, h, r = q_lat.shape
    cdt = jnp.float32 if c_kv.dtype == jnp.float32 else c_kv.dtype
    rows = tile_rows(cdt)
    rp = -(-r // LANES) * LANES
    pp = -(-k_pe.shape[-1] // LANES) * LANES
    sp = -(-c_kv.shape[2] // rows) * rows
    c_kv = pad_axis(pad_axis(c_kv.astype(cdt), 3, rp), 2, sp)
    k_pe = pad_axis(pad_axis(k_pe.astype(cdt), 3, pp), 2, sp)
    hp = -(-h // 8) * 8
    n, kk = b * t, idx.shape[-1]
    q_lat = pad_axis(pad_axis(q_lat.reshape(n, h, r), 1, hp), 2, rp).astype(cdt)
    q_pe = pad_axis(pad_axis(q_pe.reshape(n, h, -1), 1, hp), 2, pp).astype(cdt)
    o = sparse_mla_tpu(q_lat, q_pe, c_kv, k_pe, idx.reshape(n, kk), valid.reshape(n, kk), layer, seq_len=t,
                       scale=scale, interpret=interpret)
    return o[:, :h, :r].reshape(b, t, h, r)


def indexer_scores(
    q: Float[Array, "B T HI dI"],
    w: Float[Array, "B T HI"],
    k: Float[Array, "B S dI"],
    q_pos: Int[Array, "T"],
    key_valid: Bool[Array, "B S"],
    *,
    impl: str = "pallas",
    block_s: int = 64,
) -> Float[Array, "B T S"]:
    """Masked index scores `[B, T, S]` (−inf where `s > q_pos[t]` or the key is invalid), the
    kernel form of `ops.indexer_scores` plus the causal / validity mask."""
    b, t, hi, di = q.shape
    s_len = k.shape[1]
    hip, dip = pow2_at_least(hi), pow2_at_least(di)
    sp = -(-s_len // block_s) * block_s
    n = b * t
    qq = pad_axis(pad_axis(q.astype(jnp.float32).reshape(n, hi, di), 1, hip), 2, dip)
    ww = pad_axis(w.astype(jnp.float32).reshape(n, hi), 1, hip)
    kk = pad_axis(pad_axis(k.astype(jnp.float32), 1, sp), 2, dip)
    pos = jnp.broadcast_to(q_pos.astype(jnp.int32)[None, :], (b, t)).reshape(n)
    kv = pad_axis(key_valid.astype(jnp.int32), 1, sp)
    sc = indexer_scores_masked(qq, ww, kk, pos, kv, seq_len=t, head_dim=di, impl=impl,
                               block_s=block_s)
    return sc.reshape(b, t, sp)[..., :s_len]


def select_topk(
    q: Float[Array, "B T HI dI"],
    w: Float[Array, "B T HI"],
    k: Float[Array, "B S dI"],
    q_pos: Int[Array, "T"],
    key_valid: Bool[Array, "B S"],
    top_k: int,
    key_block: int | None = None,
    *,
    impl: str = "pallas",
) -> tuple[Int[Array, "B T K"], Bool[Array, "B T K"]]:
    """The kernel path of `ops.select_topk`: fused masked scores (Pallas), then `lax.top_k`.

    The kernel path builds the `[B, T, S]` score matrix, so it is meant for decode (T = 1) and
    short chunks; `key_block` (the XLA streaming top-k for long prefill) is ignored by it.
    """
    scores = indexer_scores(q, w, k, q_pos, key_valid, impl=impl)
    vals, idx = jax.lax.top_k(scores, min(top_k, k.shape[1]))
    return idx.astype(jnp.int32), vals > -jnp.inf


def indexer_topk_tpu(
    q: Float[Array, "B T HI dI"],
    w: Float[Array, "B T HI"],
    k: Float[Array, "Lm B S dI"],
    q_pos: Int[Array, "T"],
    key_valid: Bool[Array, "B S"],
    layer: Int[Array, ""],
    *,
    top_k: int,
    interpret: bool = False,
) -> tuple[Int[Array, "B T K"], Bool[Array, "B T K"]]:
    """The TPU kernel path of `ops.select_topk`: the masked scores by the Mosaic kernel
    (`mosaic_indexer`, the keys' layer stack read at row `layer` in place), then `lax.top_k`
    over the `[B, T, S]` scores. It reads a row's keys once per query, so the op takes it for
    decode (T = 1) only."""
    b, t, hi, di = q.shape
    pos = jnp.broadcast_to(q_pos.astype(jnp.int32)[None, :], (b, t)).reshape(b * t)
    scores = indexer_scores_tpu(q.astype(jnp.float32).reshape(b * t, hi, di), w.astype(jnp.float32).reshape(b * t, hi),
                                k, pos, key_valid, layer=layer, interpret=interpret)
    vals, idx = jax.lax.top_k(scores.reshape(b, t, -1), min(top_k, k.shape[-2]))
    return idx.astype(jnp.int32), vals > -jnp.inf
