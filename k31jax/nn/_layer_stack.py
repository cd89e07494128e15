"""The decoder layers as stacks of parameters, and the one function that runs them (`run_layers`).

Layers of one kind are stacked (`[n, ...]` parameters with a leading "layers" axis): the norms
of every layer, and one stack per mixer kind (KDA, MLA) and FFN kind (dense, MoE). A layer is
a row of the norms, a row of its mixer kind's stack and a row of its FFN kind's.

The stack runs as one `lax.scan` over its repeated groups of layer kinds (`layer_groups`: for
K3, 22 groups of four layers from layer 1), with the few layers outside the repeats unrolled,
so compile time does not grow with depth and every layer's kinds are static.
`scan_layers=False` unrolls every layer (for tests and debugging); both give identical numbers.

XLA:CPU copies every row it takes from a stack (a static slice of an unrolled layer or the
dynamic slice of a scan step) before a matmul reads it. An inference program that reads each
weight once therefore takes the stacks split into rows (`unstack_layers`, what the engine
does on CPU): a stack that holds a tuple of per-layer arrays is indexed without a copy, and
the whole stack runs unrolled.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

from ..config import ModelConfig
from ..quant import kernel_layout, scale_tiles, tile_scales, words_view
from ._param import OutMajor

LAYER_STACKS = ("norms", "kda", "mla", "dense", "moe")
ROUTED_EXPERTS = ("w_gate", "w_up", "w_down")
REMAT_POLICIES = ("none", "full", "dots")
MAX_PERIOD = 12
# the projections whose output a decode step splits into heads and reads head by head: the TPU
# compiler wants their stacks `out`-major and, given them `in`-major, copied each whole stack in
# every decode call (`out_major_projections`). KDA `g_proj` (the output gate) only where the
# decode step runs the Pallas TPU KDA kernel; the XLA programs read it either way at one cost.
OUT_MAJOR_PROJECTIONS = {"mla": ("q_b_proj", "kv_b_proj"), "kda": ("f_b_proj", "g_proj")}


def stack_layers(n: int, make, rngs: nnx.Rngs):
    """`n` copies of `make(rngs)` with stacked parameters (leading "layers" axis)."""
    if n == 0:
        return None

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(r):
        return make(r)

    return build(rngs)


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """A layer's static kinds: its token mixer (MLA or KDA) and its FFN (MoE or dense)."""

    mla: bool
    moe: bool

    @property
    def mixer(self) -> str:
        return "mla" if self.mla else "kda"

    @property
    def ffn(self) -> str:
        return "moe" if self.moe else "dense"


def layer_kinds(cfg: ModelConfig) -> tuple[LayerKind, ...]:
    return tuple(LayerKind(t == "mla", cfg.is_moe_layer(i)) for i, t in enumerate(cfg.layer_types))


def _rows_in_kind_stacks(kinds: tuple[LayerKind, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Each layer's row in its mixer kind's stack and in its FFN kind's stack."""
    mla = np.array([k.mla for k in kinds])
    moe = np.array([k.moe for k in kinds])
    mixer = np.where(mla, np.cumsum(mla) - 1, np.cumsum(~mla) - 1).astype(np.int32)
    ffn = np.where(moe, np.cumsum(moe) - 1, np.cumsum(~moe) - 1).astype(np.int32)
    return mixer, ffn


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


def layer_groups(cfg: ModelConfig) -> LayerGroups:
    """The run of repeated layer groups that leaves the fewest layer bodies to compile
    (unrolled layers + one group), ties going to the shorter period.

    K3 (MLA at 3, 7, ..., 91 and 92, a dense layer 0) scans 22 groups of 4 layers from layer 1
    and unrolls 5. Scanning groups whose kinds are static, rather than single
    layers that switch kind with `lax.cond`, is what keeps the scan's step time near the
    unrolled stack's: a `cond` keeps both branches' residuals for the backward pass, and a
    layer that indexes a closed-over parameter stack accumulates a full-stack gradient per
    layer, where the group's parameters are the scan's inputs (their gradients its outputs)."""
    kinds = layer_kinds(cfg)
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


def _is_rows(a) -> bool:
    return isinstance(a, tuple)


def _take_row(stack, row):
    """Row `row` of every leaf of a stacked state: an index into a stacked array, or the
    element of a leaf already split into rows (`unstack_layers`; `row` is then static)."""
    return jax.tree.map(lambda a: a[row], stack, is_leaf=_is_rows)


def _keeps_expert_stacks(stack, is_moe: bool) -> list[str]:
    """The packed routed experts of an FFN stack held as stacked arrays (not rows)."""
    return [name for name in ROUTED_EXPERTS if is_moe and isinstance(stack.get(name), nnx.State)
            and "packed" in stack[name] and not _is_rows(stack[name]["packed"].get_value())]


@dataclasses.dataclass(frozen=True)
class LayerRows:
    """Where one layer's weights are in its `LayerStacks`: static ints (unrolled layers), or
    traced inside the scan over groups."""

    layer: int | Array   # in `number`, `cache_slot` and `norms`
    mixer: int | Array   # in `mixer`
    ffn: int | Array     # in `ffn`


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer's weights, as its step reads them.

    number      the layer's index in the model (AttnRes snapshot boundaries).
    cache_slot  its row in its mixer kind's cache stacks.
    norms       its norms (`LayerNorms`, pure dict).
    mixer, ffn  the mixer's and the FFN's parameter states.
    expert_row  set when `ffn` holds the packed routed experts as whole stacks: the layer's row
                in them (`LatentMoE(expert_row=)`).
    """

    number: Int[Array, ""]
    cache_slot: Int[Array, ""]
    norms: dict[str, Array]
    mixer: nnx.State
    ffn: nnx.State
    expert_row: int | Array | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerStacks:
    """What a layer step takes its weights from: per-layer tables and stacks (or a scan
    group's slices of them), read at a `LayerRows`."""

    number: Int[Array, "n"]
    cache_slot: Int[Array, "n"]
    norms: Any
    mixer: Any
    ffn: Any

    def take(self, rows: LayerRows, kind: LayerKind) -> Layer:
        """The layer at `rows`. Packed routed experts held as stacked arrays stay whole, and
        the MoE reads its experts at `[row, e]` from them (`LatentMoE(expert_row=)`), so no
        layer's experts are copied out of the stack."""
        keep = _keeps_expert_stacks(self.ffn, kind.moe)
        if keep:
            rest = nnx.State({k: v for k, v in self.ffn.items() if k not in keep})
            ffn = nnx.State({**_take_row(rest, rows.ffn), **{k: self.ffn[k] for k in keep}})
        else:
            ffn = _take_row(self.ffn, rows.ffn)
        return Layer(number=self.number[rows.layer], cache_slot=self.cache_slot[rows.layer],
                     norms=_take_row(self.norms, rows.layer), mixer=_take_row(self.mixer, rows.mixer), ffn=ffn,
                     expert_row=rows.ffn if keep else None)


LayerStep = Callable[[LayerKind, LayerRows, Any, LayerStacks], tuple[Any, dict[str, Array]]]


def _remat(step, policy: str):
    """The layer step under a rematerialisation policy: "none" (save every activation),
    "full" (save nothing: recompute the layer in the backward pass), "dots" (save only the
    matmul outputs without batch dimensions, recompute the elementwise work)."""
    if policy == "none":
        return step
    if policy == "full":
        return jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable)
    return jax.checkpoint(step, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


def _stack_outputs(outs: list) -> Any:
    return jax.tree.map(lambda *a: jnp.stack(a), *outs) if outs else None


def run_layers(step: LayerStep, carry, stacks: dict[str, Any], cfg: ModelConfig, *, scan_layers: bool, remat: str,
               cached: bool):
    """Every layer over `carry` -> (carry, the steps' outputs stacked on a leading layer axis).

    `step(kind, rows, carry, layer_stacks) -> (carry, outputs)` is one decoder layer; it takes
    its rows (`LayerStacks.take`) itself, inside the rematerialised step, so remat saves no copy
    of a layer's weights: the stacks it saves are the step's inputs (the scan's own inputs, or
    the model's). `stacks`: "norms" and each kind's stacked parameter state (`LAYER_STACKS`).
    `cached`: the carry holds a decode cache (inference).

    With `scan_layers`, the repeated layer groups (`layer_groups`) run as one `lax.scan` and
    the layers around them unrolled; without, or when the stacks are split into rows
    (`unstack_layers`), every layer is unrolled. All give identical numbers."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}: expected one of {REMAT_POLICIES}")
    kinds = layer_kinds(cfg)
    mixer_rows, ffn_rows = _rows_in_kind_stacks(kinds)
    holds_rows = any(_is_rows(a) for a in jax.tree.leaves(stacks["norms"], is_leaf=_is_rows))
    groups = layer_groups(cfg) if scan_layers and not holds_rows else LayerGroups(0, 1, 0)
    number, cache_slot = jnp.arange(len(kinds), dtype=jnp.int32), jnp.asarray(mixer_rows)

    def run(i: int, rows: LayerRows, carry, layer_stacks: LayerStacks):
        return _remat(functools.partial(step, kinds[i], rows), remat)(carry, layer_stacks)

    def unrolled(carry, layers):
        outs = []
        for i in layers:
            layer_stacks = LayerStacks(number, cache_slot, stacks["norms"], stacks[kinds[i].mixer],
                                       stacks[kinds[i].ffn])
            carry, out = run(i, LayerRows(i, int(mixer_rows[i]), int(ffn_rows[i])), carry, layer_stacks)
            outs.append(out)
        return carry, _stack_outputs(outs)

    carry, before = unrolled(carry, range(groups.start))
    scanned = None
    if groups.count:
        # Weights reach the scanned layers in one of two ways. Without remat, as scan inputs:
        # each group's slice of every stack, so their gradients are the scan's outputs (a layer
        # that indexes a closed-over stack instead adds a full-stack gradient per step); the
        # sliced copy costs nothing extra there, since the backward pass keeps every layer's
        # weights anyway. Under remat, indexed from the closed-over stacks: the scan inputs
        # would be a copy of the weights kept through the backward pass. With a cache
        # (inference), indexed too: a slice of a stack that feeds the scan is materialised, a
        # copy of the weights in every call (at decode it tripled the bytes read per step).
        by_slices = remat == "none" and not cached
        carry, scanned = _scan_groups(run, carry, stacks, kinds, groups, by_slices=by_slices,
                                      tables=(number, cache_slot), kind_rows=(mixer_rows, ffn_rows))
    carry, after = unrolled(carry, range(groups.stop, len(kinds)))
    parts = [part for part in (before, scanned, after) if part is not None]
    return carry, jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def _scan_groups(run, carry, stacks, kinds, groups: LayerGroups, *, by_slices: bool, tables, kind_rows):
    """The layers of `groups` as one `lax.scan` over the groups (see `run_layers`)."""
    start, period, count = groups.start, groups.period, groups.count
    layers = range(start, groups.stop)

    def per_group(a):  # [n, ...] -> this run's [count, period, ...]
        return a[start:groups.stop].reshape(count, period, *a.shape[1:])

    xs = dict(group=jnp.arange(count), number=per_group(tables[0]), cache_slot=per_group(tables[1]),
              norms=jax.tree.map(per_group, stacks["norms"]))
    # the scanned layers of one kind hold consecutive rows of its stack, `per` of them a group
    first_row, per_group_rows = {}, {}
    for name in {name for i in layers for name in (kinds[i].mixer, kinds[i].ffn)}:
        rows = kind_rows[0] if name in ("kda", "mla") else kind_rows[1]
        mine = [i for i in layers if name in (kinds[i].mixer, kinds[i].ffn)]
        lo, per = int(rows[mine[0]]), len(mine) // count
        first_row[name], per_group_rows[name] = lo, per
        if by_slices:
            xs[name] = jax.tree.map(lambda a, lo=lo, per=per: a[lo:lo + per * count].reshape(count, per, *a.shape[1:]),
                                    stacks[name])

    def body(carry, group):
        source = group if by_slices else stacks

        def row(name, p):  # layer start + p's row in the stack (or this group's slice) of kind `name`
            within = sum(name in (kinds[start + q].mixer, kinds[start + q].ffn) for q in range(p))
            return within if by_slices else first_row[name] + group["group"] * per_group_rows[name] + within

        outs = []
        for p in range(period):
            kind = kinds[start + p]
            layer_stacks = LayerStacks(group["number"], group["cache_slot"], group["norms"], source[kind.mixer],
                                       source[kind.ffn])
            carry, out = run(start + p, LayerRows(p, row(kind.mixer, p), row(kind.ffn, p)), carry, layer_stacks)
            outs.append(out)
        return carry, _stack_outputs(outs)

    carry, scanned = jax.lax.scan(body, carry, xs)
    # [count, period, ...] -> [count * period, ...]
    return carry, jax.tree.map(lambda a: a.reshape(count * period, *a.shape[2:]), scanned)


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


def expert_words(state: nnx.State, kernel: bool = False) -> nnx.State:
    """The model state in the accelerator inference layout of the packed routed experts (the
    same bytes, `MXFP4Weight`): codes as uint32 words `[..., n/4]`, and scales whose blocks a
    device holds are not a multiple of 128 wide as tiled uint16 rows (`quant.tile_scales`).
    XLA:TPU retiles a uint8 stack that a loop reads, one copy of every layer's experts (or
    scales) per call; these it reads in place. Leaves may be arrays or ShapeDtypeStructs
    (ahead-of-time compilation); shardings are kept (the words split where the bytes did, when
    the split divides them; a tiled scale's parts split where its blocks did).

    kernel: the layout of the Pallas TPU grouped matmul instead (`quant.MXFP4KernelWeight`:
    words `[..., in/8, out]`, scale bytes `[..., splits, rows, out]`, `splits` the parts a
    device's share of the blocks make), for a program that runs that kernel."""
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
            if kernel:
                words, scale = _kernel_layout(w["packed"].get_value(), w["scale"].get_value())
                w["packed"], w["scale"] = w["packed"].replace(words), w["scale"].replace(scale)
                moe[name] = w
                continue
            w["packed"] = w["packed"].replace(words(w["packed"].get_value()))
            tiled = _tiled_scale(w["scale"].get_value())
            if tiled is not None:
                w["scale"] = w["scale"].replace(tiled)
            moe[name] = w
    return nnx.State({**state, "moe": nnx.State(moe)})


def out_major_projections(state: nnx.State) -> nnx.State:
    """The model state with the stacks of `OUT_MAJOR_PROJECTIONS` held transposed
    (`OutMajor`: `[n, out, in]`), the layout XLA:TPU's decode step reads them in.

    XLA:TPU picks a program argument's layout by its shape alone. The decode step splits these
    projections' outputs into heads and reads them per head, for which the compiler wants the
    weight `out`-major; handed the `[n, in, out]` stack, it made a transposed copy of every such
    stack in every decode call (at K3.1 Pro scale `q_b_proj` `bf16[24,1536,2304]`, `kv_b_proj`
    and KDA `f_b_proj`: 0.29 GB per chip; with the Pallas TPU KDA decode step, KDA `g_proj`,
    1.52 GB). The prefill chunk reads them either way at the same cost (benchmarks/RESULTS.md
    "compile"). Leaves may be arrays or ShapeDtypeStructs; the
    sharding moves with the axes. Stacks already split into rows (`unstack_layers`) are left as
    they are. The numbers do not change: the layer reads the same matrix. The Param's logical
    axis names still name the `[in, out]` matrix: place or shard the state before this, not
    after."""
    def transposed(a):
        if isinstance(a, OutMajor) or a.ndim < 2:
            return a
        sharding = getattr(a, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            spec = _full_spec(sharding, a.ndim)
            sharding = jax.sharding.NamedSharding(sharding.mesh,
                                                  jax.sharding.PartitionSpec(*spec[:-2], spec[-1], spec[-2]))
        if isinstance(a, jax.ShapeDtypeStruct):
            return OutMajor(jax.ShapeDtypeStruct(a.shape[:-2] + a.shape[:-3:-1], a.dtype, sharding=sharding))
        swap = functools.partial(jnp.swapaxes, axis1=-1, axis2=-2)
        return OutMajor(jax.jit(swap, out_shardings=sharding)(a) if sharding is not None else swap(a))

    out = dict(state)
    for stack, names in OUT_MAJOR_PROJECTIONS.items():
        if stack not in state:
            continue
        sub = dict(state[stack])
        for name in names:
            var = sub.get(name)
            if isinstance(var, nnx.Variable) and not _is_rows(var.get_value()):
                sub[name] = var.replace(transposed(var.get_value()))
        out[stack] = nnx.State(sub)
    return nnx.State(out)


def _full_spec(sharding: jax.sharding.NamedSharding, ndim: int) -> tuple:
    """A named sharding's spec with one entry per dimension (trailing ones None)."""
    return tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))


def _kernel_layout(packed, scale):
    """`quant.kernel_layout` of a stack (arrays or ShapeDtypeStructs), sharded as the bytes were:
    the words' `in/8` and `out` axes and the scale's parts split where the bytes' `in` / blocks
    and `out` axes did."""
    sharding = getattr(packed, "sharding", None)
    named = isinstance(sharding, jax.sharding.NamedSharding)
    local = scale.sharding.shard_shape(scale.shape) if named else scale.shape
    splits = scale.shape[-1] // local[-1]
    convert = functools.partial(kernel_layout, splits=splits)
    where = None
    if named:
        spec = _full_spec(sharding, packed.ndim)
        lead, out_ax, in_ax = spec[:-2], spec[-2], spec[-1]
        mesh = sharding.mesh
        where = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*lead, in_ax, out_ax)),
                 jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*lead, in_ax, None, out_ax)))
    if isinstance(packed, jax.ShapeDtypeStruct):
        shapes = jax.eval_shape(convert, jax.ShapeDtypeStruct(packed.shape, packed.dtype),
                                jax.ShapeDtypeStruct(scale.shape, scale.dtype))
        return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=w)
                     for a, w in zip(shapes, where or (None, None)))
    return jax.jit(convert, out_shardings=where)(packed, scale)


def _tiled_scale(a):
    """`quant.tile_scales` of a scale stack `[..., out, blocks]` (array or ShapeDtypeStruct),
    split into the parts its sharding holds, or None where the layout does not apply: the
    `out` axis split, or blocks per device a multiple of 128 or too few to fill whole tiles."""
    sharding = getattr(a, "sharding", None)
    named = isinstance(sharding, jax.sharding.NamedSharding)
    local = sharding.shard_shape(a.shape) if named else a.shape
    out, blocks = a.shape[-2:]
    splits = blocks // local[-1]
    if local[-2] != out or not scale_tiles(out, blocks, splits):
        return None
    tile = functools.partial(tile_scales, splits=splits)
    where = None
    if named:  # the parts axis splits where the blocks did
        spec = _full_spec(sharding, a.ndim)
        where = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:-2], spec[-1], None, None))
    if isinstance(a, jax.ShapeDtypeStruct):
        tiled = jax.eval_shape(tile, jax.ShapeDtypeStruct(a.shape, a.dtype))
        return jax.ShapeDtypeStruct(tiled.shape, tiled.dtype, sharding=where)
    return jax.jit(tile, out_shardings=where)(a)
