"""Model + tokenizer for generation: a checkpoint folder, or the embedded default model.

An Orbax checkpoint written by the converter (``_CHECKPOINT_METADATA``, no safetensors) is
read with ``k31jax.ckpt.load_checkpoint``; a folder of ``*.safetensors`` with
``k31jax.load_hf_weights``. The tokenizer is the folder's ``tiktoken.model`` (a converted
checkpoint's copy in ``k31jax_assets/``) when present, else the byte-level tokenizer of the
tiny models.

Without a checkpoint, the embedded default model is loaded: a 7.8M-parameter K3.1-shaped model
(KDA, gated MLA with the lightning indexer, Block AttnRes, LatentMoE with packed MXFP4 experts
trained with QAT) shipped in ``k31jax/assets/embedded`` in the release layout, trained on the
Python standard library's sources with its own small BPE (`tiktoken.model` in the same folder;
`scripts/train_embedded_model.py` reproduces both). It has seen no chat data, so
`raw_completion` tells the CLI to complete text rather than wrap it in the chat format. A preset
name (``config=``) builds seeded random weights.

Vision: a checkpoint with a ``vision_config`` carries its MoonViT tower and projector
(``vision_tower.*`` / ``mm_projector.*``), read with ``k31jax.ckpt.load_checkpoint_vision``, and
its image processor's settings in ``preprocessor_config.json`` (``media_proc_cfg``, read and
checked by ``k31jax.vision.read_processor_config``; without the file, the K3 values). The
embedded default model has **no trained vision tower**: for image inputs it gets a small one
with **seeded random** weights (``EMBEDDED_VISION``, built from ``seed`` on demand, not shipped),
so its "captions" show the plumbing, not understanding. A preset builds its own
``vision_config`` (or the small one) with seeded random weights, likewise.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..chat import ByteTokenizer, KimiTokenizer
from ..ckpt import ASSETS_DIR, is_orbax_checkpoint, load_checkpoint, load_checkpoint_vision, load_hf_weights
from ..config import ModelConfig, VisionConfig
from ..nn import K31ForCausalLM, reconfigure
from ..vision import PROCESSOR_FILE, VisionModel, load_vision_model, read_processor_config, release_shapes

DEFAULT_MODEL = "embedded"  # the trained model of `embedded_model_dir()` (its architecture: preset "embedded")
_BYTE_VOCAB_MAX = 4096  # a byte tokenizer only fits byte-vocabulary models
_RUN_FILE = "run.json"  # what marks a training run's folder (k31jax.train.RUN_FILE)
# The seeded random tower of models without a vision_config (the embedded default model): the
# K3 processor's patch and merge sizes, a small width; `text_hidden_size` is the text model's.
EMBEDDED_VISION = VisionConfig(patch_size=14, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                               qkv_hidden_size=64, num_hidden_layers=2, pos_emb_height=16, pos_emb_width=16,
                               mm_hidden_size=64, text_hidden_size=128)


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
    vision: VisionModel | None = None  # the vision model, once loaded (`load_vision`)
    vision_banner: str | None = None  # a line for users about the vision weights (random ones say so)
    # Loads or builds the vision model on demand: (model, banner); None: this model has none.
    vision_loader: Callable[[], tuple[VisionModel, str | None]] | None = dataclasses.field(default=None, repr=False)

    def load_vision(self) -> VisionModel:
        """The vision model, loaded (or, for the embedded model and presets, built with seeded
        random weights) on first use; `ValueError` when the checkpoint has none."""
        if self.vision is None:
            if self.vision_loader is None:
                raise ValueError(f"{self.source} has no vision tower (its config.json has no vision_config); "
                                 "image inputs need a checkpoint with one")
            self.vision, self.vision_banner = self.vision_loader()
        return self.vision


def _load_orbax(path: Path, dtype):
    return load_checkpoint(path) if dtype is None else load_checkpoint(path, dtype=dtype)


def tokenizer_dir(path: str | os.PathLike | None) -> Path | None:
    """The folder holding `path`'s `tiktoken.model`: `path` itself, or a converted Orbax
    checkpoint's copy of the release's tokenizer files (`path/k31jax_assets/`); None if neither."""
    folders = () if path is None else (Path(path), Path(path) / ASSETS_DIR)
    return next((f for f in folders if (f / "tiktoken.model").exists()), None)


def load_tokenizer(path: str | os.PathLike | None, vocab_size: int):
    """`KimiTokenizer` from `tokenizer_dir(path)`, else a `ByteTokenizer` (byte vocabularies)."""
    folder = tokenizer_dir(path)
    if folder is not None:
        return KimiTokenizer.from_dir(folder)
    if vocab_size > _BYTE_VOCAB_MAX:
        raise FileNotFoundError(f"no tiktoken.model in {path}: a vocabulary of {vocab_size:,} needs "
                                "the release tokenizer files (tiktoken.model, tokenizer_config.json); "
                                "pass their folder as tokenizer=... (CLI: --tokenizer DIR)")
    return ByteTokenizer(vocab_size)


def _checkpoint_vision(path: Path, cfg: ModelConfig, dtype: str | None):
    """Loads the checkpoint's tower, with the image processor settings of its
    `preprocessor_config.json` (the release folder's, or a converted checkpoint's copy) if it
    has one."""
    def load():
        model = load_checkpoint_vision(path, cfg, dtype=dtype or cfg.dtype)
        found = next((f / PROCESSOR_FILE for f in (path, path / ASSETS_DIR) if (f / PROCESSOR_FILE).is_file()), None)
        if found is not None:
            model.processor = read_processor_config(found, cfg.vision)
        return model, None
    return load


def random_vision_tensors(vcfg: VisionConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded random release-layout tensors of a tower + projector: norms 1, the position table
    N(0, 1), every projection N(0, 1/fan_in) (the modules' own initialisation). Built with NumPy
    and read by the release-name loader like a trained checkpoint's (no JAX initialisation to
    compile: the embedded model's tower is ready in a fraction of a second)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in release_shapes(vcfg).items():
        if len(shape) == 1:
            out[name] = np.ones(shape, np.float32)
        else:
            fan_in = 1 if "pos_emb" in name else math.prod(shape[1:])
            out[name] = rng.standard_normal(shape, np.float32) / np.float32(math.sqrt(fan_in))
    return out


def _random_vision(cfg: ModelConfig, seed: int, what: str):
    """Builds `cfg.vision` (or `EMBEDDED_VISION` at the text width) with seeded random weights."""
    def build():
        vcfg = cfg.vision or dataclasses.replace(EMBEDDED_VISION, text_hidden_size=cfg.hidden_size)
        model = load_vision_model(random_vision_tensors(vcfg, seed), vcfg, dtype=cfg.dtype)
        return model, (f"image inputs use a SEEDED RANDOM vision tower (seed {seed}; {what} has no trained one): "
                       "the model cannot see what the image shows")
    return build


def load_model(ckpt: str | os.PathLike | None = None, *, config: str | None = None, seed: int = 0,
               dtype: str | None = None, tokenizer: str | os.PathLike | None = None,
               vision: bool | None = None, expert_activations: str | None = None) -> LoadedModel:
    """Load `ckpt` (safetensors or Orbax folder); without it, the preset `config` with seeded
    random weights (then `banner` says so), or with neither the embedded default model (float32
    unless `dtype` says otherwise). The tokenizer comes from `tokenizer` (a folder with
    `tiktoken.model`), else from `ckpt`.

    vision: True loads the vision model now (a checkpoint must have one; the embedded model and
    presets get seeded random weights, `vision_banner` says so); None loads a checkpoint's own
    tower now, if it has one; False loads none now. `LoadedModel.load_vision()` loads it later.

    expert_activations: "mxfp8" rounds the routed experts' GEMM inputs to MXFP8 (E4M3, one
    E8M0 scale per 32 along the contraction; K3.1's deployment: MXFP4 weights, MXFP8
    activations), exactly as QAT's fake-quant does; "bf16" leaves them; None: the config's."""
    loaded = _load_text(ckpt, config=config, seed=seed, dtype=dtype, tokenizer=tokenizer)
    if expert_activations is not None:
        loaded.model = reconfigure(loaded.model, expert_activations=expert_activations)
    trained = ckpt is not None and loaded.vision_loader is not None
    if vision or (vision is None and trained):
        loaded.load_vision()
    return loaded


def _load_text(ckpt, *, config, seed, dtype, tokenizer) -> LoadedModel:
    if ckpt is not None:
        path = Path(ckpt)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint folder {path} does not exist")
        if (path / _RUN_FILE).exists():  # the run layout is k31jax.train's, a layer above this one
            raise ValueError(f"{path} is a training run's folder: k31jax.train.load_generation_model loads it "
                             "(its final export, else its newest checkpoint)")
        model = _load_orbax(path, dtype) if is_orbax_checkpoint(path) else load_hf_weights(path, dtype=dtype)
        cfg = model.config
        tok = load_tokenizer(tokenizer or path, cfg.vocab_size)
        banner = None
        if isinstance(tok, ByteTokenizer):  # right for a byte-trained tiny model, garbage for a BPE one
            banner = (f"no tiktoken.model in {tokenizer or path}: using the byte-level tokenizer (vocabulary "
                      f"{cfg.vocab_size:,}); pass --tokenizer DIR if this model was trained with another")
        return LoadedModel(model, tok, str(path), banner,
                           vision_loader=_checkpoint_vision(path, cfg, dtype) if cfg.vision is not None else None)
    if config is None:
        path = embedded_model_dir()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"the embedded default model is missing from {path}: reinstall k31jax, "
                                    "or pass --ckpt DIR (or --config PRESET for random weights)")
        model = load_hf_weights(path, dtype=dtype or "float32")
        banner = (f"no --ckpt: the embedded default model ({DEFAULT_MODEL}: trained on Python standard "
                  "library sources, no chat data)")
        return LoadedModel(model, load_tokenizer(tokenizer or path, model.config.vocab_size), f"embedded:{path}", banner,
                           raw_completion=True,
                           vision_loader=_random_vision(model.config, seed, "the embedded default model"))
    cfg = ModelConfig.preset(config)
    if dtype:
        cfg = cfg.replace(dtype=str(jnp.dtype(dtype)))
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(seed))
    banner = (f"--config {config}: SEEDED RANDOM weights (seed {seed}); its text is meaningless. "
              "Without --config, the trained embedded default model runs.")
    if tokenizer is None and config == DEFAULT_MODEL:  # its ids are the embedded model's BPE's, not bytes
        tokenizer = embedded_model_dir()
    return LoadedModel(model, load_tokenizer(tokenizer, cfg.vocab_size), f"preset:{config}", banner,
                       vision_loader=_random_vision(cfg, seed, f"--config {config}"))
