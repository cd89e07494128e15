"""Token sequences → pieces of at most ``seq_len`` tokens → packed rows → per-process batches.

Row fields (all ``[T]``, zero on padding):

- ``tokens`` int32: model input.
- ``targets`` int32: the next token of the same document. At the last position of a piece
  of a split document this is the first token of the next piece, so every token after a
  document's first is a target exactly once. At a document's last token it is 0 (masked).
- ``loss_mask`` float32: 1 where the target is trained.
- ``target_bytes`` int32: UTF-8 byte length of the target token's text, 0 for special
  tokens (bits per byte = ``sum(nats * mask) / ln 2 / sum(target_bytes * mask)``).
- ``segment_ids`` int32: 1, 2, 3 … per piece within the row, 0 for padding.
- ``positions`` int32: position within the piece (restarts at 0 for every segment).

Packing is grain's first-fit packer (``grain.experimental.FirstFitPackIterDataset``): it
already emits per-feature segment ids and positions and has a checkpointable state
(the parent's state at the last emitted pack plus the row counter), so resuming re-packs
the same rows.
"""

from __future__ import annotations

import numpy as np
from grain import IterDataset
from grain.experimental import FirstFitPackIterDataset, FlatMapIterDataset, FlatMapTransform
from jaxtyping import Bool, Int

from k31jax.chat import TokenizerBase

ROW_FIELDS = ("tokens", "targets", "loss_mask", "target_bytes", "segment_ids", "positions")
_PACKED_FIELDS = ("tokens", "targets", "loss_mask", "target_bytes")


def target_byte_table(tokenizer: TokenizerBase) -> Int[np.ndarray, "V"]:
    """``table[id]`` = UTF-8 byte length of token ``id``'s text; 0 for special ids."""
    return np.array(
        [0 if tokenizer.is_special(i) else len(tokenizer.token_bytes(i))
         for i in range(tokenizer.vocab_size)],
        dtype=np.int32,
    )


def split_into_pieces(
    tokens: Int[np.ndarray, "L"],
    trained: Bool[np.ndarray, "L"],
    seq_len: int,
    byte_table: Int[np.ndarray, "V"],
) -> list[dict[str, np.ndarray]]:
    """One document's tokens as consecutive pieces of at most ``seq_len`` positions.

    ``trained[i]`` says whether token ``i`` is a loss target when it is predicted (from
    position ``i - 1``). Each piece becomes its own packed segment: attention context does
    **not** carry across pieces, only the target of a piece's last position reaches into
    the next piece.
    """
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens)
    targets = np.zeros(n, np.int32)
    targets[:-1] = tokens[1:]
    loss_mask = np.zeros(n, np.float32)
    loss_mask[:-1] = trained[1:]
    target_bytes = np.zeros(n, np.int32)
    target_bytes[:-1] = byte_table[tokens[1:]]
    return [
        {"tokens": tokens[s : s + seq_len], "targets": targets[s : s + seq_len],
         "loss_mask": loss_mask[s : s + seq_len], "target_bytes": target_bytes[s : s + seq_len]}
        for s in range(0, n, seq_len)
    ]


class _Flatten(FlatMapTransform):
    """A document's list of pieces → the pieces, one element each."""

    max_fan_out = 1 << 20  # part of grain's FlatMap interface; the iterator version ignores it

    def flat_map(self, pieces):
        return pieces


def _to_row(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # Every packed feature gets identical segment ids and positions; keep those of `tokens`.
    row = {k: packed[k] for k in _PACKED_FIELDS}
    row["segment_ids"] = packed["tokens_segment_ids"]
    row["positions"] = packed["tokens_positions"]
    return row


def pack_rows(
    document_pieces: IterDataset, seq_len: int, *, num_bins: int, seed: int, shuffle: bool
) -> IterDataset:
    """Lists of pieces (one list per document) → rows of ``seq_len`` (first-fit, zero padded).

    First-fit fills ``num_bins`` rows at a time; with ``shuffle`` the rows of each group
    are emitted in a seeded random order.
    """
    pieces = FlatMapIterDataset(document_pieces, _Flatten())
    packed = FirstFitPackIterDataset(
        pieces,
        length_struct={k: seq_len for k in _PACKED_FIELDS},
        num_packing_bins=num_bins,
        seed=seed,
        shuffle_bins=shuffle,
    )
    return packed.map(_to_row)


class _PadRows:
    """Pad a short final batch with all-zero rows (segment 0, mask 0) to a fixed row count."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = self.num_rows - len(batch["tokens"])
        if missing == 0:
            return batch
        return {k: np.concatenate([v, np.zeros((missing, *v.shape[1:]), v.dtype)])
                for k, v in batch.items()}


class _ProcessRows:
    """This process's ``batch_size`` rows of a global batch."""

    def __init__(self, batch_size: int, process_index: int):
        self.start = batch_size * process_index
        self.stop = self.start + batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v[self.start : self.stop] for k, v in batch.items()}


def batch_for_process(
    rows: IterDataset, batch_size: int, *, num_processes: int, process_index: int,
    pad_last: bool,
) -> IterDataset:
    """Rows → ``[batch_size / num_processes, T]`` batches for one process.

    Every process builds the same global batch of ``batch_size`` rows and keeps its slice, so
    all processes see the same number of batches and the global batch does not depend on the
    process count. ``pad_last`` keeps a short final global batch (padded with empty rows, for
    a single eval pass); otherwise it is dropped.
    """
    batches = rows.batch(batch_size, drop_remainder=not pad_last)
    if pad_last:
        batches = batches.map(_PadRows(batch_size))
    if num_processes > 1:
        batches = batches.map(_ProcessRows(batch_size // num_processes, process_index))
    return batches
