"""Host-side layout of packed images: everything the tower needs besides the pixels.

The per-image sizes live here, in NumPy, so the jitted tower sees only arrays whose shapes
depend on the total patch count N and merged-token count M (one compile per (N, M), not one
per combination of image sizes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from ..config import VisionConfig
from ._ops import ROPE_MAX_GRID


def bilinear_source(out_size: int, in_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each output index: the two input indices and their weights of a bilinear resize
    with `align_corners=False` and no antialias (torch `F.interpolate(mode="bilinear")`):
    source coordinate `(i + 0.5) * in/out - 0.5`, clamped at 0, right neighbour clamped at the edge."""
    src = np.maximum((np.arange(out_size, dtype=np.float64) + 0.5) * (in_size / out_size) - 0.5, 0.0)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, in_size - 1)
    frac = src - lo
    return lo, hi, frac


def bilinear_taps(grid_h: int, grid_w: int, table_h: int, table_w: int) -> tuple[np.ndarray, np.ndarray]:
    """The four taps (indices into the row-major flattened table) and weights for each patch
    of a `grid_h x grid_w` grid, row-major. The identity when the sizes match."""
    y0, y1, fy = bilinear_source(grid_h, table_h)
    x0, x1, fx = bilinear_source(grid_w, table_w)
    ys0, ys1, fys = (a[:, None] for a in (y0, y1, fy))
    xs0, xs1, fxs = (a[None, :] for a in (x0, x1, fx))
    index = np.stack([ys0 * table_w + xs0, ys0 * table_w + xs1, ys1 * table_w + xs0, ys1 * table_w + xs1], -1)
    weight = np.stack([(1 - fys) * (1 - fxs), (1 - fys) * fxs, fys * (1 - fxs), fys * fxs], -1)
    shape = (grid_h * grid_w, 4)
    return np.broadcast_to(index, (grid_h, grid_w, 4)).reshape(shape), np.broadcast_to(weight, (grid_h, grid_w, 4)).reshape(shape)


def merge_index(grid_h: int, grid_w: int, kernel: tuple[int, int], offset: int = 0) -> np.ndarray:
    """`[M, kh*kw]` patch indices of each merged token, tokens row-major over the
    `(grid_h/kh, grid_w/kw)` grid, patches within a token row-major (TL, TR, BL, BR)."""
    kh, kw = kernel
    idx = np.arange(grid_h * grid_w).reshape(grid_h // kh, kh, grid_w // kw, kw)
    return idx.transpose(0, 2, 1, 3).reshape(-1, kh * kw) + offset


@dataclasses.dataclass(frozen=True)
class VisionInputs:
    """Packed images for the tower (all arrays; see `pack_images`).

    patches [N, 3, p, p]; segment_ids [N] (image index, non-decreasing); positions [N, 2]
    (row, column); pos_index / pos_weight [N, 4] (position-table taps); merge_index [M, kh*kw].
    """

    patches: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    pos_index: np.ndarray
    pos_weight: np.ndarray
    merge_index: np.ndarray

    @property
    def num_patches(self) -> int:
        return int(self.patches.shape[0])

    @property
    def num_tokens(self) -> int:
        """LLM tokens (merged rows) of all the images together."""
        return int(self.merge_index.shape[0])


jax.tree_util.register_dataclass(VisionInputs, data_fields=[f.name for f in dataclasses.fields(VisionInputs)],
                                 meta_fields=[])


def pack_images(patches: Sequence[np.ndarray], grids: Sequence[tuple[int, int]], cfg: VisionConfig) -> VisionInputs:
    """Pack per-image patches `[h*w, 3, p, p]` (row-major over an `h x w` patch grid) into one
    sequence, images in order. Each grid must be a multiple of the merge kernel and at most
    512 x 512 patches (the RoPE tables' extent)."""
    if len(patches) != len(grids):
        raise ValueError(f"pack_images: {len(patches)} patch arrays but {len(grids)} grids")
    if not patches:
        raise ValueError("pack_images: no images")
    kh, kw = cfg.merge_kernel_size
    p = cfg.patch_size
    seg, pos, tap_i, tap_w, merge = [], [], [], [], []
    offset = 0
    for i, (x, (h, w)) in enumerate(zip(patches, grids)):
        if tuple(x.shape) != (h * w, 3, p, p):
            raise ValueError(f"pack_images: image {i} has patches of shape {tuple(x.shape)}, expected "
                             f"{(h * w, 3, p, p)} for its {h}x{w} grid")
        if h % kh or w % kw:
            raise ValueError(f"pack_images: image {i} grid {h}x{w} is not a multiple of the merge kernel {kh}x{kw}")
        if not (1 <= h <= ROPE_MAX_GRID and 1 <= w <= ROPE_MAX_GRID):
            raise ValueError(f"pack_images: image {i} grid {h}x{w} exceeds {ROPE_MAX_GRID}x{ROPE_MAX_GRID} patches")
        seg.append(np.full(h * w, i, np.int32))
        rows, cols = np.divmod(np.arange(h * w), w)
        pos.append(np.stack([rows, cols], -1).astype(np.int32))
        ti, tw = bilinear_taps(h, w, cfg.pos_emb_height, cfg.pos_emb_width)
        tap_i.append(ti.astype(np.int32))
        tap_w.append(tw.astype(np.float32))
        merge.append(merge_index(h, w, (kh, kw), offset).astype(np.int32))
        offset += h * w
    return VisionInputs(
        patches=np.concatenate([np.asarray(x, np.float32) for x in patches]),
        segment_ids=np.concatenate(seg), positions=np.concatenate(pos), pos_index=np.concatenate(tap_i),
        pos_weight=np.concatenate(tap_w), merge_index=np.concatenate(merge))
