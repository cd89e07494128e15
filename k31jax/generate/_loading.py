"""Model + tokenizer for generation: a checkpoint folder, or the embedded default model.

An Orbax checkpoint written by the converter (``_CHECKPOINT_METADATA``, no safetensors) is
read with ``k31jax.ckpt.load_checkpoint``; a folder of ``*.safetensors`` with
``k31jax.load_hf_weights``. The tokenizer is the folder's ``tiktoken.model`` when present,
else the byte-level tokenizer of the tiny models.

Without a checkpoint, the embedded default model is loaded: a 4.5M-parameter K3.1-shaped model
(KDA, gated MLA with the lightning indexer, Block AttnRes, LatentMoE with packed MXFP4 experts
trained with QAT) shipped in ``k31jax/assets/embedded`` in the release layout, trained on the
Python standard library's sources with a byte-level tokenizer (`scripts/train_embedded_model.py`
reproduces it). It has seen no chat data, so `raw_completion` tells the CLI to complete text
rather than wrap it in the chat format. A preset name (``config=``) builds seeded random weights.
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

DEFAULT_MODEL = "embedded"  # the trained model of `embedded_model_dir()` (its architecture: preset "embedded")
_BYTE_VOCAB_MAX = 4096  # a byte tokenizer only fits byte-vocabulary models


def embedded_model_dir() -> Path:
    """The embedded default model's release folder inside the installed package."""
    return Path(__file__).resolve().parents[1] / "assets" / "embedded"


@dataclasses.dataclass
class LoadedModel:
    model: object  # K31ForCausalLM
    tokenizer: object  # KimiTokenizer | ByteTokenizer
    source: str
    banner: str | None = None  # a line shown to users about the weights (random, or the embedded model)
    raw_completion: bool = False  # trained without chat data: complete raw text by default


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


def load_model(ckpt: str | os.PathLike | None = None, *, config: str | None = None, seed: int = 0,
               dtype: str | None = None, tokenizer: str | os.PathLike | None = None) -> LoadedModel:
    """Load `ckpt` (safetensors or Orbax folder); without it, the preset `config` with seeded
    random weights (then `banner` says so), or with neither the embedded default model (float32
    unless `dtype` says otherwise). The tokenizer comes from `tokenizer` (a folder with
    `tiktoken.model`), else from `ckpt`."""
    if ckpt is not None:
        path = Path(ckpt)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint folder {path} does not exist")
        model = _load_orbax(path, dtype) if is_orbax_checkpoint(path) else load_hf_weights(path, dtype=dtype)
        return LoadedModel(model, load_tokenizer(tokenizer or path, model.config.vocab_size), str(path))
    if config is None:
        path = embedded_model_dir()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"the embedded default model is missing from {path}: reinstall k31jax, "
                                    "or pass --ckpt DIR (or --config PRESET for random weights)")
        model = load_hf_weights(path, dtype=dtype or "float32")
        banner = (f"no --ckpt: the embedded default model ({DEFAULT_MODEL}: trained on Python standard "
                  "library sources, byte-level, no chat data)")
        return LoadedModel(model, load_tokenizer(tokenizer, model.config.vocab_size), f"embedded:{path}", banner,
                           raw_completion=True)
    cfg = ModelConfig.preset(config)
    if dtype:
        cfg = cfg.replace(dtype=str(jnp.dtype(dtype)))
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(seed))
    banner = (f"--config {config}: SEEDED RANDOM weights (seed {seed}); its text is meaningless. "
              "Without --config, the trained embedded default model runs.")
    return LoadedModel(model, load_tokenizer(tokenizer, cfg.vocab_size), f"preset:{config}", banner)
