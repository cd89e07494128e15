"""The K3 image processor (`media_proc_cfg`, spec vision.md §4): decode, resize, pad, normalise,
patchify.

Pillow decodes (JPEG, PNG, WebP; EXIF orientation applied) and resizes (bicubic, as the
release processor does: re-implementing PIL's resampling would only add a source of drift).
An image that is too large, too small, corrupt or of another type raises `ImageError`, whose
message names the limit or the accepted formats.

A release folder's `preprocessor_config.json` holds the processor's settings under
`media_proc_cfg`; `read_processor_config` reads and checks them (a bad value is a
`ConfigError` naming the file and the field). Its video settings are not read (K3 takes no
video).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..config import ConfigError, VisionConfig

FORMATS = ("JPEG", "PNG", "WEBP")
PROCESSOR_FILE = "preprocessor_config.json"


class ImageError(ValueError):
    """An image k31jax will not read; the message names the limit or the expected formats."""


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """K3's `media_proc_cfg` (vision.md §4) and its transparent-background rule (§4 step 3)."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    # Patches before padding (K2.5 used 16384: it changes token counts).
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    chessboard_square: int = 8
    chessboard_white: int = 255
    chessboard_gray: int = 180

    @property
    def pad_multiple(self) -> int:
        return self.patch_size * self.merge_kernel_size


def _positive_int(where: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: expected an integer >= 1, got {value!r} ({type(value).__name__})")
    return value


def _three_numbers(where: str, value, *, positive: bool) -> tuple[float, float, float]:
    numbers = value if isinstance(value, list) and len(value) == 3 else None
    if numbers is None or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
                              or (positive and x <= 0) for x in numbers):
        want = "positive" if positive else "finite"
        raise ConfigError(f"{where}: expected a list of 3 {want} numbers (R, G, B), got {value!r}")
    return tuple(float(x) for x in numbers)


def read_processor_config(path: str | os.PathLike, vision: VisionConfig) -> ImageProcessorConfig:
    """The `media_proc_cfg` of a `preprocessor_config.json` (vision.md §4), checked: positive
    integer sizes and limits, 3-channel mean and std (std > 0), the patch and merge sizes of
    the `vision` tower, and no `fixed_output_tokens` (a fixed token count per image is not
    this processor's rule). Missing keys keep the tower's patch and merge sizes and the K3
    values of the rest."""
    path = Path(path)
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read as JSON ({e})") from None
    cfg = raw.get("media_proc_cfg") if isinstance(raw, dict) else None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected an object with a 'media_proc_cfg' object (the K3 image processor's "
                          "settings)")
    field = lambda key: f"{path}: media_proc_cfg.{key}"  # noqa: E731
    out = {}
    for key in ("patch_size", "in_patch_limit", "patch_limit_on_one_side"):
        if key in cfg:
            out[key] = _positive_int(field(key), cfg[key])
    if "merge_kernel_size" in cfg:
        merge = cfg["merge_kernel_size"]
        sides = merge if isinstance(merge, list) and len(merge) == 2 else [merge]
        if len(set(map(repr, sides))) != 1:
            raise ConfigError(f"{field('merge_kernel_size')}: expected one size (square blocks), got {merge!r}")
        out["merge_kernel_size"] = _positive_int(field("merge_kernel_size"), sides[0])
    for key in ("image_mean", "image_std"):
        if key in cfg:
            out[key] = _three_numbers(field(key), cfg[key], positive=key == "image_std")
    if cfg.get("fixed_output_tokens") is not None:
        raise ConfigError(f"{field('fixed_output_tokens')}: {cfg['fixed_output_tokens']!r}, expected null (the K3 "
                          "processor's token count follows the image size)")
    if out.setdefault("patch_size", vision.patch_size) != vision.patch_size:
        raise ConfigError(f"{field('patch_size')}: {out['patch_size']} disagrees with the checkpoint's "
                          f"vision_config.patch_size {vision.patch_size}")
    merge = out.setdefault("merge_kernel_size", vision.merge_kernel_size[0])
    if (merge, merge) != vision.merge_kernel_size:
        raise ConfigError(f"{field('merge_kernel_size')}: {merge} disagrees with the checkpoint's "
                          f"vision_config.merge_kernel_size {list(vision.merge_kernel_size)}")
    return ImageProcessorConfig(**out)


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What k31jax accepts before decoding. The processor itself takes any size >= 1 px (it
    scales down to at most 512 x 512 patches); these bound the memory of decoding."""

    max_bytes: int = 64 << 20
    # Decoded pixels (W * H). 2^27 admits a 10000 x 10000 photo; Pillow's own bomb check
    # (2 x 89,478,485) lies above, so this is the limit users meet.
    max_pixels: int = 1 << 27
    min_side: int = 1


@dataclasses.dataclass(frozen=True)
class ResizePlan:
    """Sizes of one image through the processor (vision.md §4 steps 1, 4 and 6)."""

    width: int
    height: int
    new_width: int
    new_height: int
    padded_width: int
    padded_height: int
    patch_size: int
    merge_kernel_size: int

    @property
    def grid(self) -> tuple[int, int]:
        """Patch grid (rows, columns) after padding."""
        return self.padded_height // self.patch_size, self.padded_width // self.patch_size

    @property
    def num_tokens(self) -> int:
        """LLM tokens (`<|media_pad|>`s) of the image."""
        f = self.patch_size * self.merge_kernel_size
        return (self.padded_height // f) * (self.padded_width // f)


def plan_resize(width: int, height: int, cfg: ImageProcessorConfig = ImageProcessorConfig()) -> ResizePlan:
    """Step 1 (scale under the patch limits, before padding) and step 4 (pad to the merge grid)."""
    if width < 1 or height < 1:
        raise ImageError(f"image size {width}x{height}: both sides must be at least 1 px")
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    scale = min(1.0, math.sqrt(cfg.in_patch_limit / (max(1, width // p) * max(1, height // p))),
                side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    f = cfg.pad_multiple
    return ResizePlan(width, height, new_w, new_h, -(-new_w // f) * f, -(-new_h // f) * f, p, cfg.merge_kernel_size)


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the tower: `patches [h*w, 3, p, p]` float32 over the padded
    `grid = (h, w)`, and the original (EXIF-oriented) size for the prompt's media block."""

    plan: ResizePlan
    patches: np.ndarray

    @property
    def width(self) -> int:
        return self.plan.width

    @property
    def height(self) -> int:
        return self.plan.height

    @property
    def grid(self) -> tuple[int, int]:
        return self.plan.grid

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens


def _read_source(source: bytes | str | os.PathLike, limits: ImageLimits) -> tuple[bytes, str]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data, where = bytes(source), "image"
    else:
        path = Path(source)
        where = str(path)
        try:
            size = path.stat().st_size
        except OSError as e:
            raise ImageError(f"{where}: cannot read the image ({e.strerror or e})") from None
        if size > limits.max_bytes:
            raise ImageError(f"{where}: {size:,} bytes is larger than the limit of {limits.max_bytes:,} bytes")
        data = path.read_bytes()
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: {len(data):,} bytes is larger than the limit of {limits.max_bytes:,} bytes")
    if not data:
        raise ImageError(f"{where}: empty image data")
    return data, where


def decode_image(source: bytes | str | os.PathLike, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Decode a JPEG, PNG or WebP (bytes or a path), EXIF orientation applied; checks the limits
    on the header's size before decoding the pixels."""
    data, where = _read_source(source, limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except Image.DecompressionBombError:
        raise ImageError(f"{where}: more pixels than the limit of {limits.max_pixels:,}") from None
    except UnidentifiedImageError:
        try:  # another format Pillow knows is unsupported; nothing Pillow knows is corrupt
            other = Image.open(io.BytesIO(data)).format
        except Exception:  # noqa: BLE001 - any failure to identify means the bytes are no image
            other = None
        if other:
            raise ImageError(f"{where}: {other} images are not supported; expected one of {list(FORMATS)}") from None
        raise ImageError(f"{where}: corrupt or unrecognised image data (expected one of {list(FORMATS)})") from None
    except (OSError, ValueError, SyntaxError) as e:  # a known header that does not parse
        raise ImageError(f"{where}: corrupt image data ({e})") from None
    w, h = image.size
    if w * h > limits.max_pixels:
        raise ImageError(f"{where}: {w}x{h} = {w * h:,} pixels is more than the limit of {limits.max_pixels:,}")
    if min(w, h) < limits.min_side:
        raise ImageError(f"{where}: {w}x{h} is smaller than the minimum of {limits.min_side} px per side")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image.load()
            return ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{where}: corrupt {image.format} data ({e})") from None


def _has_alpha(image: Image.Image) -> bool:
    return image.mode != "RGB" and ("A" in image.getbands() or "transparency" in image.info)


def chessboard(height: int, width: int, cfg: ImageProcessorConfig = ImageProcessorConfig()) -> np.ndarray:
    """The transparent-background pattern `[H, W]`: squares of `chessboard_square` px, white at
    the top left, gray where (row square + column square) is odd."""
    s = cfg.chessboard_square
    odd = ((np.arange(height)[:, None] // s) + (np.arange(width)[None, :] // s)) % 2 == 1
    return np.where(odd, cfg.chessboard_gray, cfg.chessboard_white).astype(np.uint8)


def resized_pixels(image: Image.Image, plan: ResizePlan, cfg: ImageProcessorConfig = ImageProcessorConfig()) -> np.ndarray:
    """Steps 2-4: bicubic resize (RGBA resized premultiplied by Pillow), alpha composited onto
    the chessboard with truncation to uint8, zero padding right and bottom: `[H', W', 3]` uint8."""
    alpha = _has_alpha(image)
    image = image.convert("RGBA" if alpha else "RGB")
    if image.size != (plan.new_width, plan.new_height):
        image = image.resize((plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(image)
    if alpha:
        # float32 alpha over the uint8 background, as the release processor computes it: in
        # float64 about 0.3% of the pixels land one level higher after the truncation.
        a = pixels[..., 3:].astype(np.float32) / 255.0
        bg = chessboard(plan.new_height, plan.new_width, cfg)[..., None]
        pixels = (a * pixels[..., :3] + (1 - a) * bg).astype(np.uint8)
    out = np.zeros((plan.padded_height, plan.padded_width, 3), np.uint8)
    out[:plan.new_height, :plan.new_width] = pixels
    return out


def patchify(pixels: np.ndarray, cfg: ImageProcessorConfig = ImageProcessorConfig()) -> np.ndarray:
    """Step 5: normalise `(x/255 - mean)/std` and cut into `[(H/p)*(W/p), 3, p, p]` patches,
    row-major over the patch grid, each patch channels-first."""
    p = cfg.patch_size
    x = (pixels / 255.0).astype(np.float32)
    x = (x - np.asarray(cfg.image_mean, np.float32)) * (1.0 / np.asarray(cfg.image_std, np.float32))
    h, w = pixels.shape[0] // p, pixels.shape[1] // p
    return np.ascontiguousarray(x.reshape(h, p, w, p, 3).transpose(0, 2, 4, 1, 3).reshape(h * w, 3, p, p))


def preprocess_image(source: Image.Image | bytes | str | os.PathLike,
                     cfg: ImageProcessorConfig = ImageProcessorConfig(),
                     limits: ImageLimits = ImageLimits()) -> ProcessedImage:
    """One image (a decoded PIL image, encoded bytes or a path) through the K3 processor."""
    image = source if isinstance(source, Image.Image) else decode_image(source, limits)
    plan = plan_resize(*image.size, cfg)
    return ProcessedImage(plan, patchify(resized_pixels(image, plan, cfg), cfg))
