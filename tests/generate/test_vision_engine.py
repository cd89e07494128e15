"""Image prompts through generation: render -> tokenize -> engine, the rows spliced at the pad
positions (the prefill input, and AttnRes snapshot 0), chunked prefill with an image across a
chunk boundary == one-piece forward, batches mixing requests with and without images, the
scheduler's prefix cache keyed on image content, the CLI (`generate --image`, chat `/image`),
the server's request conversion, loading (seeded random tower), and clear image errors.

One module-scoped engine over a 2-layer tiny model (KDA, then MLA) and a small vision model
loaded from release-layout tensors, so the expected rows come from the float64 reference of
tests/refs/vision.py (written from vision.md), not from the code under test. Prompts are
prefilled 16 tokens at a time; batches of 1 and 3.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from helpers.model import randomize, tiny_config
from k31jax import K31ForCausalLM
from k31jax.chat import ByteTokenizer, ChatTemplateError, Segment, apply_chat_template
from k31jax.cli import main
from k31jax.cli._generate import run_chat
from k31jax.generate import ChatSession, Engine, LoadedModel, Request, Scheduler, load_model
from k31jax.generate._programs import image_prefill_embeds
from k31jax.generate._images import patch_bucket
from k31jax.generate import _loading
from k31jax.generate._loading import EMBEDDED_VISION
from k31jax.generate._prefix import PrefixCache, image_prefix_key
from k31jax.generate._slots import Snapshot
from k31jax.serve import _anthropic as anth
from k31jax.serve import _openai as oai
from k31jax.serve._protocol import APIError
from k31jax.vision import ImagePrompts, load_vision_model, preprocess_image, release_shapes
from refs import vision as RV


MAX_LEN, CHUNK = 192, 16
CFG = tiny_config(num_hidden_layers=2, layer_types=("kda", "mla"))
VCFG = dataclasses.replace(EMBEDDED_VISION, text_hidden_size=CFG.hidden_size)
NO_STOP = frozenset()


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


A, B, A2 = png(60, 40, 0), png(30, 90, 1), png(60, 40, 2)  # 6, 8 and 6 tokens; A2 is A's size


def release_weights(seed=7):
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in release_shapes(VCFG).items():
        scale = 0.2 if len(shape) == 1 else (1.0 if "pos_emb" in name else 1.0 / np.sqrt(shape[-1]))
        out[name] = (1.0 if len(shape) == 1 else 0.0) + scale * rng.standard_normal(shape)
    return out


def reference_rows(images, weights) -> np.ndarray:
    """The projected rows of processed images, in float64 from tests/refs/vision.py."""
    tower_w = {k[len("vision_tower."):]: v for k, v in weights.items() if k.startswith("vision_tower.")}
    proj_w = {k[len("mm_projector."):]: v for k, v in weights.items() if k.startswith("mm_projector.")}
    rc = dict(num_layers=VCFG.num_hidden_layers, num_heads=VCFG.num_attention_heads, patch_size=VCFG.patch_size,
              eps=VCFG.norm_eps)
    out, p = [], VCFG.patch_size
    for im in images:
        h, w = im.grid
        pixels = im.patches.reshape(h, w, 3, p, p).transpose(2, 0, 3, 1, 4).reshape(3, h * p, w * p)
        merged = RV.merge_2x2(RV.tower(pixels.astype(np.float64), tower_w, rc), h, w)
        out.append(RV.projector(merged, proj_w, VCFG.projector_ln_eps))
    return np.concatenate(out)


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer(384)


@pytest.fixture(scope="module")
def setup(tok):
    model = randomize(K31ForCausalLM(CFG, rngs=nnx.Rngs(0)), 1)
    weights = release_weights()
    vision = load_vision_model(weights, VCFG, dtype="float32")
    engine = Engine(model, tok, max_len=MAX_LEN, prefill_chunk=CHUNK, vision=vision)
    return model, vision, weights, engine


def raw_prompt(engine, tok, pieces):
    """[BOS] + text / image pieces (bytes = an image) -> (ids, processed images)."""
    prompts = engine.image_prompts()
    segs = [Segment(prompts({"type": "image_url", "image_url": {"url": data_url(p)}}), True)
            if isinstance(p, bytes) else Segment(p, False) for p in pieces]
    return [tok.bos_id] + tok.encode_segments(segs), tuple(prompts.images)


def expected_embeds(model, ids, rows_ref, pad_id, spliced=True):
    table = np.asarray(model.embed[...], np.float64)
    out = table[np.asarray(ids)]
    if spliced:
        at = np.flatnonzero(np.asarray(ids) == pad_id)
        assert len(at) == len(rows_ref)
        out[at] = rows_ref
    return out


def test_rendered_prompt_round_trips_and_equals_one_piece_forward(setup, tok):
    """render (OpenAI data URL + Anthropic base64 parts) -> tokenize -> engine, prefilled in
    chunks of 16 with an image across a chunk boundary == the one-piece forward (no cache) on
    independently spliced embeddings, teacher-forced on the engine's greedy tokens; the
    mixed embedding is the stack's input and AttnRes snapshot 0."""
    model, vision, weights, engine = setup
    pad = engine.core.media_pad_id
    prompts = engine.image_prompts()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": data_url(A)}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(B).decode()}},
        {"type": "text", "text": "? Briefly."}]}]
    ids = apply_chat_template(tok, messages, thinking=False, thinking_effort=None, media_prompt=prompts)
    text = tok.decode(ids)
    assert ("<|media_begin|>image 60x40<|media_content|>" + "<|media_pad|>" * 6 + "<|media_end|>"
            "<|media_begin|>image 30x90<|media_content|>" + "<|media_pad|>" * 8 + "<|media_end|>? Briefly.") in text
    assert [im.num_tokens for im in prompts.images] == [6, 8] and ids.count(pad) == 14

    n, steps = len(ids), 5
    length = -(-n // CHUNK) * CHUNK
    pads = np.flatnonzero(np.asarray(ids) == pad) + (length - n)  # positions in the left-padded prefill
    assert len({int(p) // CHUNK for p in pads[:6]}) + len({int(p) // CHUNK for p in pads[6:]}) > 2, \
        "no image straddles a chunk boundary: adjust the prompt text"
    got = engine.generate([Request(ids, max_new_tokens=steps, stop_ids=NO_STOP, images=prompts.images)]).tokens[0]

    rows_ref = reference_rows(prompts.images, weights)
    full = ids + got[:-1]
    embeds = expected_embeds(model, full, rows_ref, pad)
    forward = jax.jit(lambda t, e: model(t, embeds=e, return_intermediates=True))
    out = forward(jnp.asarray([full]), jnp.asarray(embeds[None], jnp.float32))
    logits, inter = np.asarray(out.logits[0]), out.intermediates
    assert list(np.argmax(logits[n - 1:], axis=-1)) == got
    np.testing.assert_allclose(np.asarray(inter["embed"][0]), embeds, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(inter["attn_in"][0, 0]), embeds, rtol=0, atol=1e-6)  # snapshot 0
    plain = expected_embeds(model, full, None, pad, spliced=False)  # the images matter: plain embeddings
    plain_logits = forward(jnp.asarray([full]), jnp.asarray(plain[None], jnp.float32)).logits  # give other logits
    assert np.abs(np.asarray(plain_logits[0, n - 1]) - logits[n - 1]).max() > 1e-2


def whole_chunks(tok, ids):
    """`ids` + spaces up to a multiple of the chunk: the scheduler then prefills them in calls
    of one width (it compiles one program per width; the test keeps to one)."""
    return ids + tok.encode(" " * (-len(ids) % CHUNK))


def mixed_requests(engine, tok, max_new_tokens=6):
    """[an image request, a text request whose ids hold the pad id, a two-image request]."""
    first = raw_prompt(engine, tok, ["import os\n", A, B, "\n"])
    second = raw_prompt(engine, tok, ["class C:", B, " pass", A2])
    pad = engine.core.media_pad_id
    return [Request(whole_chunks(tok, first[0]), max_new_tokens=max_new_tokens, stop_ids=NO_STOP, images=first[1]),
            Request(whole_chunks(tok, tok.encode("x = [") + [pad, pad] + tok.encode("]\n")),
                    max_new_tokens=max_new_tokens, stop_ids=NO_STOP),
            Request(whole_chunks(tok, second[0]), max_new_tokens=max_new_tokens, stop_ids=NO_STOP,
                    images=second[1])]


def test_spliced_rows_sit_exactly_at_the_pad_positions(setup, tok):
    """The engine's prefill input, chunk by chunk, for a batch of [image request, text request
    whose ids hold the pad id, two-image request]: each request's image rows exactly at its
    own pads (in order, across chunk boundaries), token embeddings everywhere else, and none
    spliced into the row without images."""
    model, vision, weights, engine = setup
    pad = engine.core.media_pad_id
    reqs = mixed_requests(engine, tok)
    length = -(-max(len(r.prompt) for r in reqs) // CHUNK) * CHUNK
    calls = list(engine.core.prefill_calls(reqs, length, CHUNK))
    assert {kind for kind, _ in calls} == {"prefill_image"} and len(calls) == length // CHUNK
    embed = jax.jit(lambda *data: image_prefill_embeds(model, *data))  # as inside the prefill program
    got = np.concatenate([np.asarray(embed(data[0], *data[2:])) for _, data in calls], axis=1)
    table = np.asarray(model.embed[...])
    for i, r in enumerate(reqs):
        ids, start = np.asarray(r.prompt), length - len(r.prompt)
        np.testing.assert_array_equal(got[i, :start], table[np.zeros(start, int)])  # left padding
        at = np.flatnonzero(ids == pad) if r.images else np.zeros(0, int)
        rest = np.setdiff1d(np.arange(len(ids)), at)
        np.testing.assert_array_equal(got[i, start + rest], table[ids[rest]])
        if r.images:
            rows = engine.core.image_rows(r)
            assert len({int(p) // CHUNK for p in start + at}) > 1  # the pads span chunks
            np.testing.assert_array_equal(got[i, start + at], rows)  # copied, bit for bit
            np.testing.assert_allclose(rows, reference_rows(r.images, weights), rtol=1e-5, atol=1e-5)
    assert np.sum(np.asarray(reqs[1].prompt) == pad) == 2  # pad ids without images stay token embeddings


@pytest.mark.slow
def test_static_batch_mixing_images_and_text_equals_each_alone(setup, tok):
    """Greedy tokens of the mixed batch in one static `Engine` batch == each request alone (the
    fast suite covers this by the exact batch prefill input above and the scheduler's mixed
    batch below; this compiles the batch-3 programs)."""
    model, vision, weights, engine = setup
    reqs = mixed_requests(engine, tok)
    together = engine.generate(reqs).tokens
    assert together == [engine.generate([r]).tokens[0] for r in reqs]
    assert "prefill" not in engine.compile_counts  # a vision engine runs the image program for every chunk


def test_scheduler_mixes_image_and_text_requests_and_keys_prefixes_on_the_image(setup, tok):
    """Continuous batching of [image, text with pad ids, two images] == each alone in the
    engine; a second turn with the same image resumes from the first turn's snapshot; the same
    token ids with another image of the same size do not, and match the engine cold. The
    vision program compiles once per patch bucket, the prefill program never per image count."""
    model, vision, weights, engine = setup
    sched = Scheduler(engine, max_batch=3, prefill_chunk=CHUNK, min_snapshot=4)

    def run(reqs):
        handles = [sched.submit(r) for r in reqs]
        sched._run_until_idle()
        return [h.result(timeout=0) for h in handles]

    mixed = mixed_requests(engine, tok)
    got = [f.completion.tokens for f in run(mixed)]
    assert got == [engine.generate([r]).tokens[0] for r in mixed]
    assert sched.compile_counts["prefill_image"] == 1  # one chunk program for every mix

    turn1, images = raw_prompt(engine, tok, ["look: ", A, "\n"])
    turn1 = whole_chunks(tok, turn1)
    more = tok.encode(" and now the same, again:")[:CHUNK]
    other = raw_prompt(engine, tok, ["look: ", A2, "\n"])[1]
    run([Request(turn1, max_new_tokens=3, stop_ids=NO_STOP, images=images)])
    (same,) = run([Request(turn1 + more, max_new_tokens=3, stop_ids=NO_STOP, images=images)])
    assert same.cached_tokens == len(turn1)
    (swapped,) = run([Request(turn1 + more, max_new_tokens=3, stop_ids=NO_STOP, images=other)])
    assert swapped.cached_tokens == 0
    for fin, imgs in ((same, images), (swapped, other)):
        cold = engine.generate([Request(turn1 + more, max_new_tokens=3, stop_ids=NO_STOP, images=imgs)])
        assert fin.completion.tokens == cold.tokens[0]
    image_sets = [mixed[0].images, mixed[2].images, images, other]
    buckets = {patch_bucket(sum(h * w for h, w in (im.grid for im in s))) for s in image_sets}
    assert engine.compile_counts["vision"] == len(buckets)
    assert sched.compile_counts["prefill_image"] == 1


def test_prefix_key_separates_images_with_the_same_ids():
    cache = PrefixCache(1 << 20)
    ids = [5, 9, 9, 9, 7]
    key_a = image_prefix_key(ids, 9, [("a", 1), ("b", 2)])
    assert key_a == (5, ("a", 0), ("b", 0), ("b", 1), 7) and image_prefix_key(ids, 9, []) == tuple(ids)
    cache.put(Snapshot(key_a, {"x": np.zeros(4)}))
    assert cache.longest_prefix(key_a + (1,)) is not None
    assert cache.longest_prefix(image_prefix_key(ids, 9, [("a", 1), ("c", 2)]) + (1,)) is None
    assert cache.longest_prefix(tuple(ids) + (1,)) is None


def test_cli_generate_image_and_chat_image_command(setup, tok, tmp_path, monkeypatch, capsys):
    model, vision, weights, engine = setup
    from k31jax.cli import _generate

    image = tmp_path / "a.png"
    image.write_bytes(A)
    loads = []

    def fake_load(ckpt, **kw):
        loads.append(kw["vision"])
        return LoadedModel(model, tok, "test", vision=vision if kw["vision"] else None,
                           vision_banner="image inputs use a SEEDED RANDOM vision tower (test)")

    monkeypatch.setattr(_generate, "load_generation_model", fake_load)
    args = ["--config", "tiny", "--max-len", str(MAX_LEN), "--prefill-chunk", str(CHUNK), "--max-new-tokens", "3"]
    assert main(["generate", "--raw", "--prompt", "x = ", "--image", str(image), "--image", str(image), *args]) == 0
    out, err = capsys.readouterr()
    assert loads == [True] and "SEEDED RANDOM vision tower" in err
    assert "images: 60x40 -> 6 tokens, 60x40 -> 6 tokens" in err and "finish: length, 3 new tokens" in err

    bad = tmp_path / "bad.png"
    bad.write_bytes(A[:40])
    assert main(["generate", "--prompt", "x", "--image", str(bad), *args]) == 2
    assert main(["generate", "--prompt", "x", "--image", str(tmp_path / "none.png"), *args]) == 2
    err = capsys.readouterr().err
    assert f"--image {bad}: corrupt" in err and "none.png: cannot read the image" in err

    chat = Engine(model, tok, max_len=MAX_LEN, prefill_chunk=CHUNK)  # no vision: the first /image loads it
    session = ChatSession(chat, thinking=False, effort=None, max_new_tokens=2)
    out, errs = io.StringIO(), io.StringIO()
    lines = f"/image {tmp_path / 'none.png'}\n/image {image}\nwhat is it?\n/history\n"
    run_chat(session, io.StringIO(lines), out, err=errs, load_vision=lambda: vision)
    assert "none.png: cannot read the image" in errs.getvalue()
    history = json.loads(out.getvalue()[out.getvalue().index("[\n"):])
    assert history[0]["content"] == [{"type": "image_url", "image_url": {"url": str(image)}},
                                     {"type": "text", "text": "what is it?"}]
    assert chat.vision is vision and [m["role"] for m in history] == ["user", "assistant"]


def test_server_request_conversion_reads_image_parts(setup, tok, tmp_path):
    model, vision, weights, engine = setup
    pad = engine.core.media_pad_id
    (tmp_path / "a.png").write_bytes(A)
    user = [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": data_url(B)}},
            {"type": "image_url", "image_url": {"url": "a.png"}}]
    body = {"model": "m", "messages": [{"role": "user", "content": user}], "reasoning_effort": "none"}
    spec = oai.chat_spec(body, tok, 512, image_dir=str(tmp_path))
    assert [im.num_tokens for im in spec.request.images] == [8, 6] and spec.request.prompt.count(pad) == 14
    engine.core.check_images(spec.request)
    with pytest.raises(APIError, match="--image-dir") as e:
        oai.chat_spec(body, tok, 512)
    assert e.value.status == 400
    outside = dict(body, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": f"file://{tmp_path}/../a.png"}}]}])
    with pytest.raises(APIError, match="outside the server's image directory"):
        oai.chat_spec(outside, tok, 512, image_dir=str(tmp_path))
    corrupt = dict(body, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": data_url(b"\x89PNG\r\n\x1a\n not an image")}}]}])
    with pytest.raises(APIError, match=r"messages\[0\] \(user\): content part 0 \(image_url\): image: corrupt"):
        oai.chat_spec(corrupt, tok, 512)

    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(A).decode()}}
    abody = {"model": "m", "max_tokens": 4, "thinking": {"type": "disabled"},
             "messages": [{"role": "user", "content": [block, {"type": "text", "text": "?"}]}]}
    aspec = anth.messages_spec(abody, tok, 512)
    assert [im.num_tokens for im in aspec.request.images] == [6]
    assert anth.count_tokens(abody, tok) == len(aspec.request.prompt)
    url_block = dict(block, source={"type": "url", "url": "https://example.com/a.png"})
    with pytest.raises(APIError, match="only 'base64' sources are read"):
        anth.messages_spec(dict(abody, messages=[{"role": "user", "content": [url_block]}]), tok, 512)

    text_only = Engine(model, tok, max_len=MAX_LEN, prefill_chunk=CHUNK)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.core.check_images(aspec.request)
    with pytest.raises(ValueError, match=r"5 <\|media_pad\|> tokens .* make 6 rows"):
        engine.core.check_images(Request([pad] * 5, images=aspec.request.images))


def test_load_model_builds_a_seeded_random_tower_on_demand():
    """The embedded default model has no trained tower: `vision=True` builds a small one from
    the seed (deterministic, random, and said so); without it the tower is built only when
    asked for; a text-only checkpoint says it has none."""
    loaded = load_model(vision=True, seed=3)
    assert "SEEDED RANDOM" in loaded.vision_banner and "embedded" in loaded.vision_banner
    assert loaded.vision.projector.cfg.text_hidden_size == loaded.model.config.hidden_size
    params = lambda m: [np.asarray(x) for x in jax.tree.leaves(nnx.state(m, nnx.Param))]  # noqa: E731
    rebuild = _loading._random_vision(loaded.model.config, 3, "the embedded default model")
    for x, y in zip(params(loaded.vision), params(rebuild()[0])):
        np.testing.assert_array_equal(x, y)
    other = _loading._random_vision(loaded.model.config, 4, "the embedded default model")()[0]
    assert not np.array_equal(np.asarray(other.tower.patch_embed[...]), np.asarray(loaded.vision.tower.patch_embed[...]))
    built = []
    lazy = LoadedModel(loaded.model, loaded.tokenizer, "embedded",
                       vision_loader=lambda: built.append(1) or (loaded.vision, "random"))
    assert lazy.vision is None and not built
    assert lazy.load_vision() is loaded.vision and lazy.load_vision() is loaded.vision and built == [1]
    with pytest.raises(ValueError, match="has no vision tower"):
        LoadedModel(loaded.model, loaded.tokenizer, "ckpt-dir").load_vision()


def test_image_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="corrupt or unrecognised image data"):
        preprocess_image(b"\x89PNG\r\n\x1a\n not an image")
    with pytest.raises(ValueError, match="cannot read the image"):
        preprocess_image(tmp_path / "missing.png")
    with pytest.raises(ChatTemplateError, match=r"content part 0 \(image_url\).*cannot read"):
        apply_chat_template(ByteTokenizer(384), [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(tmp_path / "missing.png")}}]}], media_prompt=ImagePrompts())
