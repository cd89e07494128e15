"""Kimi Delta Attention: short conv, gates, and the delta-rule recurrence. Spec kda.md.

Layouts: activations `[B, T, H, d]`; the recurrent state is key-major `[B, H, dk, dv]` fp32.
Everything from the gates to the state runs in fp32; callers cast the output back.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ..kernels import kda_chunk
from ._impl import ImplChoice, kernel_or_reference, per_device, resolve_impl

_HI = jax.lax.Precision.HIGHEST


def check_segment_ids(segment_ids, shape: tuple[int, int], where: str, name: str = "segment_ids") -> None:
    """Packed-row document ids must be an integer `[B, T]` array matching the activations."""
    if tuple(segment_ids.shape) != tuple(shape) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"{where}: {name} must be an integer array of shape {tuple(shape)} "
                         f"(batch, tokens), got {segment_ids.dtype}{list(segment_ids.shape)}")


def segment_starts(segment_ids: Int[Array, "B T"]) -> Bool[Array, "B T"]:
    """Where a document begins inside a packed row: `t ≥ 1`, a non-zero id, and an id different
    from token t-1's. These are the positions where the KDA state and conv window reset.

    Token 0 is never a start: the row's first document continues the call's left context
    (`initial_state`, the conv `history`; zeros when None). Padding (id 0) never starts anything:
    it is an identity step, so a row ending in padding returns its last document's state.
    """
    prev = jnp.pad(segment_ids[:, :-1], [(0, 0), (1, 0)])
    first = jnp.arange(segment_ids.shape[1]) == 0
    return (segment_ids != 0) & (segment_ids != prev) & ~first


def short_conv(
    x: Float[Array, "B T C"],
    weight: Float[Array, "K C"],
    history: Float[Array, "B Km1 C"] | None = None,
    *,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T C"], Float[Array, "B Km1 C"]]:
    """Causal depthwise conv: `y_t = Σ_j w[j] · in_{t-K+1+j}` (tap K-1 is the current token).

    `history` holds the K-1 previous *pre-conv* inputs, oldest first (zeros when None). Returns
    the fp32 output (no activation) and the new history (the last K-1 inputs).

    segment_ids `[B, T]` (packed rows: 1, 2, ... per contiguous document, 0 = padding): a tap
    never reads a token of an earlier document (zero instead; see `segment_starts`), padding
    inputs count as zero and padding outputs are zero. Equal to running each document alone;
    the returned history is the one the row's last document returns alone (padding does not
    shift the window), or `history` for a row of padding only.
    """
    k = weight.shape[0]
    b, t, c = x.shape
    if history is None:
        history = jnp.zeros((b, k - 1, c), jnp.float32)
    x = x.astype(jnp.float32)
    if segment_ids is not None:
        check_segment_ids(segment_ids, (b, t), "short_conv")
        x = jnp.where((segment_ids != 0)[..., None], x, 0.0)
    full = jnp.concatenate([history.astype(jnp.float32), x], axis=1)
    w = weight.astype(jnp.float32)
    if segment_ids is None:
        y = sum(w[j] * full[:, j:j + t] for j in range(k))
        return y, full[:, t:]
    # earliest readable position per token: its document's start, or -(K-1) (the history) for
    # the document that continues the left context
    pos = jnp.arange(t)
    first = jax.lax.cummax(jnp.where(segment_starts(segment_ids), pos, -(k - 1)), axis=1)
    y = sum(jnp.where((pos - (k - 1 - j) >= first)[..., None], w[j] * full[:, j:j + t], 0.0)
            for j in range(k))
    y = jnp.where((segment_ids != 0)[..., None], y, 0.0)
    # the K-1 inputs before `end` (one past the row's last real token; 0 for padding only),
    # zero before the last document's start; `full` holds token p at index p + K-1
    end = jnp.max(jnp.where(segment_ids != 0, pos + 1, 0), axis=1)
    window = end[:, None] + jnp.arange(k - 1)  # [B, K-1] indices into `full`
    new_hist = jnp.take_along_axis(full, window[..., None], axis=1)
    last_first = jnp.take_along_axis(first, jnp.maximum(end - 1, 0)[:, None], axis=1)
    return y, jnp.where((window - (k - 1) >= last_first)[..., None], new_hist, 0.0)


def _zero_state(b, h, dk, dv):
    """A fresh fp32 state behind an optimisation barrier.

    Without the barrier XLA:CPU (jax 0.12) constant-folds the zero state into the first
    chunk's matmuls and, when the sequence fits one chunk, intermittently returns garbage
    (reads of uninitialised memory). The barrier costs nothing measurable.
    """
    return jax.lax.optimization_barrier(jnp.zeros((b, h, dk, dv), jnp.float32))


def softplus_thresholded(u: Float[Array, "..."]) -> Float[Array, "..."]:
    """torch's softplus with threshold 20: `u` where `u > 20`, else `log1p(exp(u))`."""
    return jnp.where(u > 20.0, u, jnp.log1p(jnp.exp(jnp.minimum(u, 20.0))))


def kda_gate(
    z: Float[Array, "B T H dk"],
    a_log: Float[Array, "H"],
    dt_bias: Float[Array, "H dk"],
    lower_bound: float | None,
) -> Float[Array, "B T H dk"]:
    """Per-channel log-decay g ≤ 0 (kda.md §3), fp32.

    lower_bound set (K3): `g = lb · σ(exp(A_log[h]) · (z + dt_bias))`, so g ∈ (lb, 0).
    lower_bound None (Kimi Linear): `g = -exp(A_log[h]) · softplus(z + dt_bias)`.
    """
    u = z.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    a = jnp.exp(a_log.astype(jnp.float32))[:, None]
    if lower_bound is None:
        return -a * softplus_thresholded(u)
    return lower_bound * jax.nn.sigmoid(a * u)


def kda_recurrent(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    g: Float[Array, "B T H dk"],
    beta: Float[Array, "B T H"],
    initial_state: Float[Array, "B H dk dv"] | None = None,
    *,
    impl: ImplChoice | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    every_state: bool = False,
) -> tuple[Float[Array, "B T H dv"], Float[Array, "B H dk dv"] | Float[Array, "B T H dk dv"]]:
    """The delta rule one token at a time (kda.md §4): decay, read, write, then read out.

    q and k are used as given (already L2-normalised, q scaled). Used for decode steps; fp32.
    impl (see `_impl.resolve_impl`): "xla" is this scan; "pallas" / "interpret" the fused
    decode-step kernel of `k31jax.kernels.kda_chunk`; None / "auto" the kernel on a GPU.

    segment_ids `[B, T]` (packed rows, 0 = padding): the state is reset to zero where a document
    starts (`segment_starts`), padding steps are identities (g = 0, β = 0) with zero output, and
    the returned state is the row's last document's. Always the XLA path (the kernel takes no
    segments). Equal to running each document alone.

    every_state: return the state after every token `[B, T, H, dk, dv]` instead of the last
    one (a speculative verify step rolls back to one of them, `k31jax.nn.KDATrail`). Always
    the XLA path: the kernel keeps its state on chip and writes only the last one.
    """
    impl = resolve_impl(impl, "kda_step")
    if segment_ids is not None or every_state:
        impl = "xla"
    if impl != "xla":
        if initial_state is None:
            initial_state = _zero_state(q.shape[0], q.shape[2], q.shape[3], v.shape[-1])
        step = kernel_or_reference("kda_step", impl, functools.partial(kda_chunk.kda_recurrent, impl=impl),
                                   functools.partial(kda_recurrent, impl="xla"))
        # every (row, head) is its own recurrence: under a mesh, each device runs its slice
        tokens, state = ("batch", "seq", "act_heads", None), ("batch", "act_heads", None, None)
        return per_device(step, (tokens,) * 4 + (("batch", "seq", "act_heads"), state),
                          (tokens, state))(q, k, v, g, beta, initial_state)
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    state = _zero_state(b, h, dk, dv) if initial_state is None else initial_state
    if segment_ids is not None:
        check_segment_ids(segment_ids, q.shape[:2], "kda_recurrent")
        g, beta = kda_mask_padding(segment_ids != 0, g, beta)
    xs = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]
    if segment_ids is not None:
        xs.append(jnp.moveaxis(segment_starts(segment_ids), 1, 0))

    def step(s, inp):
        qt, kt, vt, gt, bt = inp[:5]
        if segment_ids is not None:  # a new document starts from a zero state
            s = jnp.where(inp[5][:, None, None, None], 0.0, s)
        s = s * jnp.exp(gt)[..., None]
        read = jnp.einsum("bhkv,bhk->bhv", s, kt, precision=_HI)
        s = s + jnp.einsum("bhk,bhv->bhkv", kt * bt[..., None], vt - read, precision=_HI)
        out = jnp.einsum("bhkv,bhk->bhv", s, qt, precision=_HI)
        return s, (out, s) if every_state else out

    # a verify step's few tokens run unrolled: a loop iteration costs more than its step there
    state, o = jax.lax.scan(step, state.astype(jnp.float32), xs, unroll=every_state)
    if every_state:
        o, states = o
        state = jnp.moveaxis(states, 0, 1)
    o = jnp.moveaxis(o, 0, 1)
    if segment_ids is not None:
        o = jnp.where((segment_ids != 0)[..., None, None], o, 0.0)
    return o, state


def kda_chunked(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    g: Float[Array, "B T H dk"],
    beta: Float[Array, "B T H"],
    initial_state: Float[Array, "B H dk dv"] | None = None,
    chunk_size: int = 64,
    *,
    impl: ImplChoice | None = None,
    lower_bound: float | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T H dv"], Float[Array, "B H dk dv"]]:
    """Chunked WY/UT form of `kda_recurrent` (kda.md §5), for prefill and training.

    Any T: the tail is padded with zeros for q, k, v, g and β, which is an exact identity
    step (α = 1, k = 0, β = 0). The decayed products are tiled in 16-row sub-chunks
    (`decayed_products`, kda.md §6b): off-diagonal tiles factor around a row where both factors
    are ≤ 1, diagonal tiles keep `exp(where(j ≤ i, Γ_i − Γ_j, −inf))`; nothing overflows
    whatever the gate.

    impl (see `_impl.resolve_impl`): "xla" is this path; "pallas" / "interpret" /
    "interpret_tpu" the kernels of `k31jax.kernels.kda_chunk` (chunk sizes 16-128; Triton, or
    Mosaic for a TPU), per device under a mesh; None / "auto" the kernel on a GPU.
    `lower_bound` (the gate's bound, None for softplus) only lets the Triton kernel factor its
    diagonal sub-chunk tiles (kda.md §6b); this path ignores it.

    segment_ids `[B, T]` (packed rows, 0 = padding): exactly `kda_recurrent(segment_ids=...)`,
    i.e. each document run alone, for any chunk size and documents starting mid-chunk. Per
    chunk, each row carries the index of its document within the chunk (0: the document that
    began before the chunk); the intra-chunk decays, the UT system and the read-out keep only
    same-document pairs, only document 0 reads the incoming state, and only the chunk's last
    document is carried to the next. Nothing is scaled, so no gate trick can overflow.
    Always the XLA path (the kernel takes no segments).
    """
    impl = resolve_impl(impl, "kda_chunk", supported=chunk_size in kda_chunk.CHUNK_SIZES)
    if segment_ids is not None:
        impl = "xla"
    if impl != "xla":
        if initial_state is None:
            initial_state = _zero_state(q.shape[0], q.shape[2], q.shape[3], v.shape[-1])
        run = kernel_or_reference(
            "kda_chunk", impl,
            functools.partial(kda_chunk.kda_chunked, chunk_size=chunk_size, lower_bound=lower_bound, impl=impl),
            functools.partial(kda_chunked, chunk_size=chunk_size, impl="xla"))
        # every (row, head) is its own recurrence over the whole sequence: under a mesh, each
        # device runs its rows and heads with the tokens whole
        tokens, state = ("batch", None, "act_heads", None), ("batch", "act_heads", None, None)
        return per_device(run, (tokens,) * 4 + (("batch", None, "act_heads"), state),
                          (tokens, state))(q, k, v, g, beta, initial_state)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t
    if segment_ids is not None:
        check_segment_ids(segment_ids, (b, t), "kda_chunked")
        g, beta = kda_mask_padding(segment_ids != 0, g, beta)

    def chunks(a):
        a = a.astype(jnp.float32)
        if pad:
            a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(b, n, c, *a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)  # [n, B, H, C, ...]

    qc, kc, vc, gc = (chunks(a) for a in (q, k, v, g))
    bc = chunks(beta)  # [n, B, H, C]
    xs = (qc, kc, vc, gc, bc)
    if segment_ids is not None:  # the document index of each row within its chunk
        starts = jnp.pad(segment_starts(segment_ids), [(0, 0), (0, pad)]).reshape(b, n, c)
        xs += (jnp.moveaxis(jnp.cumsum(starts, axis=2, dtype=jnp.int32), 1, 0),)  # [n, B, C]
    state = _zero_state(b, h, dk, dv) if initial_state is None else initial_state
    body = functools.partial(_kda_chunk_step, chunk_size=c)
    state, o = jax.lax.scan(body, state.astype(jnp.float32), xs)
    o = jnp.moveaxis(o, 0, 1)  # [B, n, H, C, dv]
    o = jnp.moveaxis(o, 2, 3).reshape(b, n * c, h, dv)[:, :t]
    if segment_ids is not None:
        o = jnp.where((segment_ids != 0)[..., None, None], o, 0.0)
    return o, state


SUBCHUNK = 16


def _subchunk(c: int) -> int:
    """Tile size of the decayed products (kda.md §6b): 16 rows, or the whole chunk when it is
    not a multiple of 16."""
    return SUBCHUNK if c % SUBCHUNK == 0 else c


def decayed_products(
    queries: tuple[Float[Array, "B H C d"], ...], k: Float[Array, "B H C d"], gamma: Float[Array, "B H C d"],
    sub: int,
) -> tuple[Float[Array, "B H C C"], ...]:
    """For each `a` in `queries`: `M_ij = Σ_d a_id k_jd e^{Γ_id − Γ_jd}` for j ≤ i, 0 above the
    diagonal (Γ non-increasing along C), tiled as kda.md §6b prescribes.

    Off-diagonal tiles factor around the first row n of the later tile,
    `e^{Γ_i − Γ_n} · e^{Γ_n − Γ_j}` (both ≤ 1 for j < n ≤ i, so nothing overflows whatever the
    gate) and become matmuls; the `sub x sub` diagonal tiles keep the explicit pairwise decay,
    masked before `exp`, which is safe for any gate. Against materialising the whole
    `[C, C, d]` decay this moves C/sub times fewer elements through `exp` and the backward
    pass, which is what makes training fast.
    """
    b, h, c, d = k.shape
    n = c // sub

    def tiles(x):
        return x.reshape(b, h, n, sub, d)

    g = tiles(gamma)
    ref = g[:, :, :, :1, :]  # [B, H, n, 1, d]: Γ at each tile's first row
    earlier = jnp.arange(c)[None, :] < (jnp.arange(n) * sub)[:, None]  # [n, C]: j before tile I
    k_to_ref = k[:, :, None] * jnp.exp(jnp.where(earlier[:, :, None], ref - gamma[:, :, None], -jnp.inf))
    i = jnp.arange(sub)
    incl = (i[:, None] >= i[None, :])[..., None]
    diag_decay = jnp.exp(jnp.where(incl, g[..., :, None, :] - g[..., None, :, :], -jnp.inf))  # [B,H,n,s,s,d]
    on_diag = jnp.eye(n, dtype=gamma.dtype)[:, None, :, None]  # tile I's own columns
    out = []
    for a in queries:
        off = jnp.einsum("bhnid,bhnjd->bhnij", tiles(a) * jnp.exp(g - ref), k_to_ref, precision=_HI)
        diag = jnp.einsum("bhnid,bhnjd,bhnijd->bhnij", tiles(a), tiles(k), diag_decay, precision=_HI)
        full = off.reshape(b, h, n, sub, n, sub) + diag[:, :, :, :, None, :] * on_diag
        out.append(full.reshape(b, h, c, c))
    return tuple(out)


def _kda_chunk_step(state, inp, *, chunk_size):
    q, k, v, g, beta = inp[:5]  # [B, H, C, d], beta [B, H, C]
    doc = inp[5] if len(inp) == 6 else None  # [B, C] document index within the chunk, or None
    c = chunk_size
    gamma = jnp.cumsum(g, axis=2)  # [B, H, C, dk], non-increasing
    i = jnp.arange(c)
    strict = i[:, None] > i[None, :]
    sub = _subchunk(c)
    kk, attn = decayed_products((k, q), k, gamma, sub)  # zero above the diagonal
    if doc is not None:  # pairs of different documents never interact
        same_doc = (doc[:, :, None] == doc[:, None, :])[:, None]  # [B, 1, i, j]
        strict = strict & same_doc
        attn = jnp.where(same_doc, attn, 0.0)
    lower = jnp.where(strict, beta[..., :, None] * kk, 0.0)
    u, w = _unit_lower_solve(lower, (beta[..., None] * v, beta[..., None] * k * jnp.exp(gamma)), sub)
    q_decayed = q * jnp.exp(gamma)
    last = gamma[:, :, -1:, :]  # Γ_C
    k_to_end = k * jnp.exp(last - gamma)
    state_kept = jnp.exp(last[:, :, 0, :])[..., None] * state
    if doc is not None:
        # a document that began inside the chunk starts from zero: its rows neither predict
        # from nor read the incoming state; the next chunk gets only the last document's state
        carried = (doc == 0)[:, None, :, None]
        w = jnp.where(carried, w, 0.0)
        q_decayed = jnp.where(carried, q_decayed, 0.0)
        k_to_end = jnp.where((doc == doc[:, -1:])[:, None, :, None], k_to_end, 0.0)
        state_kept = jnp.where((doc[:, -1] == 0)[:, None, None, None], state_kept, 0.0)
    pseudo_v = u - jnp.einsum("bhck,bhkv->bhcv", w, state, precision=_HI)
    out = (jnp.einsum("bhck,bhkv->bhcv", q_decayed, state, precision=_HI)
           + jnp.einsum("bhij,bhjv->bhiv", attn, pseudo_v, precision=_HI))
    new_state = state_kept + jnp.einsum("bhck,bhcv->bhkv", k_to_end, pseudo_v, precision=_HI)
    return new_state, out


def _unit_lower_solve(strict_lower, rhs: tuple, sub: int):
    """`(I + L)^{-1} r` for strictly lower-triangular L `[..., C, C]` and each r in `rhs`, by
    block forward substitution over `sub`-row tiles: the diagonal tiles are inverted by a
    short row loop (all tiles at once), the rest is matmuls.

    Plain XLA on purpose: `lax.linalg.triangular_solve` is a LAPACK call on CPU, whose time
    varied 3x from call to call when the machine's cores were shared; a row loop over the whole
    chunk replays C steps in the backward pass; doubling products `(I - L)(I + L^2)...` lose
    fp32 precision when L has large entries. This form was as fast as the best LAPACK run."""
    widths = [r.shape[-1] for r in rhs]
    stacked = jnp.concatenate(rhs, axis=-1)
    c = strict_lower.shape[-1]
    n = c // sub
    tiles = strict_lower.reshape(*strict_lower.shape[:-2], n, sub, n, sub)
    diag = jnp.stack([tiles[..., i, :, i, :] for i in range(n)], axis=-3)  # [..., n, s, s]
    eye = jnp.broadcast_to(jnp.eye(sub, dtype=stacked.dtype), diag.shape)

    def row(i, inv):
        inv_i = eye[..., i, :] - jnp.einsum("...j,...jd->...d", diag[..., i, :], inv, precision=_HI)
        return inv.at[..., i, :].set(inv_i)

    diag_inv = jax.lax.fori_loop(0, sub, row, jnp.zeros_like(eye))
    solved = []
    for i in range(n):
        r = stacked[..., i * sub:(i + 1) * sub, :]
        for j in range(i):
            r = r - jnp.einsum("...ij,...jd->...id", tiles[..., i, :, j, :], solved[j], precision=_HI)
        solved.append(jnp.einsum("...ij,...jd->...id", diag_inv[..., i, :, :], r, precision=_HI))
    x = jnp.concatenate(solved, axis=-2)
    return tuple(jnp.split(x, np.cumsum(widths)[:-1], axis=-1))


def kda_mask_padding(
    valid: Bool[Array, "B T"], g: Float[Array, "B T H dk"], beta: Float[Array, "B T H"]
) -> tuple[Float[Array, "B T H dk"], Float[Array, "B T H"]]:
    """Make padded positions identity steps: g = 0 (no decay) and β = 0 (no write)."""
    return (jnp.where(valid[:, :, None, None], g, 0.0), jnp.where(valid[:, :, None], beta, 0.0))
