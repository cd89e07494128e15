"""Model + tokenizer for generation: a checkpoint folder, or the embedded default model.

An Orbax checkpoint written by the converter (``_CHECKPOINT_METADATA``, no safetensors) is
read with ``k31jax.ckpt.load_checkpoint``; a folder of ``*.safetensors`` with
``k31jax.load_hf_weights``. The tokenizer is the folder's ``tiktoken.model`` when present,
else the byte-level tokenizer of the tiny models.

Until trained weights ship, the embedded default model is a seeded random ``tiny``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from ..chat import ByteTokenizer, KimiTokenizer
from ..ckpt import load_checkpoint, load_hf_weights
from ..config import ModelConfig
from ..nn import K31ForCausalLM

DEFAULT_MODEL = "tiny"
_BYTE_VOCAB_MAX = 4096  # a byte tokenizer only fits byte-vocabulary models


@dataclasses.dataclass
class LoadedModel:
    model: object  # K31ForCausalLM
    tokenizer: object  # KimiTokenizer | ByteTokenizer
    source: str
    banner: str | None = None  # shown to users when the weights are not trained ones


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """A finalized Orbax checkpoint (the converter's output), not a safetensors folder."""
    p = Path(path)
    return (p / "_CHECKPOINT_METADATA").exists() or (p.is_dir() and not any(p.glob("*.safetensors")))


def _load_orbax(path: Path, dtype):
    return load_checkpoint(path) if dtype is None else load_checkpoint(path, dtype=dtype)


def load_tokenizer(path: str | os.PathLike | None, vocab_size: int):
    """`KimiTokenizer` from `path/tiktoken.model`, else a `ByteTokenizer` (byte vocabularies)."""
    if path is not None and (Path(path) / "tiktoken.model").exists():
        return KimiTokenizer.from_dir(path)
    if vocab_size > _BYTE_VOCAB_MAX:
        raise FileNotFoundError(f"no tiktoken.model in {path}: a vocabulary of {vocab_size:,} needs "
                                "the release tokenizer files (tiktoken.model, tokenizer_config.json); "
                                "pass their folder as tokenizer=... (CLI: --tokenizer DIR)")
    return ByteTokenizer(vocab_size)


def load_model(ckpt: str | os.PathLike | None = None, *, config: str = DEFAULT_MODEL, seed: int = 0,
               dtype: str | None = None, tokenizer: str | os.PathLike | None = None) -> LoadedModel:
    """Load `ckpt` (safetensors or Orbax folder), or build the preset `config` with seeded
    random weights (then `banner` says so). The tokenizer comes from `tokenizer` (a folder
    with `tiktoken.model`), else from `ckpt`."""
    if ckpt is not None:
        path = Path(ckpt)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint folder {path} does not exist")
        model = _load_orbax(path, dtype) if is_orbax_checkpoint(path) else load_hf_weights(path, dtype=dtype)
        return LoadedModel(model, load_tokenizer(tokenizer or path, model.config.vocab_size), str(path))
    cfg = ModelConfig.preset(config)
    if dtype:
        cfg = cfg.replace(dtype=str(jnp.dtype(dtype)))
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(seed))
    banner = (f"no --ckpt: using the embedded default model '{config}' with SEEDED RANDOM weights "
              f"(seed {seed}); its text is meaningless until trained weights ship.")
    return LoadedModel(model, load_tokenizer(tokenizer, cfg.vocab_size), f"preset:{config}", banner)
