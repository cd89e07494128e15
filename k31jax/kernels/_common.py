"""Shared plumbing for the Pallas kernels: Triton compiler params, padding, GPU lowering.

The kernels are reached through the ops' `impl=` seam (`k31jax.ops._impl`, jax_notes.md §7):
"pallas" compiles them for the GPU, "interpret" runs the same bodies in the Pallas
interpreter (CPU tests). The kernels use Pallas-Triton (`pl.pallas_call` + `plt.CompilerParams`), which runs in
interpret mode on CPU; every block shape handed to a `tl.dot` is a power of two >= 16, so
the wrappers pad small head/latent widths with zeros (exact for every op here).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # jax >= 0.6: `CompilerParams`; older spelled it `TritonCompilerParams`
    from jax.experimental.pallas import triton as plt

    _TritonParams = getattr(plt, "CompilerParams", None) or getattr(plt, "TritonCompilerParams")
except ImportError:  # pragma: no cover - a jax without the Triton backend
    plt = None
    _TritonParams = None

KERNEL_IMPLS = ("pallas", "interpret")
# set inside `abstract_gpu` / `target_tpu`: programs are built for an accelerator this host does
# not have ("gpu": lowered only; "tpu": compiled by libtpu, deviceless)
_TARGET = contextvars.ContextVar("k31jax_kernel_target", default=None)


def lowering_only() -> bool:
    """True inside `abstract_gpu` or `target_tpu`: the program is for another platform than
    this host's, so a kernel cannot be tried out here first."""
    return _TARGET.get() is not None


def kernel_platform() -> str:
    """The platform the kernels are built for: the one `abstract_gpu` / `target_tpu` names,
    else the default backend's."""
    return _TARGET.get() or jax.default_backend()


def runs_mosaic(impl: str) -> bool:
    """Whether kernel implementation `impl` means the Pallas TPU (Mosaic) kernel: "interpret_tpu",
    or "pallas" when the kernels are built for a TPU."""
    return impl == "interpret_tpu" or (impl == "pallas" and kernel_platform() == "tpu")


def tpu_device_kind() -> str | None:
    """The device kind of the TPU the program is built for ("TPU v5", "TPU7x", ...): the active
    mesh's device (a deviceless compile's topology, inside `target_tpu`), else this host's TPU;
    None for other platforms."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    if device is not None and device.platform == "tpu":
        return device.device_kind
    return jax.devices()[0].device_kind if jax.default_backend() == "tpu" else None


@contextlib.contextmanager
def target_tpu():
    """Build kernels for a TPU inside this context ("pallas" picks the Mosaic kernels), as
    `k31jax.aot` does when it compiles a program for a TPU slice from any host."""
    token = _TARGET.set("tpu")
    try:
        yield
    finally:
        _TARGET.reset(token)


def call(kernel, *, out_shape, grid, impl: str, num_warps: int = 4, num_stages: int = 2,
         input_output_aliases=None, name: str | None = None):
    """`pl.pallas_call` over whole-array refs (kernels index them with `pl.ds`)."""
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"kernel impl={impl!r}: expected one of {KERNEL_IMPLS} (the XLA path is the op itself)")
    kw = {}
    if _TritonParams is not None:
        kw["compiler_params"] = _TritonParams(num_warps=num_warps, num_stages=num_stages)
    if name is not None:
        kw["name"] = name
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=impl == "interpret",
                          input_output_aliases=input_output_aliases or {}, **kw)


def masked_store(ref, value, mask):
    """`ref[...] = value` where `mask` (a Triton masked store; plain store without a mask)."""
    if mask is None:
        ref[...] = value
    else:
        plt.store(ref, value, mask=mask)


def pow2_at_least(n: int, floor: int = 16) -> int:
    """The smallest power of two >= max(n, floor)."""
    p = floor
    while p < n:
        p *= 2
    return p


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad `axis` of x up to `size` (no copy when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    if extra < 0:
        raise ValueError(f"pad_axis: axis {axis} of {x.shape} is larger than {size}")
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


@contextlib.contextmanager
def abstract_gpu(device_kind: str = "NVIDIA H200", num_cores: int = 132):
    """Pretend to target a GPU so Pallas-Triton kernels can be *lowered* on a CPU-only host.

    Used by tests and the benchmark: `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`
    inside this context runs the Pallas -> Triton-IR lowering (catches unsupported primitives
    and non-power-of-two tiles) without compiling or running anything. jax >= 0.12 API; raises
    NotImplementedError where the installed jax lacks it.
    """
    try:  # jax-internal API (guarded: absent before jax 0.12), needed only by this helper
        from jax._src import mesh as mesh_lib

        dev = mesh_lib.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
        mesh = mesh_lib.AbstractMesh((1,), ("_kernel_lowering",), abstract_device=dev)
        ctx = jax.sharding.use_abstract_mesh(mesh)
    except (ImportError, AttributeError, TypeError) as e:  # pragma: no cover - older jax
        raise NotImplementedError(f"abstract GPU lowering unavailable on jax {jax.__version__}: {e}")
    token = _TARGET.set("gpu")
    try:
        with ctx:
            yield
    finally:
        _TARGET.reset(token)


def lower_for_gpu(fn, *args) -> str:
    """Lower `fn(*args)` for CUDA on any host; returns the StableHLO text (Triton custom calls
    carry the serialised Triton IR). Raises if a kernel does not lower."""
    with abstract_gpu():
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()
