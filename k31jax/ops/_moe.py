"""Dropless routed experts as named stages: permute, grouped matmul, combine.

Expert weights are stacked `[E, out, in]` (the release orientation; blocks of a packed MXFP4
weight run along `in`). A weight is either a float array or an `MXFP4Weight`
(packed uint8 `[E, out, in/2]` + E8M0 scale bytes `[E, out, in/32]`), dequantised inside the
jitted graph right before its matmul, so the packed bytes are what lives in memory.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..kernels import mxfp4_matmul, runs_mosaic
from ..quant import fake_quant as fake_quant_weight
from ..quant import MXFP4Weight, mx_fake_quant_activations, mxfp4_dequantize_packed
from ._activations import glu
from ._impl import MOE_FORMS, ImplChoice, MoeForm, kernel_or_reference, resolve_impl


ExpertWeight = Array | MXFP4Weight


class ExpertAdapter(NamedTuple):
    """Low-rank factors beside one stacked expert weight `[E, out, in]` (LoRA on packed
    experts, left unmerged): `W_e x + a_e (b_e x)` with `a [E, out, r]` (its LoRA scale
    folded in) and `b [E, r, in]`, float. Both are `[E, out', in']` weights themselves, so the
    grouped forms run them as two more grouped matmuls of width r."""

    a: Array
    b: Array


def materialize(w: ExpertWeight, dtype, fake_quant: bool = False) -> Array:
    """The float value of an expert weight: MXFP4 is dequantised in-graph; with `fake_quant`
    a float weight is quantise-dequantised to MXFP4 along `in` (QAT, straight-through grad)."""
    if isinstance(w, MXFP4Weight):
        w = w.layer()
        return mxfp4_dequantize_packed(w.codes(), w.scales(), dtype=dtype)
    if fake_quant:
        return fake_quant_weight(w, "e2m1", "floor").astype(dtype)
    return w.astype(dtype)


def take_experts(w: ExpertWeight, idx: Int[Array, "..."]) -> ExpertWeight:
    """Gather the experts `idx` along the leading axis, keeping the storage format."""
    if isinstance(w, MXFP4Weight):
        w = w.layer()
        return w.with_arrays(w.packed[idx], w.scale[idx])
    return w[idx]


def permute(
    x: Float[Array, "N D"], idx: Int[Array, "N K"], num_experts: int
) -> tuple[Float[Array, "M D"], Int[Array, "M"], Int[Array, "E"]]:
    """Sort the N·K (token, expert) assignments by expert: rows, their order, group sizes."""
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return x[order // k], order, group_sizes


RAGGED_DOT_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def mxfp4_kernel_or_reference(impl: str, kernel, reference):
    """`kernel_or_reference` for the packed-MXFP4 grouped matmul: the Mosaic kernel differentiates
    itself (its transposed kernel, `kernels.mxfp4_matmul`), the Triton kernel as `reference`."""
    return kernel_or_reference("mxfp4_gmm", impl, kernel, reference, grad=not runs_mosaic(impl))


def grouped_matmul(
    x_sorted: Float[Array, "M in"], w: ExpertWeight, group_sizes: Int[Array, "E"],
    weight_fake_quant: bool = False,
    *,
    impl: ImplChoice | None = "xla",
    mxfp8_activations: bool = False,
) -> Float[Array, "M out"]:
    """`y_m = W_{e(m)} x_m` for rows sorted by expert, via `lax.ragged_dot_general` (f32 acc).

    impl (see `_impl.resolve_impl`): "xla" (the default here; `routed_experts` chooses) is
    this path; "pallas" / "interpret" the in-kernel-dequantising grouped matmul of
    `k31jax.kernels.mxfp4_matmul` for an `MXFP4Weight` (float weights stay on this path).
    `mxfp8_activations`: x holds MXFP8 values, which a TPU kernel may multiply in fp8
    (`kernels.mxfp4_matmul.mxu_inputs`); no effect on this path.
    """
    impl = resolve_impl(impl, "mxfp4_gmm", supported=isinstance(w, MXFP4Weight))
    if impl != "xla" and isinstance(w, MXFP4Weight):
        return mxfp4_kernel_or_reference(
            impl, functools.partial(mxfp4_matmul.grouped_matmul, impl=impl, mxfp8_activations=mxfp8_activations),
            functools.partial(grouped_matmul, impl="xla"))(x_sorted, w, group_sizes)
    w = materialize(w, x_sorted.dtype, weight_fake_quant)
    y = jax.lax.ragged_dot_general(x_sorted, w, group_sizes, RAGGED_DOT_DIMS,
                                   preferred_element_type=jnp.float32)
    return y.astype(x_sorted.dtype)


# Below this many (token, expert) assignments per expert, packed experts are read one chosen
# expert at a time ("selected"; "gather" on CPU) instead of every expert at once ("ragged",
# which decodes whole stacks; "blocked" on CPU). A few tokens per row leave most of them at
# below one: a decode step, and a speculative verify step (K3.1 Pro, batch 8 x 9 tokens: 1,152
# assignments of 896 experts; the ragged form made its traffic 297 GB per chip against a
# 31 GB floor, benchmarks/RESULTS.md "## compile"). On CPU the blocked form pads every
# expert's rows to a block, so there too a few tokens computed 2x what gathering their experts
# does: embedded model (32 experts, top-4), ms per forward pass, blocked vs gather: 32
# assignments 8.7 vs 4.6, 36: 8.9 vs 4.4, 68: 8.7 vs 7.3, 288: 18 vs 43.
FEW_ASSIGNMENTS_PER_EXPERT = 4

# (mean rows per expert below which, block) for the "blocked" path; 256 above the last.
# Measured on CPU by benchmarks/moe_blocks.py (RESULTS.md "## moe_blocks"): 32 is fastest up
# to ~32 rows per expert, 64 from 64 to 256 (up to 1.4x faster than 32), 128 or 256 at 1,024
# (about 2x).
_BLOCK_BY_MEAN_ROWS = ((48, 32), (768, 64))


def blocked_rows(assignments: int, num_experts: int) -> int:
    """The row block of `grouped_matmul_blocked` for `assignments` (token, expert) rows."""
    mean = assignments / num_experts
    return next((block for below, block in _BLOCK_BY_MEAN_ROWS if mean < below), 256)


def grouped_matmul_blocked(
    x_sorted: Float[Array, "M in"], w: ExpertWeight, group_sizes: Int[Array, "E"],
    weight_fake_quant: bool = False, block: int = 32,
) -> Float[Array, "M out"]:
    """The same product as `grouped_matmul`, over row blocks that each belong to one expert
    (groups padded to a multiple of `block`): one batched matmul of the blocks against their
    experts' weights.

    XLA:CPU lowers `ragged_dot` to roughly one dense matmul per group over all rows (E times
    the work), and a loop over the blocks pays a loop step per block in both passes (its
    autodiff also adds a full `[E, out, in]` gradient per block); gathering each block's
    expert weight costs one weight-sized copy and turns forward and backward into batched
    matmuls and one scatter-add, so this is the CPU default.
    """
    m = x_sorted.shape[0]
    w = materialize(w, x_sorted.dtype, weight_fake_quant)
    e = w.shape[0]
    padded = -(-group_sizes // block) * block
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    start = jnp.cumsum(group_sizes) - group_sizes
    row_expert = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")
    dest = pad_start[row_expert] + jnp.arange(m) - start[row_expert]
    n_blocks = -(-(m + e * (block - 1)) // block)
    x_pad = jnp.zeros((n_blocks * block, x_sorted.shape[1]), x_sorted.dtype).at[dest].set(x_sorted)
    # tail blocks past the last group hold zero rows; they take the last expert's weight
    block_expert = jnp.minimum(jnp.searchsorted(pad_end, jnp.arange(n_blocks) * block, side="right"), e - 1)
    y = jnp.einsum("nbi,noi->nbo", x_pad.reshape(n_blocks, block, -1), w[block_expert],
                   preferred_element_type=jnp.float32).astype(x_sorted.dtype)
    return y.reshape(n_blocks * block, -1)[dest]


def expert_window(num_tokens: int, assignments: int) -> int:
    """Rows one expert can receive: a token picks an expert at most once."""
    return max(1, min(num_tokens, assignments))


def one_expert(w: ExpertWeight, e: Int[Array, ""]) -> ExpertWeight:
    """Expert `e` of a stacked weight (`[out, in]`), keeping the storage format; a weight that
    is a row of a layer stack is sliced at `[row, e]` from the stack itself."""
    if isinstance(w, MXFP4Weight):
        at = (e,) if w.row is None else (w.row, e)

        def take(a):
            return jax.lax.dynamic_slice(a, at + (0,) * (a.ndim - len(at)),
                                         (1,) * len(at) + a.shape[len(at):]).reshape(a.shape[len(at):])

        return w.with_arrays(take(w.packed), take(w.scale))
    return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)


def visit_selected_experts(
    x_sorted: Float[Array, "M in"], group_sizes: Int[Array, "E"], window: int, expert_rows, out_dim: int,
    out_dtype,
) -> Float[Array, "M out"]:
    """`expert_rows(x_window, e)` for every expert `e` that has rows, one expert per loop trip.

    Rows are sorted by expert; each trip takes the `window` rows from expert e's first one
    (`window` bounds any expert's row count, see `expert_window`), and keeps the results of
    its own rows. Only chosen experts are visited, so a caller that decodes each expert's
    weight inside `expert_rows` holds one expert in float at a time and reads no other
    expert's bytes: decode at batch 8 touches ~128 of K3.1's 896 experts, not all of them.
    Groups padded past `M` (rows of the padding expert `E`) are never visited.
    """
    m = x_sorted.shape[0]
    e_count = group_sizes.shape[0]
    used = group_sizes > 0
    ids = jnp.nonzero(used, size=e_count, fill_value=0)[0]
    starts = jnp.cumsum(group_sizes) - group_sizes
    x_pad = jnp.concatenate([x_sorted, jnp.zeros((window,) + x_sorted.shape[1:], x_sorted.dtype)])
    keep = jnp.arange(window)

    def trip(j, y):
        e = ids[j]
        start = starts[e]
        rows = jax.lax.dynamic_slice_in_dim(x_pad, start, window)
        out = expert_rows(rows, e).astype(out_dtype)
        old = jax.lax.dynamic_slice_in_dim(y, start, window)
        new = jnp.where((keep < group_sizes[e])[:, None], out, old)
        return jax.lax.dynamic_update_slice_in_dim(y, new, start, axis=0)

    y = jnp.zeros((m + window, out_dim), out_dtype)
    with jax.named_scope("selected_experts"):
        y = jax.lax.fori_loop(0, jnp.sum(used.astype(jnp.int32)), trip, y)
    return y[:m]


def combine(
    y_sorted: Float[Array, "M d"], order: Int[Array, "M"], weights: Float[Array, "N K"]
) -> Float[Array, "N d"]:
    """Undo the sort and take the routing-weighted sum per token, accumulated in fp32."""
    n, k = weights.shape
    y = jnp.zeros((n * k, y_sorted.shape[-1]), jnp.float32).at[order].set(y_sorted.astype(jnp.float32))
    return jnp.einsum("nk,nkd->nd", weights.astype(jnp.float32), y.reshape(n, k, -1),
                      precision=jax.lax.Precision.HIGHEST)


def routed_experts(
    x: Float[Array, "N d"],
    idx: Int[Array, "N K"],
    weights: Float[Array, "N K"],
    w_gate: ExpertWeight,
    w_up: ExpertWeight,
    w_down: ExpertWeight,
    *,
    hidden_act: str = "situ",
    beta_gate: float = 4.0,
    beta_up: float | None = 25.0,
    form: MoeForm = "auto",
    kernels: ImplChoice | None = None,
    weight_fake_quant: bool = False,
    activation_fake_quant: bool = False,
    adapters: tuple[ExpertAdapter | None, ExpertAdapter | None, ExpertAdapter | None] | None = None,
) -> Float[Array, "N d"]:
    """`Σ_k p_k · w_down_e(act(w_gate_e x, w_up_e x))` over each token's chosen experts (fp32).

    Weights are float `[E, out, in]` or `MXFP4Weight`. `weight_fake_quant` fake-quantises
    float weights to MXFP4 (QAT); `activation_fake_quant` rounds each GEMM input to MXFP8
    (E4M3, rceil scales, blocks of 32 along the contraction axis).

    form="ragged": dropless sort + `ragged_dot` over all experts (prefill, training on GPU/TPU).
    form="blocked": the same sort, then one batched matmul over expert-homogeneous row blocks
    of `blocked_rows` rows (CPU).
    form="gather": gather each assignment's weights and run a batched matmul; reads only the
    chosen experts, which is what decode with few tokens wants on CPU.
    form="selected": the same sort, then a loop over the chosen experts only, each expert's
    weight decoded (bf16) right before its rows' matmuls (`visit_selected_experts`): what
    decode wants on an accelerator, where the gather form copies and decodes a weight per
    assignment. Not reverse-differentiable (a dynamic loop); training uses float experts.
    form="auto": for MXFP4 weights, whenever the kernel seam `kernels` resolves to a kernel
    (`_impl.resolve_impl`: None / "auto" picks it on a GPU; "pallas" / "interpret" force it),
    the same sort, then the Pallas MXFP4 grouped matmul of `k31jax.kernels.mxfp4_matmul`
    (gate and up fused in one launch); otherwise, for packed experts with fewer than
    `FEW_ASSIGNMENTS_PER_EXPERT` assignments per expert, "gather" on CPU and "selected" on other
    platforms; for float experts with fewer assignments than experts, "gather"
    (chosen at lowering, `lax.platform_dependent`, so a TPU program compiled on a CPU host gets
    it); else "blocked" on CPU and "ragged" elsewhere. The named forms are XLA paths.

    adapters (gate, up, down; each None or an `ExpertAdapter`): LoRA factors added beside the
    weights, in the same form as the weights' own products ("ragged", "blocked", "gather";
    "auto" takes the gather form where it would visit the selected experts, and no kernel).
    """
    if form not in MOE_FORMS:
        raise ValueError(f"routed_experts form={form!r}: expected one of {MOE_FORMS}")
    adapters = adapters if adapters is not None and any(a is not None for a in adapters) else None
    if adapters is not None and form == "selected":
        raise ValueError("routed_experts form='selected' has no expert adapters: use 'gather' or 'ragged'")
    n, k = idx.shape
    options = dict(hidden_act=hidden_act, beta_gate=beta_gate, beta_up=beta_up, kernels=kernels,
                   weight_fake_quant=weight_fake_quant, activation_fake_quant=activation_fake_quant,
                   adapters=adapters)
    packed = all(isinstance(w, MXFP4Weight) for w in (w_gate, w_up, w_down))
    num_experts = w_gate.shape[0]
    kernel = "xla"  # the grouped matmuls' implementation: a kernel for packed experts under "auto" only
    if form == "auto":
        if packed and adapters is None:
            kernel = resolve_impl(kernels, "mxfp4_gmm")
        if kernel != "xla":
            form = "ragged"  # the ragged form's sort, the kernel's grouped matmul
        elif packed and n * k < FEW_ASSIGNMENTS_PER_EXPERT * num_experts:
            if adapters is not None:
                return routed_experts(x, idx, weights, w_gate, w_up, w_down, form="gather", **options)
            return jax.lax.platform_dependent(
                x, idx, weights, w_gate, w_up, w_down,
                cpu=functools.partial(routed_experts, form="gather", **options),
                default=functools.partial(routed_experts, form="selected", **options))
        elif n * k < num_experts:
            form = "gather"
        else:
            # XLA:CPU's ragged_dot does ~E dense matmuls; worth avoiding once they are big
            big = num_experts * n * k * x.shape[-1] * w_gate.shape[1] > 1 << 26
            form = "blocked" if big and jax.default_backend() == "cpu" else "ragged"

    def act(g, u):
        return glu(g, u, hidden_act, beta_gate, beta_up)

    if form != "selected" and kernel == "xla":  # every other XLA form reads whole layers; a kernel reads stacks
        w_gate, w_up, w_down = (w.layer() if isinstance(w, MXFP4Weight) else w for w in (w_gate, w_up, w_down))

    def qin(a):
        return mx_fake_quant_activations(a, "e4m3", "rceil").astype(a.dtype) if activation_fake_quant else a

    if kernel != "xla":
        xs, order, sizes = permute(x, idx, num_experts)
        xs = qin(xs)
        g, u = mxfp4_kernel_or_reference(
            kernel, functools.partial(mxfp4_matmul.grouped_matmul_gate_up, impl=kernel,
                                      mxfp8_activations=activation_fake_quant),
            lambda xs_, wg, wu, s: (grouped_matmul(xs_, wg, s), grouped_matmul(xs_, wu, s)))(xs, w_gate, w_up, sizes)
        y = grouped_matmul(qin(act(g, u)), w_down, sizes, weight_fake_quant, impl=kernel,
                           mxfp8_activations=activation_fake_quant)
        return combine(y, order, weights)
    if form in ("ragged", "blocked"):
        xs, order, sizes = permute(x, idx, num_experts)
        xs = qin(xs)
        if form == "ragged":
            matmul = grouped_matmul
        else:
            matmul = functools.partial(grouped_matmul_blocked, block=blocked_rows(n * k, num_experts))

        def gmm(inp, w, adapter):
            y = matmul(inp, w, sizes, weight_fake_quant)
            if adapter is None:
                return y
            return y + matmul(matmul(inp, adapter.b, sizes), adapter.a, sizes)

        ad_gate, ad_up, ad_down = adapters or (None, None, None)
        h = act(gmm(xs, w_gate, ad_gate), gmm(xs, w_up, ad_up))
        return combine(gmm(qin(h), w_down, ad_down), order, weights)
    if form == "selected":
        xs, order, sizes = permute(x, idx, num_experts)

        def expert_rows(rows, e):
            def mm(inp, w):
                wf = materialize(one_expert(w, e), inp.dtype, weight_fake_quant)
                return jnp.einsum("wi,oi->wo", inp, wf, preferred_element_type=jnp.float32).astype(inp.dtype)

            rows = qin(rows)
            return mm(qin(act(mm(rows, w_gate), mm(rows, w_up))), w_down)

        d_out = w_down.shape[1]
        y = visit_selected_experts(xs, sizes, expert_window(n, n * k), expert_rows, d_out, x.dtype)
        return combine(y, order, weights)
    # form == "gather"
    flat = idx.reshape(-1)
    xs = qin(jnp.repeat(x, k, axis=0))

    def gathered(inp, w, fake_quant=False):
        if fake_quant:  # quantise each expert once, before the per-assignment gather
            w = materialize(w, inp.dtype, fake_quant=True)
        wm = materialize(take_experts(w, flat), inp.dtype)
        return jnp.einsum("mi,moi->mo", inp, wm, preferred_element_type=jnp.float32).astype(inp.dtype)

    def bmm(inp, w, adapter):
        y = gathered(inp, w, weight_fake_quant)
        return y if adapter is None else y + gathered(gathered(inp, adapter.b), adapter.a)

    ad_gate, ad_up, ad_down = adapters or (None, None, None)
    h = act(bmm(xs, w_gate, ad_gate), bmm(xs, w_up, ad_up))
    y = bmm(qin(h), w_down, ad_down).astype(jnp.float32).reshape(n, k, -1)
    return jnp.einsum("nk,nkd->nd", weights.astype(jnp.float32), y, precision=jax.lax.Precision.HIGHEST)
