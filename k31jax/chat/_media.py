"""Image content parts of chat messages and the K3 media block (vision.md §5).

This layer knows the message formats and the token markup, not images: reading pixels and
counting an image's tokens is `k31jax.vision`'s job, which builds a ``media_prompt`` for
``render_k3`` from ``image_part_bytes`` and ``media_block``.

Accepted parts:
- OpenAI ``{"type": "image_url", "image_url": {"url": URL}}`` (or ``"image_url": URL``), URL a
  ``data:<mime>;base64,...`` URL, a ``file://`` URL or a local path;
- Anthropic ``{"type": "image", "source": {"type": "base64", "media_type": ..., "data": ...}}``.
Remote (http/https) URLs are not fetched. Video parts are rejected: K3 takes images only.
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = ("<|media_begin|>", "<|media_content|>", "<|media_end|>",
                                                    "<|media_pad|>")
IMAGE_PART_TYPES = ("image_url", "image")
VIDEO_PART_TYPES = ("video_url", "video", "input_video")


class MediaPartError(ValueError):
    """An image part k31jax cannot read; the message says which field and what was expected."""


def media_block(width: int, height: int, num_tokens: int) -> str:
    """`<|media_begin|>image {W}x{H}<|media_content|>` + `<|media_pad|>` x N + `<|media_end|>`,
    with the image's original size (before resize and pad)."""
    if num_tokens < 1:
        raise MediaPartError(f"an image has at least one token, got {num_tokens}")
    return f"{MEDIA_BEGIN}image {width}x{height}{MEDIA_CONTENT}{MEDIA_PAD * num_tokens}{MEDIA_END}"


def _decode_base64(data: Any, field: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise MediaPartError(f"{field}: expected a non-empty base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaPartError(f"{field}: not valid base64 ({e})") from None


def _from_url(url: Any, field: str, base_dir: Path | None) -> bytes:
    if not isinstance(url, str) or not url:
        raise MediaPartError(f"{field}: expected a data: URL, a file:// URL or a local path")
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise MediaPartError(f"{field}: a data: URL must be 'data:<mime>;base64,<data>'")
        return _decode_base64(payload, field)
    scheme = urllib.parse.urlparse(url).scheme
    if scheme in ("http", "https"):
        raise MediaPartError(f"{field}: remote URLs are not fetched ({url[:60]}); pass a data: URL or a local path")
    if scheme == "file":
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    elif scheme and len(scheme) > 1:  # one letter: a Windows drive, i.e. a path
        raise MediaPartError(f"{field}: unsupported URL scheme {scheme!r}; expected data:, file:// or a path")
    else:
        path = Path(url)
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    try:
        return path.read_bytes()
    except OSError as e:
        raise MediaPartError(f"{field}: cannot read {path} ({e.strerror or e})") from None


def image_part_bytes(part: Mapping[str, Any], *, base_dir: str | Path | None = None) -> bytes:
    """The encoded image of an image content part (formats in the module docstring); relative
    paths are resolved against `base_dir` when given."""
    kind = part.get("type")
    base = Path(base_dir) if base_dir is not None else None
    if kind in VIDEO_PART_TYPES:
        raise MediaPartError(f"{kind} parts are not supported: K3 accepts images only")
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, Mapping) else ref
        return _from_url(url, "image_url.url", base)
    if kind == "image":
        source = part.get("source")
        if not isinstance(source, Mapping):
            raise MediaPartError("image.source: expected an object {'type': 'base64', 'media_type', 'data'}")
        if source.get("type") != "base64":
            raise MediaPartError(f"image.source.type {source.get('type')!r}: only 'base64' sources are read")
        return _decode_base64(source.get("data"), "image.source.data")
    raise MediaPartError(f"content part type {kind!r} is not an image part ({list(IMAGE_PART_TYPES)})")
