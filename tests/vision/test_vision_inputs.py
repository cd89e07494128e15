"""Image inputs: the K3 processor (sizes, pixels, EXIF, alpha, errors), image content parts in
the chat renderer, and splicing the projected rows at the `<|media_pad|>` positions.

Sizes are checked against `refs.vision.navit_size` (vision.md §4), pixels against the §4
formulas evaluated here in NumPy on images that need no resize (so Pillow's bicubic is not in
the comparison; the golden test covers resized images against the torch peer)."""

import base64
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from k31jax.chat import ChatTemplateError, media_block, render_k3
from k31jax.vision import (ImageError, ImageLimits, ImagePrompts, ImageProcessorConfig, decode_image, pad_rows,
                           plan_resize, preprocess_image, splice_image_embeddings)
from refs import vision as RV


PAD = 163605


def encode(array, fmt="PNG", **kw):
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **kw)
    return buf.getvalue()


def random_image(h, w, channels=3, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, channels), dtype=np.uint8)


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("size", [(1, 1), (13, 29), (28, 28), (224, 224), (1920, 1080), (1024, 1024), (4096, 4096),
                                  (8192, 256), (28672, 224), (1, 10000), (3583, 3585), (10000, 10000)])
def test_resize_plan_matches_the_rules(size):
    plan = plan_resize(*size)
    new_w, new_h, pw, ph, tokens = RV.navit_size(*size)
    assert (plan.new_width, plan.new_height, plan.padded_width, plan.padded_height) == (new_w, new_h, pw, ph)
    assert plan.num_tokens == tokens and plan.grid == (ph // 14, pw // 14)
    assert max(plan.grid) <= 512


def test_known_token_counts():
    assert plan_resize(1024, 1024).num_tokens == 37 * 37  # 1036 / 28
    assert plan_resize(1920, 1080).num_tokens == 69 * 39
    big = plan_resize(10000, 10000)  # the patch limit applies before padding
    assert big.grid[0] * big.grid[1] == 66_564 > 65_536
    assert plan_resize(3584, 3584, ImageProcessorConfig(in_patch_limit=16384)).num_tokens < \
        plan_resize(3584, 3584).num_tokens  # K2.5's limit gives fewer tokens


# ----------------------------------------------------------------------------- pixels


def expected_patches(pixels_hw3, padded_h, padded_w, p=14):
    """vision.md §4 steps 4-5 in float64: pad with 0 (-> -1.0), (x/255 - 0.5)/0.5, patchify."""
    out = np.zeros((padded_h, padded_w, 3))
    out[:pixels_hw3.shape[0], :pixels_hw3.shape[1]] = pixels_hw3
    x = (out / 255.0 - 0.5) / 0.5
    h, w = padded_h // p, padded_w // p
    return x.reshape(h, p, w, p, 3).transpose(0, 2, 4, 1, 3).reshape(h * w, 3, p, p)


def test_pixels_padding_normalisation_and_patch_order():
    rgb = random_image(30, 45)  # no resize; pads to 56 x 56
    image = preprocess_image(encode(rgb))
    assert (image.width, image.height, image.grid, image.num_tokens) == (45, 30, (4, 4), 4)
    np.testing.assert_allclose(image.patches, expected_patches(rgb, 56, 56), atol=1e-7)
    assert image.patches.dtype == np.float32 and image.patches[-1].max() == -1.0  # all padding


def test_alpha_is_composited_on_the_chessboard_after_resize():
    rgba = random_image(20, 20, 4, seed=1)
    image = preprocess_image(encode(rgba))
    a = rgba[..., 3:].astype(np.float32) / 255
    yy, xx = np.mgrid[:20, :20]
    board = np.where(((yy // 8) + (xx // 8)) % 2 == 1, 180, 255).astype(np.uint8)[..., None]
    rgb = (a * rgba[..., :3] + (1 - a) * board).astype(np.uint8)  # truncation, not rounding
    np.testing.assert_allclose(image.patches, expected_patches(rgb, 28, 28), atol=1e-7)


def test_exif_orientation_is_applied():
    rgb = random_image(16, 40, seed=2)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(rgb, "PNG", exif=exif)
    image = decode_image(data)
    assert image.size == (16, 40)
    np.testing.assert_array_equal(np.asarray(image), np.rot90(rgb, k=-1))
    assert preprocess_image(data).width == 16


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_formats_decode(fmt):
    rgb = random_image(50, 70, seed=3)
    image = decode_image(encode(rgb, fmt, **({"lossless": True} if fmt == "WEBP" else {})))
    assert image.size == (70, 50)
    if fmt != "JPEG":
        np.testing.assert_array_equal(np.asarray(image.convert("RGB")), rgb)


def test_errors_name_the_limit(tmp_path):
    png = encode(random_image(40, 60))
    with pytest.raises(ImageError, match="60x40 = 2,400 pixels is more than the limit of 1,000"):
        decode_image(png, ImageLimits(max_pixels=1000))
    with pytest.raises(ImageError, match="larger than the limit of 100 bytes"):
        decode_image(png, ImageLimits(max_bytes=100))
    with pytest.raises(ImageError, match="60x40 is smaller than the minimum of 50 px per side"):
        decode_image(png, ImageLimits(min_side=50))
    with pytest.raises(ImageError, match="corrupt or unrecognised image data"):
        decode_image(b"\x00not an image at all")
    with pytest.raises(ImageError, match=r"corrupt (JPEG )?(image )?data"):
        decode_image(encode(random_image(64, 64), "JPEG")[:300])
    with pytest.raises(ImageError, match=r"GIF images are not supported; expected one of \['JPEG', 'PNG', 'WEBP'\]"):
        decode_image(encode(random_image(8, 8)[..., 0], "GIF"))
    with pytest.raises(ImageError, match="cannot read the image"):
        decode_image(tmp_path / "missing.png")


# ----------------------------------------------------------------------------- chat


def test_image_parts_become_media_blocks(tmp_path):
    small, wide = random_image(30, 45, seed=4), random_image(20, 100, seed=5)
    (tmp_path / "wide.png").write_bytes(encode(wide))
    data_url = "data:image/png;base64," + base64.b64encode(encode(small)).decode()
    anthropic = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(encode(small)).decode()}}
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "image_url", "image_url": {"url": "wide.png"}}, anthropic, {"type": "text", "text": "please."}]}]
    prompts = ImagePrompts(base_dir=tmp_path)
    segments = render_k3(messages, media_prompt=prompts, thinking=False)
    blocks = [s.text for s in segments if "<|media_begin|>" in s.text]
    assert all(s.special for s in segments if "<|media_begin|>" in s.text)
    assert blocks == [media_block(45, 30, 4), media_block(100, 20, 4 * 1), media_block(45, 30, 4)]
    assert blocks[1].count("<|media_pad|>") == plan_resize(100, 20).num_tokens == 4
    assert blocks[0] == "<|media_begin|>image 45x30<|media_content|>" + "<|media_pad|>" * 4 + "<|media_end|>"
    assert [im.width for im in prompts.images] == [45, 100, 45] and prompts.num_tokens == 12

    without = render_k3(messages, thinking=False)  # no media_prompt: the text placeholder
    assert sum(s.text == "<|kimi_image_placeholder|>" for s in without) == 3


@pytest.mark.parametrize("part,message", [
    ({"type": "video_url", "video_url": {"url": "clip.mp4"}}, "video_url part: K3 accepts images only"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "remote URLs are not fetched"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
    ({"type": "image", "source": {"type": "url", "url": "x"}}, "only 'base64' sources are read"),
    ({"type": "image_url", "image_url": {"url": "/nonexistent/a.png"}}, "cannot read /nonexistent/a.png"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"junk").decode()}},
     "corrupt or unrecognised image data"),
])
def test_bad_parts_name_the_message_and_part(part, message):
    messages = [{"role": "system", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "x"}, part]}]
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] \(user\): content part 1.*" + message):
        render_k3(messages, media_prompt=ImagePrompts())


# ----------------------------------------------------------------------------- splice


def test_splice_places_rows_exactly_at_the_pads():
    rng = np.random.default_rng(6)
    ids = np.array([[5, PAD, PAD, 7, PAD, 9], [1, 2, 3, 4, 5, 6], [PAD, 8, 8, 8, 8, PAD]])
    embeds = rng.standard_normal((3, 6, 4)).astype(np.float32)
    rows = rng.standard_normal((5, 4)).astype(np.float32)
    got = np.asarray(splice_image_embeddings(jnp.asarray(embeds), jnp.asarray(ids), jnp.asarray(rows), PAD))
    want = embeds.copy()
    want[ids == PAD] = rows  # boolean indexing is row-major
    np.testing.assert_array_equal(got, want)
    jitted = jax.jit(splice_image_embeddings, static_argnums=3)(embeds, ids, rows, PAD)
    np.testing.assert_array_equal(np.asarray(jitted), want)
    with pytest.raises(ValueError, match="5 <\\|media_pad\\|> tokens .* but 4 image embedding rows"):
        splice_image_embeddings(jnp.asarray(embeds), jnp.asarray(ids), jnp.asarray(rows[:4]), PAD)


def test_chunked_splice_equals_one_piece():
    rng = np.random.default_rng(7)
    ids = np.array([3, PAD, PAD, PAD, 4, 5, PAD, PAD, 6, PAD, 1])
    embeds = rng.standard_normal((len(ids), 4)).astype(np.float32)
    rows = rng.standard_normal((int(np.sum(ids == PAD)), 4)).astype(np.float32)
    whole = np.asarray(splice_image_embeddings(embeds, ids, rows, PAD))
    pieces = []
    for start, stop in ((0, 2), (2, 7), (7, 8), (8, 11)):
        chunk_rows = rows[pad_rows(ids, start, stop, PAD)]
        pieces.append(np.asarray(splice_image_embeddings(embeds[start:stop], ids[start:stop], chunk_rows, PAD)))
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    assert pad_rows(ids, 2, 7, PAD) == slice(1, 4)
