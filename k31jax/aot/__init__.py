"""Compiling the engine's and the trainer's programs for a TPU slice from any host (deviceless AOT), and reading
what the compiler made of them: per-device memory beside the planner's, HBM traffic and FLOPs
with loop trip counts, collectives, the largest buffers, and what is live at the compiler's
memory peak (also on the error of a program that does not fit). Needs the `tpu` extra (libtpu).

    from k31jax import aot
    report = aot.compile_program("k31_pro", "v5p:4x4x4", "expert=8,tensor=8", step="decode", batch=8)
    print(report.table())
"""

from ._compile import (HBM_PER_DEVICE, STEPS, CompileError, CompileReport, TrainSettings, compile_program,
                       expected_local_experts, libtpu_available, slice_mesh, step_floor, topology_name, tpu_devices)
from ._hlo import HloReport, analyse, peak_breakdown

__all__ = [
    "HBM_PER_DEVICE", "STEPS", "CompileError", "CompileReport", "HloReport", "TrainSettings", "analyse", "compile_program",
    "expected_local_experts", "libtpu_available", "peak_breakdown", "slice_mesh", "step_floor", "topology_name",
    "tpu_devices",
]
