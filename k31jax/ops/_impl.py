"""The ops' one kernel seam: `impl ∈ {"xla", "pallas", "interpret", "interpret_tpu"}` (`Impl`),
or None / "auto".

- "xla": the op's jnp path — the reference the kernels are tested against;
- "pallas": the kernel of `k31jax.kernels` for the target platform (`kernels.kernel_platform`):
  Pallas-Triton for a GPU, Pallas TPU (Mosaic) for a TPU (every kernel has both);
- "interpret": the Triton kernel body run by the Pallas interpreter (any backend: CPU tests);
- "interpret_tpu": the Mosaic kernel body run with TPU semantics (`pltpu.InterpretParams`) on
  any backend;
- None / "auto": the kernel only where it has passed its check on real hardware of the target
  platform (`VERIFIED_ON_GPU`, `VERIFIED_ON_TPU`, filled from benchmarks/RESULTS.md with the
  versions it ran on), when the op runs on one device's data (no mesh, or inside `shard_map`
  over every mesh axis larger than one); else "xla". No kernel has run on a GPU or a TPU yet,
  so "auto" is XLA everywhere and the kernels are opt-in ("pallas"). Under an automatically partitioned mesh the
  XLA path stays: XLA partitions it, while a kernel is a per-device program whose inputs the
  partitioner would have to gather. An op whose kernel works on independent slices says which
  (`per_device`: the KDA kernels per row and head, the sparse MLA and indexer kernels per row),
  and an opted-in kernel then runs under `shard_map` on each device's slice.

The model and the engine take the whole choice as one frozen `Backends` object; its
`kernels` field defaults to the environment variable `K31JAX_KERNELS` (one of the names
above, or "auto"), so `K31JAX_KERNELS=xla` keeps a whole program (the engine, the CLI) on the
XLA paths without code changes. Nothing else reads that variable.

The kernels have no backward pass of their own but one: `with_reference_grad` gives a kernel
the gradient of the XLA path (recomputed in the backward pass), so training through
`impl="pallas"` differentiates exactly like the reference. The Mosaic MXFP4 grouped matmul is
the exception: its activation gradient is the transposed kernel (the packed experts are frozen
codes with no gradient), since the XLA backward would decode a whole layer's experts to bf16.

`impl` names only this seam. The other choices of `Backends` are forms of one computation,
each typed by its own `Literal`: `MoeForm` (the routed experts' grouped matmul,
`routed_experts(form=)`), `SparseForm` (the selected MLA attention) and `EpExchange` (the
expert-parallel token exchange).

`kernel_or_reference` is how the ops call a kernel: under "pallas" it first compiles the kernel
alone for the arguments' shapes (once per kernel, static settings and shapes); if that fails on
this backend and jax version, the op runs its XLA path and one warning names the kernel and
the error, so an opted-in kernel never crashes a program.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
import warnings
from typing import Literal

import jax
import jax.numpy as jnp

from ..kernels import kernel_platform, lowering_only, runs_mosaic
from ..sharding import current_rules, logical_to_spec

Impl = Literal["xla", "pallas", "interpret", "interpret_tpu"]  # a resolved choice of the kernel seam
ImplChoice = Literal["auto", "xla", "pallas", "interpret", "interpret_tpu"]  # what callers pass ("auto" / None resolve)
MoeForm = Literal["auto", "ragged", "blocked", "gather", "selected"]
SparseForm = Literal["auto", "mask", "gather"]
EpExchange = Literal["auto", "ragged", "dense", "allgather", "off"]
IMPLS: tuple[Impl, ...] = typing.get_args(Impl)
MOE_FORMS: tuple[MoeForm, ...] = typing.get_args(MoeForm)
SPARSE_FORMS: tuple[SparseForm, ...] = typing.get_args(SparseForm)
EP_EXCHANGES: tuple[EpExchange, ...] = typing.get_args(EpExchange)
KERNELS = ("kda_chunk", "kda_step", "sparse_mla", "indexer_topk", "mxfp4_gmm")
# kernel -> the jax version its check passed on, on real GPU hardware (benchmarks/gpu_kernels.py,
# recorded in benchmarks/RESULTS.md). Until then "auto" keeps that op on its XLA path.
VERIFIED_ON_GPU: dict[str, str] = {}
# kernel -> the jax and libtpu versions and the device kind its Mosaic kernel's check passed on,
# on a real TPU (benchmarks/tpu_check.py prints these lines). Until then "auto" keeps that op on
# its XLA path when building for a TPU.
VERIFIED_ON_TPU: dict[str, str] = {}


def _kernels_from_env() -> ImplChoice:
    value = os.environ.get("K31JAX_KERNELS") or "auto"
    if value not in (*IMPLS, "auto"):
        raise ValueError(f"K31JAX_KERNELS={value!r}: expected one of {IMPLS} or 'auto'")
    return value


def _check_choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"Backends.{field}={value!r}: expected one of {allowed}")


@dataclasses.dataclass(frozen=True)
class Backends:
    """Which implementation the model's hot paths run; one object for the model and the engine.

    kernels: the ops' kernel seam for KDA (chunk, decode step), sparse MLA attention, the
      indexer top-k and the packed-MXFP4 grouped matmul: "auto" (a kernel verified on GPU
      hardware, on a GPU, when the op runs on one device's data; XLA otherwise), "xla",
      "pallas" (opt in to every kernel of the target platform), "interpret" (the Triton
      kernel bodies on the Pallas interpreter, any backend) or "interpret_tpu" (the Mosaic
      kernel bodies with TPU semantics, any backend). Default: `$K31JAX_KERNELS`, else "auto".
    moe: the routed experts' grouped-matmul form (`ops.routed_experts`): "auto" (packed MXFP4
      experts take the kernel when `kernels` resolves to one; otherwise, with few
      assignments per expert (`FEW_ASSIGNMENTS_PER_EXPERT`), "gather" on CPU and "selected"
      (a loop over the chosen experts) for packed experts elsewhere, then "blocked" on CPU,
      "ragged" elsewhere), or one of those forms. Under expert parallelism the local form is
      "selected" or "ragged" ("auto": "selected" for packed experts and few assignments, off CPU).
    sparse: the indexer-selected MLA attention: "auto" (the gather form for decode and long
      prefill, the [T, S] mask form for short prefill), "mask" or "gather".
    ep: expert parallelism under a mesh whose rules split the experts: "auto" (the platform's
      token exchange), "ragged" | "dense" | "allgather" (a given exchange), or "off" (leave the
      experts to the partitioner). Without a mesh it changes nothing.
    """

    kernels: ImplChoice = dataclasses.field(default_factory=_kernels_from_env)
    moe: MoeForm = "auto"
    sparse: SparseForm = "auto"
    ep: EpExchange = "auto"

    def __post_init__(self):
        _check_choice("kernels", self.kernels, (*IMPLS, "auto"))
        _check_choice("moe", self.moe, MOE_FORMS)
        _check_choice("sparse", self.sparse, SPARSE_FORMS)
        _check_choice("ep", self.ep, EP_EXCHANGES)


def _per_device() -> bool:
    """True when no automatically partitioned mesh axis is in scope."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True
    manual = set(getattr(mesh, "manual_axes", ()))
    return all(size == 1 or name in manual for name, size in zip(mesh.axis_names, mesh.axis_sizes))


def resolve_impl(impl: ImplChoice | None, kernel: str, *, supported: bool = True) -> Impl:
    """The implementation to run for `kernel` (one of `KERNELS`). `supported=False` (shapes the
    kernel does not take) turns "auto" into "xla"; an explicit "pallas"/"interpret" is left for
    the kernel to refuse."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
    if impl is None or impl == "auto":
        verified = {"gpu": VERIFIED_ON_GPU, "tpu": VERIFIED_ON_TPU}.get(kernel_platform(), {})
        return "pallas" if supported and kernel in verified and _per_device() else "xla"
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS} or 'auto'")
    return impl


def tpu_kernel_layout(backends: Backends) -> bool:
    """Whether packed routed experts run the Pallas TPU grouped matmul under `backends` (so a
    program's state holds them in its layout, `nn.expert_words(kernel=True)`)."""
    return runs_mosaic(resolve_impl(backends.kernels, "mxfp4_gmm"))


def with_reference_grad(kernel, reference):
    """`kernel`, differentiated as `reference` (same signature, positional array arguments;
    bind static ones first). Integer and boolean inputs get zero (float0) cotangents."""

    @jax.custom_vjp
    def run(*args):
        return kernel(*args)

    def fwd(*args):
        return kernel(*args), args

    def bwd(args, cotangent):
        return jax.vjp(reference, *args)[1](cotangent)

    run.defvjp(fwd, bwd)
    return run


# (kernel, static settings, argument shapes) -> whether the kernel compiled; kernels warned about
_COMPILES: dict[tuple, bool] = {}
_WARNED: set[str] = set()


def _static_key(fn) -> tuple:
    if isinstance(fn, functools.partial):
        return (fn.func, fn.args, tuple(sorted(fn.keywords.items())))
    return (fn,)


def _kernel_compiles(name: str, kernel, args: tuple) -> bool:
    avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    leaves, treedef = jax.tree.flatten(avals)
    key = (name, _static_key(kernel), treedef, tuple((x.shape, str(x.dtype)) for x in leaves))
    if key not in _COMPILES:
        try:
            jax.jit(kernel).lower(*avals).compile()
            _COMPILES[key] = True
        except Exception as e:  # noqa: BLE001 - Triton, Mosaic and XLA each raise their own types
            _COMPILES[key] = False
            if name not in _WARNED:
                _WARNED.add(name)
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                warnings.warn(f"k31jax: the Pallas kernel {name!r} failed to compile on {jax.default_backend()} "
                              f"(jax {jax.__version__}): {type(e).__name__}: {first}; running its XLA path "
                              "instead", RuntimeWarning, stacklevel=3)
    return _COMPILES[key]


def per_device(fn, in_axes: tuple, out_axes: tuple):
    """`fn` (a kernel path, arrays in and out) run on each device's slice of its arguments
    under the active automatically partitioned mesh (`shard_map`), each argument split by its
    logical axis names (`sharding.logical_to_spec`; an axis that does not divide is left
    whole), and each result split as the arguments' axes of the same names were; `fn` itself
    where nothing is partitioned. For kernels whose work is independent along the split axes,
    so the partitioner never gathers their inputs."""
    if _per_device():
        return fn
    mesh = jax.sharding.get_abstract_mesh()
    shape = dict(mesh.shape)
    rules = current_rules(shape)

    def run(*args):
        in_specs = tuple(logical_to_spec(names, a.shape, shape, rules) for names, a in zip(in_axes, args))
        split = {}  # logical name -> the mesh axes the arguments split it over
        for names, spec in zip(in_axes, in_specs):
            for name, entry in zip(names, tuple(spec) + (None,) * (len(names) - len(spec))):
                if name is not None:
                    split.setdefault(name, entry)
        out_specs = tuple(jax.sharding.PartitionSpec(*(split.get(n) for n in names)) for names in out_axes)
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

    return run


def splits_any(names: tuple, shape: tuple, which: tuple[str, ...]) -> bool:
    """Whether the active automatically partitioned mesh splits any of the logical axes `which`
    of an array with these axis names and shape (a per-device kernel that needs those axes
    whole cannot run on a slice)."""
    if _per_device():
        return False
    mesh_shape = dict(jax.sharding.get_abstract_mesh().shape)
    spec = logical_to_spec(names, shape, mesh_shape, current_rules(mesh_shape))
    return any(name in which and entry is not None for name, entry in zip(names, tuple(spec) + (None,) * len(names)))


def kernel_or_reference(name: str, impl: Impl, kernel, reference, *, grad: bool = True):
    """The callable an op runs for `impl` ("pallas" / "interpret"): `kernel` differentiated as
    `reference` (`grad=False`: `kernel` as is, for discrete outputs or a kernel with its own
    VJP), or under "pallas", when
    the kernel does not compile for these arguments here, `reference` itself (one warning per
    kernel). Programs lowered inside `kernels._common.abstract_gpu` are never compiled, so there
    the kernel is always taken."""
    run_kernel = with_reference_grad(kernel, reference) if grad else kernel
    if impl != "pallas" or lowering_only():
        return run_kernel

    def run(*args):
        return run_kernel(*args) if _kernel_compiles(name, kernel, args) else reference(*args)

    return run


def per_device_on_layer_stack(name: str, impl: Impl, kernel, reference, args: tuple, in_axes: tuple, out_axes: tuple,
                              *, layer, whole: tuple[str, ...], grad: bool = True):
    """`kernel_or_reference(name, impl, kernel, reference, grad=grad)(*args, layer)`, run
    `per_device`: arguments split by `in_axes`, the result by `out_axes` (one array's axis names,
    or a tuple of them for a tuple of arrays). The arguments whose axes start with "layers" are
    stacks of every layer, read at row `layer`; with `layer` None they are one layer's arrays,
    lifted to a stack of one read at row 0. Where the mesh splits any of the `whole` axes of an
    argument (the kernel needs them whole on each device), `reference(*args, layer)` instead."""
    if layer is None:
        args = tuple(a[None] if names[:1] == ("layers",) else a for a, names in zip(args, in_axes))
    args, in_axes = (*args, jnp.asarray(0 if layer is None else layer, jnp.int32)), (*in_axes, ())
    if any(splits_any(names, a.shape, whole) for a, names in zip(args, in_axes)):
        return reference(*args)
    run = kernel_or_reference(name, impl, kernel, reference, grad=grad)
    if all(n is None or isinstance(n, str) for n in out_axes):  # one array: `per_device` takes a tuple
        return per_device(lambda *a: (run(*a),), in_axes, (out_axes,))(*args)[0]
    return per_device(run, in_axes, out_axes)(*args)
