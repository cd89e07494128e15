"""Placing projected image rows into the token embeddings (vision.md §3, last bullets).

`splice_image_embeddings` is pure and jit-friendly: the k-th `<|media_pad|>` of the batch
(row-major over [B, T]) takes row k of the image embeddings. Their counts must be equal; a
same-length scatter would silently drop features, so the check runs whenever the token ids are
concrete (host arrays or outside jit). `pad_rows` gives, for a chunk of one sequence, which
image rows its pads take, so chunked prefill splices the same rows as one-piece prefill.

Wiring plan (for `k31jax.nn` / `k31jax.generate`; this layer sits above `nn`):
1. The model gains an optional `embeds [B, T, D]` input used instead of `embed[tokens]`
   (AttnRes snapshot 0 is then this mixed embedding, vision.md §3).
2. Per request, the engine runs `VisionModel(pack_images(...))` once at admission (images in
   prompt order, which is `ImagePrompts.images`) and keeps the `[M, D]` rows with the request.
3. For each prefill chunk [start, stop) of each row, it takes `rows[pad_rows(ids, start, stop)]`,
   concatenates these per-row slices in batch-row order (rows without images add nothing),
   and calls `splice_image_embeddings(model.embed(chunk_ids), chunk_ids, rows, pad_id)`.
   Decode steps never see pad ids, so they skip the splice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _concrete(x) -> np.ndarray | None:
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def splice_image_embeddings(embeds: jax.Array, token_ids: jax.Array, image_embeds: jax.Array,
                            pad_id: int) -> jax.Array:
    """`embeds` [..., T, D] with each `pad_id` position replaced by the next row of
    `image_embeds` [M, D] (positions in row-major order), cast to `embeds.dtype`."""
    if embeds.shape[:-1] != token_ids.shape:
        raise ValueError(f"splice_image_embeddings: embeds {tuple(embeds.shape)} do not match token_ids "
                         f"{tuple(token_ids.shape)} (expected [..., T, D] and [..., T])")
    if image_embeds.ndim != 2 or image_embeds.shape[1] != embeds.shape[-1]:
        raise ValueError(f"splice_image_embeddings: image_embeds {tuple(image_embeds.shape)}, expected "
                         f"[M, {embeds.shape[-1]}]")
    ids = _concrete(token_ids)
    if ids is not None:
        n_pad = int(np.sum(ids == pad_id))
        if n_pad != image_embeds.shape[0]:
            raise ValueError(f"splice_image_embeddings: {n_pad} <|media_pad|> tokens (id {pad_id}) but "
                             f"{image_embeds.shape[0]} image embedding rows; they must be equal")
    is_pad = (token_ids == pad_id).reshape(-1)
    if image_embeds.shape[0] == 0:
        return embeds
    row = jnp.clip(jnp.cumsum(is_pad) - 1, 0, image_embeds.shape[0] - 1)
    flat = embeds.reshape(-1, embeds.shape[-1])
    out = jnp.where(is_pad[:, None], jnp.take(image_embeds, row, axis=0).astype(embeds.dtype), flat)
    return out.reshape(embeds.shape)


def pad_rows(token_ids, start: int, stop: int, pad_id: int) -> slice:
    """The image rows taken by the pads in `token_ids[start:stop]` of one sequence."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"pad_rows: expected one sequence of token ids, got shape {ids.shape}")
    first = int(np.sum(ids[:start] == pad_id))
    return slice(first, first + int(np.sum(ids[start:stop] == pad_id)))
