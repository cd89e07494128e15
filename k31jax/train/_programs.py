"""The trainer's steps as compiled programs whose donated state the compiler lays out.

A step `fn(graphdef, tx, settings, params, opt_state, trainable, batch)` returns the three
state trees and its metrics, and donates the state. On a TPU its state is compiled with
`Layout.AUTO` in and out: XLA:TPU picks each argument's physical layout from how the program
reads it, the state is placed in those formats before the first step (leaf by leaf; nothing
moves afterwards, since the step returns the state in the formats it took it in), and the
donated buffers stay aliased. Why: with the default layouts the K3.1 Pro QAT step copied each
trained routed-expert stack whole, every step, to the layout its grouped matmul reads (the
`out` side minor; the masters are `[E, out, in]`): 3.55 GB per chip per stack on a v5p
training mesh (`benchmarks/RESULTS.md`, "compile"). On other backends the layouts are the
default ones and the same code runs.

Compiled programs are kept per process, keyed like `jax.jit`'s own cache (the static
arguments and the arguments' shapes, dtypes and shardings), so every `Trainer` with the same
settings reuses them.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.experimental.layout import Format, Layout

STATE = slice(3, 6)  # params, opt_state, trainable: donated, returned updated


def _abstract(tree):
    """Shapes, dtypes and shardings, no layout: `Layout.AUTO` refuses an argument with one."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _platform(tree) -> str:
    leaf = jax.tree.leaves(tree)[0]
    return next(iter(leaf.sharding.device_set)).platform


class StepProgram:
    """A training step as one compiled program per argument signature (see the module doc)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self._compiled: dict = {}

    def jitted(self, *args):
        """The `jax.jit` of the step for these arguments (arrays or `ShapeDtypeStruct`s with
        shardings): the state in and out in the formats the compiler chooses on a TPU.
        `.lower(*args)` on abstract arguments is the program `__call__` runs."""
        state = args[STATE]
        layout = Layout.AUTO if _platform(state) == "tpu" else None
        formats = jax.tree.map(lambda a: Format(layout, a.sharding), state)
        return jax.jit(self.fn, static_argnums=(0, 1, 2), donate_argnums=(3, 4, 5),
                       in_shardings=(*formats, None), out_shardings=(*formats, None))

    def compiled(self, *args):
        """The compiled program for these arguments (compiled once per signature)."""
        static, dynamic = args[:3], _abstract(args[3:])
        leaves, treedef = jax.tree.flatten(dynamic)
        key = (*static, treedef, tuple(leaves))
        program = self._compiled.get(key)
        if program is None:
            program = self._compiled[key] = self.jitted(*static, *dynamic).lower(*static, *dynamic).compile()
        return program

    @staticmethod
    def relaid(compiled, state) -> int:
        """How many leaves of the donated `state` (params, opt_state, trainable; arrays or
        abstract ones) the `compiled` step returns in other formats than it takes them in: each
        would be placed again (copied) before every step."""
        taken, returned = jax.tree.leaves(compiled.input_formats[0][:3]), jax.tree.leaves(compiled.output_formats[:3])
        return sum(not same_format(a, b, len(x.shape)) for a, b, x in zip(taken, returned, jax.tree.leaves(state)))

    def __call__(self, *args):
        """One step: `(params, opt_state, trainable, metrics)`; the state arguments are donated."""
        program = self.compiled(*args)
        return program(*jax.tree.map(_placed, args[STATE], program.input_formats[0][:3]), args[6])


def same_format(a: Format, b: Format, ndim: int) -> bool:
    """Whether an array of `ndim` dimensions in format `a` is in format `b`, as a compiled
    program checks its arguments: the same layout and equivalent shardings. `==` is stricter:
    a compiled program writes a sharding with its trailing unsplit axes (`P(None, "tensor",
    None)`) that its input format writes without (`P(None, "tensor")`)."""
    return a.layout == b.layout and (a.sharding == b.sharding or a.sharding.is_equivalent_to(b.sharding, ndim))


def _placed(x, fmt: Format):
    """`x` in `fmt`: passed on as it is when it already is (every step after the first); else
    copied and the original deleted at once (the state is donated to the step anyway), so that
    placing a state as large as a chip's memory allows needs one leaf of headroom, not two
    copies of the state."""
    if isinstance(x, jax.Array) and same_format(x.format, fmt, x.ndim):
        return x
    placed = jax.device_put(x, fmt)
    if isinstance(x, jax.Array):
        placed.block_until_ready()
        x.delete()
    return placed
