"""Expert-parallel routed experts under `jax.shard_map`.

Stages (per device, inside the shard_map), for tokens split over the expert-parallel axes:

1. **sort**: the n·K (token, expert) assignments by global expert id, so the rows bound for
   each expert-parallel peer are contiguous (experts are split contiguously over peers);
2. **dispatch**: a ragged exchange sends each peer its rows and their expert ids;
3. **local grouped matmul**: received rows are sorted by local expert and run through
   `ragged_dot` with the local (bf16, or packed MXFP4 dequantised in-graph) weights; the
   expert intermediate may be split over the tensor axes;
4. **return**: the reverse exchange sends every row's output back to where it came from;
5. **combine**: routing-weighted sum per token in fp32, then `psum` over the tensor axes.

The latent RMSNorm is applied by the caller on the result, i.e. after the cross-device
reduction. Nothing is ever dropped: receive buffers hold the worst case (every row of every
peer routed to one device). That worst case is `ep_size` times a device's own assignments, so
for many tokens (a training micro-batch) stages 1-5 run in **rounds** over slices of the
tokens (`exchange_rounds`), each rematerialised in the backward pass: the worst-case buffers,
their sorted copies and their cotangents then exist for one round at a time.

The exchange is one seam with three implementations of the same ragged all-to-all
semantics (`jax.lax.ragged_all_to_all`): "ragged" (the primitive; GPU/TPU only, XLA:CPU has
no lowering), "dense" (a capacity-padded dense `all_to_all`) and "allgather" (all-gather
plus local masking). All three move the same bytes to the same places, so their results are
bit-identical.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..kernels import mxfp4_matmul
from ..quant import MXFP4KernelWeight, MXFP4Weight, mx_fake_quant_activations, mxfp4_dequantize_packed
from ..sharding import current_rules, inside_manual, logical_to_spec, spec_axes
from ._activations import glu
from ._impl import ImplChoice, resolve_impl
from ._moe import (FEW_ASSIGNMENTS_PER_EXPERT, RAGGED_DOT_DIMS, ExpertAdapter, expert_window, materialize,
                   mxfp4_kernel_or_reference, one_expert, visit_selected_experts)

EXCHANGES = ("ragged", "dense", "allgather")
_HI = jax.lax.Precision.HIGHEST
# A round's worst-case fp32 receive buffer at most (`exchange_rounds`): at K3.1 Pro's widths a
# 2,048-token prefill chunk on 8 expert groups is one round, a 64 x 1,024 training micro-batch
# on 64 token shards four (each round's backward holds a few such buffers).
ROUND_BYTES = 512 * 2**20


def default_exchange() -> str:
    """`ragged_all_to_all` on GPU/TPU, the dense all_to_all elsewhere (XLA:CPU)."""
    return "ragged" if jax.devices()[0].platform in ("gpu", "cuda", "rocm", "tpu") else "dense"


# --------------------------------------------------------------------------- the exchange
def _excl_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _axis(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                    axis_name, exchange: str):
    """`jax.lax.ragged_all_to_all` semantics, by `exchange` ("ragged" | "dense" | "allgather").

    For every peer j, rows `operand[input_offsets[j] : + send_sizes[j]]` land in peer j's
    `output` at `output_offsets[j]` (an offset chosen by the sender); `recv_sizes[j]` is what
    this device gets from j. Rows of `output` nobody writes keep their value.
    """
    if exchange == "ragged":
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                         recv_sizes, axis_name=axis_name)
    a = operand.shape[0]
    j = jnp.arange(a, dtype=jnp.int32)
    trail = (1,) * (operand.ndim - 1)
    oob = output.shape[0]  # scatter index that `mode="drop"` discards
    if exchange == "dense":
        # slab[d, i] = operand[input_offsets[d] + i] for i < send_sizes[d]: capacity a per peer
        src = input_offsets[:, None] + j[None, :]
        ok = j[None, :] < send_sizes[:, None]
        slab = jnp.where(ok.reshape(ok.shape + trail), operand[jnp.clip(src, 0, a - 1)], 0)
        got = jax.lax.all_to_all(slab, axis_name, 0, 0, tiled=True)           # got[s] = slab_s[me]
        where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # offsets s chose for me
        dst = jnp.where(j[None, :] < recv_sizes[:, None], where[:, None] + j[None, :], oob)
        return output.at[dst.reshape(-1)].set(got.reshape((-1,) + operand.shape[1:]), mode="drop")
    if exchange == "allgather":
        me = jax.lax.axis_index(axis_name)
        ops = jax.lax.all_gather(operand, axis_name)                 # [P, a, ...]
        start = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # where s's rows for me begin
        size = jax.lax.all_gather(send_sizes, axis_name)[:, me]
        where = jax.lax.all_gather(output_offsets, axis_name)[:, me]
        ok = (j[None, :] >= start[:, None]) & (j[None, :] < (start + size)[:, None])
        dst = jnp.where(ok, where[:, None] + j[None, :] - start[:, None], oob)
        return output.at[dst.reshape(-1)].set(ops.reshape((-1,) + operand.shape[1:]), mode="drop")
    raise ValueError(f"exchange={exchange!r}: expected one of {EXCHANGES}")


# --------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class EPPlan:
    """Static description of one expert-parallel MoE call on the active mesh."""

    mesh: Any
    num_experts: int
    ep_axes: tuple[str, ...]      # mesh axes the expert index is split over
    tp_axes: tuple[str, ...]      # mesh axes the expert intermediate is split over
    token_axes: tuple[str, ...]   # mesh axes the tokens are split over inside the shard_map
    ep_size: int
    tp_size: int
    exchange: str
    scale_split: bool             # packed w_down scales split with the intermediate

    @property
    def token_shards(self) -> int:
        """How many ways the tokens are split inside the shard_map (over `token_axes`)."""
        return math.prod(dict(self.mesh.shape)[a] for a in self.token_axes)

    def weight_specs(self, w_gate, w_up, w_down):
        ep, tp = _entry(self.ep_axes), _entry(self.tp_axes)
        out = []
        for w, down in ((w_gate, False), (w_up, False), (w_down, True)):
            spec = P(ep, None, tp) if down else P(ep, tp, None)
            if isinstance(w, MXFP4KernelWeight):  # words `[E, in/8, out]`, scale `[E, splits, rows, out]`
                splits = w.scale.shape[-3]
                if down and splits != self.tp_size:
                    raise ValueError(f"w_down in the kernel layout holds its scale blocks in {splits} parts; "
                                     f"this mesh splits them {self.tp_size} ways (quant.kernel_layout(splits=))")
                words, scale = (P(ep, tp, None), P(ep, tp, None, None)) if down else (P(ep, None, tp), P(ep, None, None, tp))
                lead = (None,) if w.row is not None else ()
                out.append(MXFP4KernelWeight(P(*lead, *words), P(*lead, *scale), P() if w.row is not None else None))
            elif isinstance(w, MXFP4Weight):
                scale = spec if (not down or self.scale_split) else P(ep, None, None)
                if w.scale.dtype == jnp.uint16:  # tiled `[E, splits, rows, 128]`: the splits are the blocks'
                    scale = P(ep, scale[2], None, None)
                if w.row is not None:  # a row of a layer stack: the stack's layer axis stays whole
                    out.append(MXFP4Weight(P(None, *spec), P(None, *scale), P()))
                else:
                    out.append(MXFP4Weight(spec, scale))
            else:
                out.append(spec)
        return tuple(out)

    def adapter_specs(self, adapters):
        """Shard-map specs of `ExpertAdapter`s beside (gate, up, down): each factor split as
        the weight's axis it spans (experts; the intermediate `out` of gate / up and `in` of
        down over the tensor axes), its rank axis whole."""
        ep, tp = _entry(self.ep_axes), _entry(self.tp_axes)
        gate_up, down = ExpertAdapter(P(ep, tp, None), P(ep, None, None)), ExpertAdapter(P(ep, None, None),
                                                                                          P(ep, None, tp))
        return tuple(None if a is None else spec for a, spec in zip(adapters, (gate_up, gate_up, down)))


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _shape(w):
    return w.shape


def make_ep_plan(n_tokens: int, weights, *, exchange: str = "auto", mesh=None, rules=None) -> EPPlan | None:
    """The plan for `n_tokens` tokens and expert weights `(w_gate, w_up, w_down)` on the
    active (or given) mesh, or None when the rules split neither experts nor their width."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh.empty or inside_manual():
        return None
    shape = dict(mesh.shape)
    rules = rules or current_rules(shape)
    w_gate, _, w_down = weights
    e, i = _shape(w_gate)[:2]
    spec = logical_to_spec(("expert", "expert_mlp"), (e, i), shape, rules)
    ep_axes, tp_axes = spec_axes(spec, 0), spec_axes(spec, 1)
    tp = math.prod(shape[a] for a in tp_axes)
    if tp_axes and _shape(w_down)[-1] % tp:  # the packed contraction dim must split too
        tp_axes, tp = (), 1
    if not ep_axes and not tp_axes:
        return None
    if exchange == "auto":
        exchange = default_exchange()
    if exchange not in EXCHANGES:
        raise ValueError(f"ep={exchange!r}: expected 'auto', 'off' or one of {EXCHANGES}")
    batch = spec_axes(logical_to_spec(("batch",), (n_tokens,), shape, rules), 0)
    token_axes, prod = [], 1
    for ax in dict.fromkeys(batch + ep_axes):
        if ax not in tp_axes and shape[ax] > 1 and n_tokens % (prod * shape[ax]) == 0:
            token_axes.append(ax)
            prod *= shape[ax]
    scale_split = True
    if isinstance(w_down, MXFP4Weight):
        scale_split = (w_down.shape[-1] // 16) % tp == 0  # the scale blocks (32 codes, 16 bytes) split too
    return EPPlan(mesh, e, ep_axes, tp_axes, tuple(token_axes), math.prod(shape[a] for a in ep_axes), tp,
                  exchange, scale_split)


# --------------------------------------------------------------------------- local compute
def _local_float(w, dtype, plan: EPPlan, down: bool, fake_quant: bool):
    """The float value of this device's shard of an expert weight."""
    if not isinstance(w, MXFP4Weight):
        return materialize(w, dtype, fake_quant)
    w = w.layer()
    if not down or plan.scale_split:
        return mxfp4_dequantize_packed(w.codes(), w.scales(), dtype=dtype)
    # The intermediate is split finer than the 32-blocks: each byte (2 codes) takes the scale
    # of the block its global column falls in.
    half = w.shape[-1]
    r = jax.lax.axis_index(_axis(plan.tp_axes))
    cols = r * (2 * half) + 2 * jnp.arange(half)
    return mxfp4_dequantize_packed(w.codes(), jnp.take(w.scales(), cols // 32, axis=-1), dtype=dtype, block=2)


def _expert_rows(rows, local_e, n_local, w_gate, w_up, w_down, plan, *, local_form, window, hidden_act,
                 beta_gate, beta_up, weight_fake_quant, activation_fake_quant, kernel="xla", adapters=None):
    """Each row through its (local) expert; rows with local_e == n_local give zeros.

    local_form "ragged": one `ragged_dot` per weight over every local expert (prefill);
    "selected": a loop over the local experts some row chose (`visit_selected_experts`),
    each decoded where it is used (decode); "kernel": the MXFP4 grouped-matmul kernel `kernel`
    ("pallas" / "interpret" / "interpret_tpu"; gate and up in one launch), differentiated as
    the ragged form; "auto": "selected" off CPU, "ragged" on CPU (chosen at lowering).
    """
    if adapters is not None and local_form != "ragged":
        raise ValueError(f"expert adapters run in the ragged local form, not {local_form!r}")
    if local_form == "auto":
        def form(name):
            return lambda *a: _expert_rows(
                *a[:2], n_local, *a[2:], plan, local_form=name, window=window, hidden_act=hidden_act,
                beta_gate=beta_gate, beta_up=beta_up, weight_fake_quant=weight_fake_quant,
                activation_fake_quant=activation_fake_quant, kernel=kernel, adapters=adapters)

        return jax.lax.platform_dependent(rows, local_e, w_gate, w_up, w_down, cpu=form("ragged"),
                                          default=form("selected"))
    order = jnp.argsort(local_e, stable=True)
    sizes = jnp.bincount(local_e, length=n_local + 1)[:n_local].astype(jnp.int32)
    xs = rows[order]
    dt = rows.dtype
    # With the intermediate split, keep the partial sums in fp32 until the tensor psum.
    out_dt = jnp.float32 if plan.tp_size > 1 else dt

    def qin(a):
        return mx_fake_quant_activations(a, "e4m3", "rceil").astype(a.dtype) if activation_fake_quant else a

    def ragged(inp, w, sizes_, down, fake_quant):  # every local expert's rows at once, fp32
        wf = _local_float(w, inp.dtype, plan, down, fake_quant)
        return jax.lax.ragged_dot_general(inp, wf, sizes_, RAGGED_DOT_DIMS, preferred_element_type=jnp.float32)

    def gmm(inp, w, down=False, adapter=None):
        y = ragged(inp, w, sizes, down, weight_fake_quant)
        if adapter is not None:  # beside the weight: a (b x), partial over the tensor axes for down
            low = jax.lax.ragged_dot_general(inp, adapter.b.astype(inp.dtype), sizes, RAGGED_DOT_DIMS,
                                             preferred_element_type=jnp.float32)
            y = y + jax.lax.ragged_dot_general(low, adapter.a.astype(jnp.float32), sizes, RAGGED_DOT_DIMS,
                                               preferred_element_type=jnp.float32)
        return y.astype(out_dt if down else inp.dtype)

    def expert_rows(x_w, e):
        def mm(inp, w, down=False):
            wf = _local_float(one_expert(w, e), inp.dtype, plan, down, weight_fake_quant)
            y = jnp.einsum("wi,oi->wo", inp, wf, preferred_element_type=jnp.float32)
            return y.astype(out_dt if down else inp.dtype)

        x_w = qin(x_w)
        return mm(qin(glu(mm(x_w, w_gate), mm(x_w, w_up), hidden_act, beta_gate, beta_up)), w_down, down=True)

    if local_form == "kernel":
        xs = qin(xs)

        # the Triton kernel's gradients: the ragged form's (packed weights: nothing to fake-quantise)
        def gate_up_reference(x_, wg, wu, sizes_):
            return tuple(ragged(x_, w, sizes_, False, False).astype(x_.dtype) for w in (wg, wu))

        def down_reference(h_, wd, sizes_):
            return ragged(h_, wd, sizes_, True, False).astype(out_dt)

        # the receive buffer holds the worst case; a device gets its own share of rows on average
        mean_rows = rows.shape[0] // plan.ep_size

        def down_kernel(h_, wd, sizes_):
            return mxfp4_matmul.grouped_matmul(h_, wd, sizes_, impl=kernel, out_dtype=out_dt,
                                               expected_rows=mean_rows, mxfp8_activations=activation_fake_quant)

        g, u = mxfp4_kernel_or_reference(kernel, functools.partial(mxfp4_matmul.grouped_matmul_gate_up, impl=kernel,
                                                                   expected_rows=mean_rows,
                                                                   mxfp8_activations=activation_fake_quant),
                                         gate_up_reference)(xs, w_gate, w_up, sizes)
        h = qin(glu(g, u, hidden_act, beta_gate, beta_up))
        y = mxfp4_kernel_or_reference(kernel, down_kernel, down_reference)(h, w_down, sizes)
    elif local_form == "selected":
        d_out = _shape(w_down)[1]
        y = visit_selected_experts(xs, sizes, window, expert_rows, d_out, out_dt)
    elif local_form == "ragged":
        xs = qin(xs)
        ad_gate, ad_up, ad_down = adapters or (None, None, None)
        h = glu(gmm(xs, w_gate, adapter=ad_gate), gmm(xs, w_up, adapter=ad_up), hidden_act, beta_gate, beta_up)
        y = gmm(qin(h), w_down, down=True, adapter=ad_down)
    else:
        raise ValueError(f"expert-parallel local form {local_form!r}: expected 'auto', 'ragged', 'selected' or 'kernel'")
    return jnp.zeros_like(y).at[order].set(y)


def exchange_rounds(tokens: int, k: int, ep_size: int, width: int, max_bytes: int = ROUND_BYTES) -> int:
    """How many rounds a device's `tokens` tokens (top-`k`, experts split `ep_size` ways, rows
    `width` wide) are exchanged in: the fewest, dividing `tokens`, whose worst-case fp32 receive
    buffer (`ep_size * tokens / rounds * k` rows) holds at most `max_bytes`."""
    if ep_size == 1 or tokens <= 1:
        return 1
    need = -(-ep_size * tokens * k * width * 4 // max_bytes)
    return next(r for r in range(min(max(1, need), tokens), tokens + 1) if tokens % r == 0)


def _body(x, idx, pw, w_gate, w_up, w_down, *, plan: EPPlan, rounds: int, **kw):
    if rounds == 1:
        return _round(x, idx, pw, w_gate, w_up, w_down, plan=plan, **kw)
    # The local experts' float values are made once (a QAT fake-quantisation included) and
    # closed over by every round; their gradient is the sum of the rounds' (accumulated in the
    # weights' dtype: bf16 under bf16 masters, a rounding per round).
    fq = kw.pop("weight_fake_quant")
    adapters = kw.pop("adapters", None)
    floats = [_local_float(w, x.dtype, plan, down, fq) for w, down in ((w_gate, False), (w_up, False), (w_down, True))]

    def one_round(x_, idx_, pw_, wg, wu, wd, ads):
        return _round(x_, idx_, pw_, wg, wu, wd, plan=plan, weight_fake_quant=False, adapters=ads, **kw)

    one = jax.checkpoint(one_round, prevent_cse=False)

    def step(carry, tokens):
        return carry, one(*tokens, *floats, adapters)

    n = x.shape[0]
    _, out = jax.lax.scan(step, None, [a.reshape((rounds, n // rounds) + a.shape[1:]) for a in (x, idx, pw)])
    return out.reshape((n,) + out.shape[2:])


def _round(x, idx, pw, w_gate, w_up, w_down, *, plan: EPPlan, **kw):
    n, k = idx.shape
    a = n * k
    p = plan.ep_size
    n_local = plan.num_experts // p
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs, es = x[order // k], flat[order]
    if p > 1:
        ax = _axis(plan.ep_axes)
        me = jax.lax.axis_index(ax)
        send = jnp.bincount(flat // n_local, length=p).astype(jnp.int32)
        sizes = jax.lax.all_gather(send, ax)            # sizes[s, d]: rows s sends d
        in_off = _excl_cumsum(send)
        out_off = _excl_cumsum(sizes, axis=0)[me]        # where my rows start at each peer
        recv = sizes[:, me]
        cap = p * a                                      # worst case: every peer sends me all
        ex = functools.partial(ragged_exchange, axis_name=ax, exchange=plan.exchange)
        rows = ex(xs, jnp.zeros((cap,) + xs.shape[1:], xs.dtype), in_off, send, out_off, recv)
        rid = ex(es, jnp.full((cap,), -1, jnp.int32), in_off, send, out_off, recv)
        valid = jnp.arange(cap) < jnp.sum(recv)
        local_e = jnp.where(valid, rid - me * n_local, n_local)
    else:
        rows, local_e = xs, es
    y = _expert_rows(rows, local_e, n_local, w_gate, w_up, w_down, plan, **kw)
    if p > 1:
        back_in = _excl_cumsum(recv)                     # where each sender's rows sit here
        back_out = _excl_cumsum(sizes, axis=1)[:, me]    # where they sat at their sender
        y = ex(y, jnp.zeros((a,) + y.shape[1:], y.dtype), back_in, recv, back_out, send)
    ya = jnp.zeros((a, y.shape[-1]), jnp.float32).at[order].set(y.astype(jnp.float32))
    out = jnp.einsum("nk,nkd->nd", pw.astype(jnp.float32), ya.reshape(n, k, -1), precision=_HI)
    if plan.tp_axes:
        out = jax.lax.psum(out, _axis(plan.tp_axes))
    return out


def ep_routed_experts(x, idx, weights, w_gate, w_up, w_down, *, plan: EPPlan, hidden_act: str = "situ",
                      beta_gate: float = 4.0, beta_up: float | None = 25.0, weight_fake_quant: bool = False,
                      activation_fake_quant: bool = False, local: str = "auto", round_bytes: int = ROUND_BYTES,
                      kernels: ImplChoice | None = None, adapters=None):
    """`Σ_k p_k · E_{e_k}(x)` (fp32 `[N, d]`) with the experts split as `plan` says.

    Same contract as `k31jax.ops.routed_experts`. The result is complete (reduced over the
    expert and tensor axes) and split over `plan.token_axes`.

    local: each device's grouped matmul (`_expert_rows`): "ragged", "selected", or "auto" —
    "selected" off CPU for packed experts and fewer than `FEW_ASSIGNMENTS_PER_EXPERT`
    assignments per expert (decode, a speculative verify step, short prefill: each device then
    reads only the experts its rows chose), "ragged" otherwise.
    round_bytes: the ragged form exchanges a device's tokens in `exchange_rounds` rounds whose
    worst-case fp32 receive buffer holds at most this.
    kernels: the kernel seam (`_impl.resolve_impl`) for packed experts: where it resolves to a
    kernel, each device runs the MXFP4 grouped-matmul kernel on its rows ("kernel"), whatever
    `local` says.
    adapters: LoRA factors beside the weights (`routed_experts`' argument), split as the experts
    (`EPPlan.adapter_specs`); they run in the ragged local form, whatever `local` and `kernels`
    say.
    """
    n, k = idx.shape
    adapters = adapters if adapters is not None and any(a is not None for a in adapters) else None
    packed = all(isinstance(w, MXFP4Weight) for w in (w_gate, w_up, w_down))
    kernel = resolve_impl(kernels, "mxfp4_gmm") if packed and not weight_fake_quant and adapters is None else "xla"
    if adapters is not None:
        local = "ragged"
    if kernel != "xla":
        local = "kernel"
    if local == "auto" and not (packed and n * k < FEW_ASSIGNMENTS_PER_EXPERT * plan.num_experts):
        local = "ragged"
    if local not in ("auto", "ragged", "selected", "kernel"):
        local = "ragged"  # the single-device forms (blocked, gather) have no expert-parallel variant
    i_local = _shape(w_gate)[1] // plan.tp_size
    if plan.tp_size > 1 and (weight_fake_quant or activation_fake_quant) and i_local % 32:
        raise NotImplementedError(
            f"MX fake-quant along an expert intermediate split into {i_local}-wide shards: the "
            "32-blocks would straddle devices; use a mesh whose tensor size divides "
            "moe_intermediate_size / 32")
    tok = P(_entry(plan.token_axes), None)
    rounds = 1 if local != "ragged" else exchange_rounds(n // plan.token_shards, k, plan.ep_size, _shape(w_down)[1],
                                                         round_bytes)
    body = functools.partial(_body, plan=plan, rounds=rounds, local_form=local,
                             window=expert_window(n, n * k * plan.ep_size),
                             hidden_act=hidden_act, beta_gate=beta_gate, beta_up=beta_up,
                             weight_fake_quant=weight_fake_quant, activation_fake_quant=activation_fake_quant,
                             kernel=kernel)
    specs = (tok, tok, tok) + plan.weight_specs(w_gate, w_up, w_down)
    args = (x, idx.astype(jnp.int32), weights.astype(jnp.float32), w_gate, w_up, w_down)
    if adapters is not None:
        def body_with_adapters(*a):
            return body(*a[:-1], adapters=a[-1])

        fn = jax.shard_map(body_with_adapters, mesh=plan.mesh, in_specs=specs + (plan.adapter_specs(adapters),),
                           out_specs=tok, check_vma=False)
        return fn(*args, adapters)
    fn = jax.shard_map(body, mesh=plan.mesh, in_specs=specs, out_specs=tok, check_vma=False)
    return fn(*args)
