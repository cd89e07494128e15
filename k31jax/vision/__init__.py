"""MoonViT-V2 vision tower, patch merger and projector; the K3 image processor; image prompts
(spec vision.md).

- Pure ops (`_ops`) on a packed patch sequence, thin NNX modules over them (`VisionTower`,
  `VisionProjector`, `VisionModel`) with logical axes on every parameter.
- `pack_images` lays out several images of different sizes as one sequence (host side).
- `preprocess_image` / `decode_image` / `plan_resize`: the K3 processor (Pillow decoding);
  `read_processor_config`: its settings from a release's `preprocessor_config.json`.
- `ImagePrompts`: a `media_prompt` for `k31jax.chat.render_k3` that collects the images.
- `splice_image_embeddings` / `pad_rows`: the projected rows into the token embeddings.
- `load_vision_model`: the modules from the release tensors (`vision_tower.*`, `mm_projector.*`).
"""

from ._layout import VisionInputs, pack_images
from ._load import VisionLoadError, load_vision_model, release_shapes, vision_state
from ._modules import VisionModel, VisionProjector, VisionTower, abstract_vision_model, count_vision_params
from ._preprocess import (FORMATS, PROCESSOR_FILE, ImageError, ImageLimits, ImageProcessorConfig, ProcessedImage,
                          ResizePlan, decode_image, plan_resize, preprocess_image, read_processor_config)
from ._prompt import ImagePrompts
from ._splice import pad_rows, splice_image_embeddings

__all__ = [
    "FORMATS", "PROCESSOR_FILE", "ImageError", "ImageLimits", "ImageProcessorConfig", "ImagePrompts", "ProcessedImage",
    "ResizePlan", "VisionInputs", "VisionLoadError", "VisionModel", "VisionProjector", "VisionTower",
    "abstract_vision_model", "count_vision_params", "decode_image", "load_vision_model", "pack_images", "pad_rows",
    "plan_resize", "preprocess_image", "read_processor_config", "release_shapes", "splice_image_embeddings",
    "vision_state",
]
