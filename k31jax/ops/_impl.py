"""The ops' one kernel seam: `impl ∈ {"xla", "pallas", "interpret"}`, or None / "auto".

- "xla": the op's jnp path — the reference the kernels are tested against;
- "pallas": the Pallas-Triton kernel of `k31jax.kernels`, compiled for the GPU;
- "interpret": the same kernel body run by the Pallas interpreter (any backend: CPU tests);
- None / "auto": "pallas" on a GPU backend when the op runs on one device's data (no mesh, or
  inside `shard_map` over every mesh axis larger than one), else "xla". Under an automatically
  partitioned mesh the XLA path stays: XLA partitions it, while a kernel is a per-device
  program whose inputs the partitioner would have to gather. The environment variable
  `K31JAX_KERNELS` (one of the names above), read at trace time, replaces "auto" everywhere:
  `K31JAX_KERNELS=xla` keeps a whole program (the engine, the CLI) on the XLA paths.

The kernels have no backward pass of their own: `with_reference_grad` gives a kernel the
gradient of the XLA path (recomputed in the backward pass), so training through `impl="pallas"`
differentiates exactly like the reference.
"""

from __future__ import annotations

import os

import jax

IMPLS = ("xla", "pallas", "interpret")


def _per_device() -> bool:
    """True when no automatically partitioned mesh axis is in scope."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True
    manual = set(getattr(mesh, "manual_axes", ()))
    return all(size == 1 or name in manual for name, size in zip(mesh.axis_names, mesh.axis_sizes))


def resolve_impl(impl: str | None, *, supported: bool = True) -> str:
    """The implementation to run. `supported=False` (shapes the kernel does not take) turns
    "auto" into "xla"; an explicit "pallas"/"interpret" is left for the kernel to refuse."""
    if impl is None or impl == "auto":
        forced = os.environ.get("K31JAX_KERNELS", "auto") or "auto"
        if forced not in (*IMPLS, "auto"):
            raise ValueError(f"K31JAX_KERNELS={forced!r}: expected one of {IMPLS} or 'auto'")
        if forced != "auto":
            return forced if supported else "xla"
        gpu = jax.default_backend() == "gpu"
        return "pallas" if gpu and supported and _per_device() else "xla"
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS} or 'auto'")
    return impl


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
