"""Image prompts for the chat renderer: a `media_prompt` that reads each image part, runs the
K3 processor, remembers the result and returns the part's media block (vision.md §5)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..chat import image_part_bytes, media_block
from ..config import VisionConfig
from ._layout import VisionInputs, pack_images
from ._preprocess import ImageLimits, ImageProcessorConfig, ProcessedImage, preprocess_image


class ImagePrompts:
    """`render_k3(messages, media_prompt=prompts)`: each image part becomes its media block
    with `num_tokens` pads; `prompts.images` then holds the processed images in prompt order
    and `prompts.pack(vision_config)` the tower's input.

    Relative image paths resolve against `base_dir` (default: the working directory)."""

    def __init__(self, processor: ImageProcessorConfig = ImageProcessorConfig(), limits: ImageLimits = ImageLimits(),
                 *, base_dir: str | os.PathLike | None = None):
        self.processor, self.limits, self.base_dir = processor, limits, base_dir
        self.images: list[ProcessedImage] = []

    def __call__(self, part: Mapping[str, Any]) -> str:
        image = preprocess_image(image_part_bytes(part, base_dir=self.base_dir), self.processor, self.limits)
        self.images.append(image)
        return media_block(image.width, image.height, image.num_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images)

    def pack(self, cfg: VisionConfig) -> VisionInputs:
        if cfg.patch_size != self.processor.patch_size:
            raise ValueError(f"ImagePrompts.pack: processor patch_size {self.processor.patch_size} != tower "
                             f"patch_size {cfg.patch_size}")
        return pack_images([im.patches for im in self.images], [im.grid for im in self.images], cfg)
