"""Image prompts in generation: the vision model's rows of a request, and the rows each prefill
chunk splices at its `<|media_pad|>` positions (vision.md §3, `k31jax.vision` wiring plan).

- **Once per request.** At admission the request's images (`Request.images`, in prompt order)
  are packed and run through the vision model; the projected rows `[M, D]` go to the host.
  The tower's input is padded to a patch-count bucket (`patch_bucket`) so that its program
  is compiled once per bucket, not once per image count or image-size mix. Padding patches
  form their own image (a segment no real patch attends to) and their merged rows are
  dropped, so they change no real row.
- **Per chunk.** `chunk_splice` gives, for one prefill call `[B, w]`, the token ids to splice
  (-1 where nothing is spliced: rows without images, left padding) and the rows they take, in
  row-major order, zero-padded to `B * w` rows. The buffer's shape depends only on the call's
  shape, so the image prefill program is compiled once per (batch, width), whatever the
  number of images. Chunks without any pad use the text prefill program.
- **Which ids count.** Only a request that carries images splices: its pad count must equal
  its images' token count. A request without images keeps plain token embeddings even if its
  ids contain the pad id (a raw prompt may hold any id).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..vision import ProcessedImage, VisionInputs, pack_images

MEDIA_PAD = "<|media_pad|>"
MIN_PATCH_BUCKET = 64


def media_pad_id(tokenizer, vision_config) -> int | None:
    """The `<|media_pad|>` id: the tokenizer's (it wrote the prompt), else the vision config's."""
    if tokenizer is not None:
        pad = tokenizer.special_tokens.get(MEDIA_PAD)
        if pad is not None:
            return int(pad)
    return None if vision_config is None else int(vision_config.media_placeholder_token_id)


def image_digest(image: ProcessedImage) -> str:
    """Content hash of what the tower sees (the processed patches and their grid)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(image.grid, np.int64).tobytes())
    h.update(np.ascontiguousarray(image.patches, np.float32).tobytes())
    return h.hexdigest()


def patch_bucket(n: int, minimum: int = MIN_PATCH_BUCKET) -> int:
    """The padded patch count of a tower call: the smallest `m * 2^e >= n` with m in 4..7
    (at most 25% padding; four programs per doubling of the image area), at least `minimum`."""
    n = max(n, minimum)
    e = max(0, n.bit_length() - 3)
    m = -(-n // (1 << e))
    return m << e


def pad_vision_inputs(inputs: VisionInputs, n_padded: int, merge_size: int) -> VisionInputs:
    """`inputs` with `n_padded - N` padding patches appended as one more image (zero pixels,
    zero position taps) and merged rows padded to `n_padded // merge_size` (the extra rows
    read padding patches and are dropped by the caller)."""
    n, m = inputs.num_patches, inputs.num_tokens
    extra = n_padded - n
    if extra < 0 or n_padded % merge_size:
        raise ValueError(f"pad_vision_inputs: cannot pad {n} patches to {n_padded} (merge size {merge_size})")
    if extra == 0:
        return inputs
    pad_segment = int(inputs.segment_ids[-1]) + 1
    m_padded = n_padded // merge_size
    merge_pad = np.full((m_padded - m, inputs.merge_index.shape[1]), n, np.int32)
    return VisionInputs(
        patches=np.concatenate([inputs.patches, np.zeros((extra,) + inputs.patches.shape[1:], np.float32)]),
        segment_ids=np.concatenate([inputs.segment_ids, np.full(extra, pad_segment, np.int32)]),
        positions=np.concatenate([inputs.positions, np.zeros((extra, 2), np.int32)]),
        pos_index=np.concatenate([inputs.pos_index, np.zeros((extra, 4), np.int32)]),
        pos_weight=np.concatenate([inputs.pos_weight, np.zeros((extra, 4), np.float32)]),
        merge_index=np.concatenate([inputs.merge_index, merge_pad]))


def packed_request_images(images: Sequence[ProcessedImage], vision_config) -> tuple[VisionInputs, int]:
    """(the tower input of a request's images, padded to its bucket; the real row count M)."""
    inputs = pack_images([im.patches for im in images], [im.grid for im in images], vision_config)
    kh, kw = vision_config.merge_kernel_size
    return pad_vision_inputs(inputs, patch_bucket(inputs.num_patches), kh * kw), inputs.num_tokens


def check_image_request(prompt: Sequence[int], images: Sequence[ProcessedImage], pad_id: int | None,
                        vision_config) -> None:
    """Raise `ValueError` when a request's images cannot be spliced into its prompt (or the
    vision model with `vision_config`, None for none, cannot read them)."""
    if not images:
        return
    if vision_config is None:
        raise ValueError(f"the request has {len(images)} image(s) but this model has no vision tower "
                         "(load one: a checkpoint with vision_config, or vision=True / --vision for a "
                         "seeded random tower)")
    if pad_id is None:
        raise ValueError("the request has images but the tokenizer has no <|media_pad|> token")
    p, (kh, kw) = vision_config.patch_size, vision_config.merge_kernel_size
    for i, im in enumerate(images):
        h, w = im.grid
        if tuple(im.patches.shape[1:]) != (3, p, p) or h % kh or w % kw:
            raise ValueError(f"image {i}: patches {tuple(im.patches.shape)} on a {h}x{w} grid do not fit the vision "
                             f"model (patch_size {p}, merge {kh}x{kw}); process it with Engine.image_prompts()")
    n_pad = int(np.sum(np.asarray(prompt) == pad_id))
    n_rows = sum(im.num_tokens for im in images)
    if n_pad != n_rows:
        raise ValueError(f"the prompt has {n_pad} <|media_pad|> tokens (id {pad_id}) but its {len(images)} "
                         f"image(s) make {n_rows} rows; they must be equal (render the prompt with the same "
                         "images, e.g. k31jax.vision.ImagePrompts)")


def chunk_splice(splice_ids: np.ndarray, image_rows: Sequence[np.ndarray | None], next_row: list[int],
                 pad_id: int) -> np.ndarray | None:
    """The image rows of one prefill call, or None when it has no pad to splice.

    splice_ids [B, w]: the call's token ids, -1 where nothing is spliced. image_rows[i]: row
    i's image embeddings [M_i, D] (None without images); next_row[i]: the first of them not yet
    spliced (advanced in place). Returns `[B * w, D]`: the rows in row-major pad order, then zeros.
    """
    b, w = splice_ids.shape
    parts = []
    for i in range(b):
        k = int(np.sum(splice_ids[i] == pad_id))
        if k:
            parts.append(image_rows[i][next_row[i]:next_row[i] + k])
            next_row[i] += k
    if not parts:
        return None
    rows = np.concatenate(parts)
    buf = np.zeros((b * w, rows.shape[1]), rows.dtype)
    buf[:len(rows)] = rows
    return buf
