"""Token healing (`k31jax.generate.heal_prompt`, `Request.healed_prefix`): the back-off rule,
the prefix index against a brute-force scan of the vocabulary, the decoder's skip, and the
engine's constrained first token."""

from __future__ import annotations

import numpy as np
import pytest

from k31jax.chat import ByteTokenizer, KimiTokenizer
from k31jax.generate import Engine, Request, heal_prompt, load_model
from k31jax.generate._healing import first_token_mask, tokens_starting_with
from k31jax.generate._loading import embedded_model_dir


@pytest.fixture(scope="module")
def bpe():
    return KimiTokenizer.from_dir(embedded_model_dir())


def test_heal_prompt_backs_off_one_whole_text_token(bpe):
    ids = [bpe.bos_id] + bpe.encode("def fibonacci(n):")
    prompt, tail = heal_prompt(bpe, ids)
    assert prompt == ids[:-1] and tail == bpe.token_bytes(ids[-1]) and tail.endswith(b":")
    assert heal_prompt(bpe, ids[:1]) == (ids[:1], b"")  # nothing would be left to continue
    assert heal_prompt(bpe, ids[:1] * 2) == (ids[:1] * 2, b"")  # a special token is not text
    byte = ByteTokenizer(vocab_size=512)
    split = [byte.bos_id] + byte.encode("é")  # two bytes of one character: the last is no text
    assert heal_prompt(byte, split) == (split, b"")
    assert heal_prompt(byte, split[:1] + byte.encode("a")) == (split[:1], b"a")


@pytest.mark.parametrize("prefix", [b"):", b")", b" ", b"\n", b"def", b"zzzz", b""])
def test_tokens_starting_with_equals_a_scan_of_the_vocabulary(bpe, prefix):
    expect = [i for i in range(bpe.vocab_size)
              if not bpe.is_special(i) and bpe.token_bytes(i).startswith(prefix)]
    assert tokens_starting_with(bpe, prefix).tolist() == expect
    mask = first_token_mask(bpe, [prefix, b""], bpe.vocab_size + 6)
    assert mask[1].all() and (np.flatnonzero(mask[0]).tolist() == expect if prefix else mask[0].all())


def test_decoder_skips_the_healed_bytes_once(bpe):
    ids = bpe.encode("):\n    return n):")
    dec = bpe.stream_decoder(skip=bpe.token_bytes(ids[0])[:2])
    assert dec.feed(ids) + dec.flush() == bpe.decode(ids)[2:]
    dec = bpe.stream_decoder(skip=b"x")  # a first token without the prefix loses nothing
    assert dec.feed(ids) + dec.flush() == bpe.decode(ids)


def test_engine_constrains_the_first_token_and_hides_the_prefix():
    """Byte vocabulary: the only token that starts with the backed-off byte is that byte, so a
    healed greedy run is the unhealed one, with the backed-off byte as its first token."""
    lm = load_model(config="tiny")
    tok = lm.tokenizer
    engine = Engine(lm.model, tok, max_len=128, prefill_chunk=16)
    for text in ("the sea is wide", "x = [1, 2"):
        ids = [tok.bos_id] + tok.encode(text)
        prompt, tail = heal_prompt(tok, ids)
        plain = engine.generate([ids], 12, stop_ids=frozenset()).completions[0]
        healed = engine.generate([Request(prompt, max_new_tokens=13, stop_ids=frozenset(), healed_prefix=tail)])
        comp = healed.completions[0]
        assert comp.tokens == [ids[-1]] + plain.tokens and comp.text == plain.text
        assert plain.tokens[0] != ids[-1]  # else the constraint was not what chose it
    with pytest.raises(ValueError, match="healed_prefix"):
        Engine(lm.model, None, max_len=128).generate([Request(prompt, healed_prefix=tail)])
