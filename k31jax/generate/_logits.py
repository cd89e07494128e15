"""Per-row rules on the next token: one typed struct for everything that constrains what a row
may sample, applied inside the jitted first-token and decode programs (``_programs``).

- ``force``: the id a row must produce whatever its logits (the thinking budget's closing
  markup, a forced tool call's markup); ``-1`` samples freely.
- ``allowed`` / ``banned``: short per-row id lists, ``-1``-padded (a constrained tool-name
  branch; stop ids before a forced call). A width of 0 (the static engine) leaves them out of
  the program altogether, so a loop that never uses them pays nothing.
- ``bitmask``: ``[B, ceil(V / 32)]`` int32, bit ``v % 32`` of word ``v // 32`` set where a
  row may produce id ``v`` (the layout llguidance fills): a grammar's mask at every step
  (``_grammar``), token healing's first token; or None. Packed, a batch of 8 rows of a
  163,840-id vocabulary is 160 KB to send per step instead of 1.3 MB.

A new per-row logits processor (the drafts a verify step checks) is a new field here, built on
the host by the loop, not a new argument of every program.
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
    bitmask  `[B, W]` int32, W = ceil(V / 32): ids row i may produce, or None (no mask).
    """

    force: Int[Array, " B"]
    allowed: Int[Array, "B A"]
    banned: Int[Array, "B N"]
    bitmask: Int[Array, "B W"] | None = None

    @classmethod
    def forcing(cls, force) -> "TokenRules":
        """Rules that only force ids (`force[i] = -1`: row i samples freely); no id lists."""
        force = np.asarray(force, np.int32)
        empty = np.zeros((len(force), 0), np.int32)
        return cls(force, empty, empty)

    def with_bitmask(self, bitmask: np.ndarray) -> "TokenRules":
        return dataclasses.replace(self, bitmask=bitmask)

    def apply(self, logits: Float[Array, "B V"]) -> Float[Array, "B V"]:
        """The logits with every id a row may not produce at -inf (traced; `force` is applied
        by the sampler, after the filters)."""
        b, v = logits.shape
        rows = jnp.arange(b)[:, None]
        if self.bitmask is not None:
            ids = jnp.arange(v, dtype=jnp.int32)
            words = jnp.take(self.bitmask, ids >> 5, axis=1)
            logits = jnp.where((words >> (ids & 31)) & 1 == 1, logits, -jnp.inf)
        if self.allowed.shape[1]:
            listed = jnp.zeros((b, v), bool).at[rows, jnp.clip(self.allowed, 0, v - 1)].max(self.allowed >= 0)
            logits = jnp.where(listed | (self.allowed[:, :1] < 0), logits, -jnp.inf)
        if self.banned.shape[1]:
            listed = jnp.zeros((b, v), bool).at[rows, jnp.clip(self.banned, 0, v - 1)].max(self.banned >= 0)
            logits = jnp.where(listed, -jnp.inf, logits)
        return logits


def bitmask_words(vocab_size: int) -> int:
    """Words per row of a `TokenRules.bitmask` over `vocab_size` ids."""
    return (vocab_size + 31) // 32


def pack_mask(mask: Bool[np.ndarray, "B V"]) -> Int[np.ndarray, "B W"]:
    """A `[B, V]` bool mask as a `TokenRules.bitmask` (bit v % 32 of word v // 32)."""
    b, v = mask.shape
    padded = np.zeros((b, bitmask_words(v) * 32), bool)
    padded[:, :v] = mask
    return np.packbits(padded, axis=1, bitorder="little").view("<i4").astype(np.int32)
