"""The k31jax model configuration: frozen dataclasses, read from the release `config.json`.

- `_model_config`: what a config is: `ModelConfig` (the text model), `VisionConfig`, their
  derived quantities and checks;
- `_hf_config`: reading a release / transformers `config.json` into their fields
  (`ModelConfig.from_hf`);
- `_presets`: the named presets in `configs/` (`ModelConfig.preset(name)`);
- `_fields`: each field's type and range, and `ConfigError`.
"""

from ._fields import ConfigError, LayerType
from ._hf_config import IGNORED_HF_KEYS
from ._model_config import ModelConfig, VisionConfig
from ._presets import preset_dir, preset_names

__all__ = ["IGNORED_HF_KEYS", "ConfigError", "LayerType", "ModelConfig", "VisionConfig", "preset_dir", "preset_names"]
