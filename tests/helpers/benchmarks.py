"""A script of benchmarks/ imported as a module, for a test that runs a smaller version of what
the benchmark runs (the same code on both sides)."""

from __future__ import annotations

import importlib.util
import sys

from .paths import REPO_ROOT


def load_benchmark(name: str):
    """`benchmarks/<name>.py` as the module `benchmarks_<name>` (registered, so that its
    dataclasses resolve their own module)."""
    module_name = f"benchmarks_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, REPO_ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
