"""Per-row rules on the next token: one typed struct for everything that constrains what a row
may sample, applied inside the jitted first-token and decode programs (``_programs``).

- ``force``: the id a row must produce whatever its logits (the thinking budget's closing
  markup, a forced tool call's markup); ``-1`` samples freely.
- ``allowed`` / ``banned``: short per-row id lists, ``-1``-padded (a constrained tool-name
  branch; stop ids before a forced call). A width of 0 (the static engine) leaves them out of
  the program altogether, so a loop that never uses them pays nothing.
- ``mask``: ``[B, V]`` ids a row may produce (token healing's first token), or None.

A new per-row logits processor (a grammar's mask at every step, the drafts a verify step
checks) is a new field here, built on the host by the loop, not a new argument of every
program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenRules:
    """What each row's next token may be (host or device arrays; see the module docstring).

    force    `[B]` int32: the id row i must produce, or -1.
    allowed  `[B, A]` int32: row i may only produce these ids when ``allowed[i, 0] >= 0``.
    banned   `[B, N]` int32: ids row i may not produce.
    mask     `[B, V]` bool: ids row i may produce, or None (no mask).
    """

    force: Int[Array, " B"]
    allowed: Int[Array, "B A"]
    banned: Int[Array, "B N"]
    mask: Bool[Array, "B V"] | None = None

    @classmethod
    def forcing(cls, force) -> "TokenRules":
        """Rules that only force ids (`force[i] = -1`: row i samples freely); no id lists."""
        force = np.asarray(force, np.int32)
        empty = np.zeros((len(force), 0), np.int32)
        return cls(force, empty, empty)

    def with_mask(self, mask: np.ndarray) -> "TokenRules":
        return dataclasses.replace(self, mask=mask)

    def apply(self, logits: Float[Array, "B V"]) -> Float[Array, "B V"]:
        """The logits with every id a row may not produce at -inf (traced; `force` is applied
        by the sampler, after the filters)."""
        b, v = logits.shape
        rows = jnp.arange(b)[:, None]
        if self.mask is not None:
            logits = jnp.where(self.mask, logits, -jnp.inf)
        if self.allowed.shape[1]:
            listed = jnp.zeros((b, v), bool).at[rows, jnp.clip(self.allowed, 0, v - 1)].max(self.allowed >= 0)
            logits = jnp.where(listed | (self.allowed[:, :1] < 0), logits, -jnp.inf)
        if self.banned.shape[1]:
            listed = jnp.zeros((b, v), bool).at[rows, jnp.clip(self.banned, 0, v - 1)].max(self.banned >= 0)
            logits = jnp.where(listed, -jnp.inf, logits)
        return logits
