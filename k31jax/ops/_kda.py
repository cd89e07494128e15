"""Kimi Delta Attention: short conv, gates, and the delta-rule recurrence. Spec kda.md.

Layouts: activations `[B, T, H, d]`; the recurrent state is key-major `[B, H, dk, dv]` fp32.
Everything from the gates to the state runs in fp32; callers cast the output back.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ._impl import resolve_impl, with_reference_grad

_HI = jax.lax.Precision.HIGHEST
KERNEL_CHUNK_SIZES = (16, 32, 64, 128)  # the chunk sizes the Pallas kernel takes


def short_conv(
    x: Float[Array, "B T C"],
    weight: Float[Array, "K C"],
    history: Float[Array, "B Km1 C"] | None = None,
) -> tuple[Float[Array, "B T C"], Float[Array, "B Km1 C"]]:
    """Causal depthwise conv: `y_t = Σ_j w[j] · in_{t-K+1+j}` (tap K-1 is the current token).

    `history` holds the K-1 previous *pre-conv* inputs, oldest first (zeros when None). Returns
    the fp32 output (no activation) and the new history (the last K-1 inputs).
    """
    k = weight.shape[0]
    b, t, c = x.shape
    if history is None:
        history = jnp.zeros((b, k - 1, c), jnp.float32)
    full = jnp.concatenate([history.astype(jnp.float32), x.astype(jnp.float32)], axis=1)
    w = weight.astype(jnp.float32)
    y = sum(w[j] * full[:, j:j + t] for j in range(k))
    return y, full[:, t:]


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
    impl: str | None = None,
) -> tuple[Float[Array, "B T H dv"], Float[Array, "B H dk dv"]]:
    """The delta rule one token at a time (kda.md §4): decay, read, write, then read out.

    q and k are used as given (already L2-normalised, q scaled). Used for decode steps; fp32.
    impl (see `_impl.resolve_impl`): "xla" is this scan; "pallas" / "interpret" the fused
    decode-step kernel of `k31jax.kernels.kda_chunk`; None / "auto" the kernel on a GPU.
    """
    impl = resolve_impl(impl)
    if impl != "xla":
        from ..kernels.kda_chunk import kda_recurrent as kernel

        return with_reference_grad(functools.partial(kernel, impl=impl),
                                   functools.partial(kda_recurrent, impl="xla"))(q, k, v, g, beta, initial_state)
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    state = _zero_state(b, h, dk, dv) if initial_state is None else initial_state
    xs = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]

    def step(s, inp):
        qt, kt, vt, gt, bt = inp
        s = s * jnp.exp(gt)[..., None]
        read = jnp.einsum("bhkv,bhk->bhv", s, kt, precision=_HI)
        s = s + jnp.einsum("bhk,bhv->bhkv", kt * bt[..., None], vt - read, precision=_HI)
        return s, jnp.einsum("bhkv,bhk->bhv", s, qt, precision=_HI)

    state, o = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), state


def kda_chunked(
    q: Float[Array, "B T H dk"],
    k: Float[Array, "B T H dk"],
    v: Float[Array, "B T H dv"],
    g: Float[Array, "B T H dk"],
    beta: Float[Array, "B T H"],
    initial_state: Float[Array, "B H dk dv"] | None = None,
    chunk_size: int = 64,
    *,
    impl: str | None = None,
    lower_bound: float | None = None,
) -> tuple[Float[Array, "B T H dv"], Float[Array, "B H dk dv"]]:
    """Chunked WY/UT form of `kda_recurrent` (kda.md §5), for prefill and training.

    Any T: the tail is padded with zeros for q, k, v, g and β, which is an exact identity
    step (α = 1, k = 0, β = 0). Pairwise decays are materialised per chunk as
    `exp(where(j ≤ i, Γ_i − Γ_j, −inf))`, which never overflows whatever the gate (kda.md §6a).

    impl (see `_impl.resolve_impl`): "xla" is this path; "pallas" / "interpret" the kernel of
    `k31jax.kernels.kda_chunk` (chunk sizes 16-128); None / "auto" the kernel on a GPU.
    `lower_bound` (the gate's bound, None for softplus) only lets the kernel factor its
    diagonal sub-chunk tiles (kda.md §6b); this path ignores it.
    """
    impl = resolve_impl(impl, supported=chunk_size in KERNEL_CHUNK_SIZES)
    if impl != "xla":
        from ..kernels.kda_chunk import kda_chunked as kernel

        return with_reference_grad(
            functools.partial(kernel, chunk_size=chunk_size, lower_bound=lower_bound, impl=impl),
            functools.partial(kda_chunked, chunk_size=chunk_size, impl="xla"))(q, k, v, g, beta, initial_state)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t

    def chunks(a):
        a = a.astype(jnp.float32)
        if pad:
            a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(b, n, c, *a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)  # [n, B, H, C, ...]

    qc, kc, vc, gc = (chunks(a) for a in (q, k, v, g))
    bc = chunks(beta)  # [n, B, H, C]
    state = _zero_state(b, h, dk, dv) if initial_state is None else initial_state
    body = functools.partial(_kda_chunk_step, chunk_size=c)
    state, o = jax.lax.scan(body, state.astype(jnp.float32), (qc, kc, vc, gc, bc))
    o = jnp.moveaxis(o, 0, 1)  # [B, n, H, C, dv]
    o = jnp.moveaxis(o, 2, 3).reshape(b, n * c, h, dv)
    return o[:, :t], state


def _kda_chunk_step(state, inp, *, chunk_size):
    q, k, v, g, beta = inp  # [B, H, C, d], beta [B, H, C]
    c = chunk_size
    gamma = jnp.cumsum(g, axis=2)  # [B, H, C, dk], non-increasing
    i = jnp.arange(c)
    incl = i[:, None] >= i[None, :]  # j <= i
    diff = gamma[:, :, :, None, :] - gamma[:, :, None, :, :]  # [B, H, i, j, dk]
    decay = jnp.exp(jnp.where(incl[..., None], diff, -jnp.inf))
    kk = jnp.einsum("bhid,bhjd,bhijd->bhij", k, k, decay, precision=_HI)
    strict = i[:, None] > i[None, :]
    lower = jnp.where(strict, beta[..., :, None] * kk, 0.0)
    u = _unit_lower_solve(lower, beta[..., None] * v)
    w = _unit_lower_solve(lower, beta[..., None] * k * jnp.exp(gamma))
    pseudo_v = u - jnp.einsum("bhck,bhkv->bhcv", w, state, precision=_HI)
    attn = jnp.einsum("bhid,bhjd,bhijd->bhij", q, k, decay, precision=_HI)
    out = (jnp.einsum("bhck,bhkv->bhcv", q * jnp.exp(gamma), state, precision=_HI)
           + jnp.einsum("bhij,bhjv->bhiv", attn, pseudo_v, precision=_HI))
    last = gamma[:, :, -1:, :]  # Γ_C
    new_state = (jnp.exp(last[:, :, 0, :])[..., None] * state
                 + jnp.einsum("bhck,bhcv->bhkv", k * jnp.exp(last - gamma), pseudo_v, precision=_HI))
    return new_state, out


def _unit_lower_solve(strict_lower, rhs):
    """`(I + L)^{-1} rhs` for strictly lower-triangular L, by forward substitution over rows."""
    n = strict_lower.shape[-1]

    def row(i, x):
        xi = rhs[..., i, :] - jnp.einsum("...j,...jd->...d", strict_lower[..., i, :], x, precision=_HI)
        return x.at[..., i, :].set(xi)

    return jax.lax.fori_loop(0, n, row, jnp.zeros_like(rhs))


def kda_mask_padding(
    valid: Bool[Array, "B T"], g: Float[Array, "B T H dk"], beta: Float[Array, "B T H"]
) -> tuple[Float[Array, "B T H dk"], Float[Array, "B T H"]]:
    """Make padded positions identity steps: g = 0 (no decay) and β = 0 (no write)."""
    return (jnp.where(valid[:, :, None, None], g, 0.0), jnp.where(valid[:, :, None], beta, 0.0))
