"""The shipped embedded default model: intact, trained, deterministic, and the CLI's default."""

from __future__ import annotations

import hashlib
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from k31jax import ModelConfig
from k31jax.chat import KimiTokenizer
from k31jax.cli import main
from k31jax.generate import Engine, load_model
from k31jax.generate._loading import embedded_model_dir

ASSET = embedded_model_dir()

# Python the model never saw in training (written for this test), to check it is trained.
SNIPPET = '''def merge_intervals(intervals):
    """Merge overlapping intervals given as (start, stop) pairs."""
    result = []
    for start, stop in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1] = (result[-1][0], max(result[-1][1], stop))
        else:
            result.append((start, stop))
    return result
'''


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def test_files_match_the_checksums_recorded_at_training():
    sums = (ASSET / "SHA256SUMS").read_text().split("\n")
    listed = {}
    for line in filter(None, sums):
        digest, name = line.split("  ", 1)
        listed[name] = digest
    present = {str(p.relative_to(ASSET)) for p in ASSET.rglob("*") if p.is_file() and p.name != "SHA256SUMS"}
    assert present == set(listed)
    for name, digest in listed.items():
        assert hashlib.sha256((ASSET / name).read_bytes()).hexdigest() == digest, name
    assert sum((ASSET / n).stat().st_size for n in listed) <= 25 * 2**20


def test_has_every_k31_feature_and_packed_experts(loaded):
    cfg = loaded.model.config
    assert cfg.expert_weights == "mxfp4" and cfg.use_indexer and cfg.use_attn_res
    assert {"kda", "mla"} <= set(cfg.layer_types) and cfg.moe_layers and cfg.mla_use_output_gate
    preset = ModelConfig.preset("embedded")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts) == (
        preset.hidden_size, preset.num_hidden_layers, preset.num_experts)
    meta = json.loads((ASSET / "corpus.json").read_text())
    assert meta["train"] and meta["heldout"] and "PSF" in meta["licence"]
    trained, distilled = meta["command"][1:]  # the commands that made it: dense training, then distillation
    assert trained.startswith("k31jax train") and "--qat" in trained and "--distill-indexer" in distilled
    assert not {r["path"] for r in meta["train"]} & {r["path"] for r in meta["heldout"]}
    assert loaded.raw_completion and loaded.banner


def test_tokenizer_is_the_shipped_bpe(loaded):
    """The model's own BPE (trained on the training split only, `corpus.json` records its hash),
    not the byte-level fallback: the vocabulary is its ranks + the 256 K3 special slots."""
    tok, cfg = loaded.tokenizer, loaded.model.config
    meta = json.loads((ASSET / "corpus.json").read_text())["tokenizer"]
    assert hashlib.sha256((ASSET / "tiktoken.model").read_bytes()).hexdigest() == meta["tiktoken.model sha256"]
    assert isinstance(tok, KimiTokenizer) and tok.vocab_size == cfg.vocab_size == meta["ranks"] + 256
    assert (tok.bos_id, tok.end_of_msg_id, tok.pad_id) == (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    ids = tok.encode(SNIPPET)
    assert tok.decode(ids) == SNIPPET and len(ids) < len(SNIPPET.encode()) / 2


def test_is_trained_on_unseen_python(loaded):
    """Random weights give ~log2(2304) / 2.9 = 3.8 bits per byte (2.9 bytes per token); the
    trained model far less."""
    model, tok = loaded.model, loaded.tokenizer
    ids = [tok.bos_id] + tok.encode(SNIPPET)
    logits = model(jnp.asarray([ids[:-1]], jnp.int32)).logits
    logp = np.asarray(logits[0], np.float64)
    logp = logp - np.log(np.exp(logp - logp.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logp.max(-1, keepdims=True)
    nll = -logp[np.arange(len(ids) - 1), ids[1:]].sum()
    bits_per_byte = nll / math.log(2) / len(SNIPPET.encode())
    assert bits_per_byte < 2.5, bits_per_byte  # 1.69 when shipped


def test_greedy_generation_is_deterministic(loaded):
    engine = Engine(loaded.model, loaded.tokenizer, max_len=256, prefill_chunk=64)
    prompt = [loaded.tokenizer.bos_id] + loaded.tokenizer.encode("def fibonacci(n):")
    first = engine.generate([prompt], max_new_tokens=24, stop_ids=frozenset()).completions[0].tokens
    second = engine.generate([prompt], max_new_tokens=24, stop_ids=frozenset()).completions[0].tokens
    assert first == second and len(first) == 24


def test_cli_generate_defaults_to_raw_completion_with_the_embedded_model(capsys):
    args = ["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--max-len", "256"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "embedded default model" in err and "raw completion" in err
    assert "[thinking]" not in out and out.strip()
    # Token healing: the prompt's last token `):` is backed off and regrown as `):` + newline
    # (as the BPE always wrote it in training), so the continuation is an indented body.
    assert out.startswith("\n    "), out
    assert main(args + ["--chat", "--effort", "low", "--max-new-tokens", "4", "--max-len", "1024"]) == 0
    out, err = capsys.readouterr()
    assert "raw completion" not in err
