"""Named presets: release-format `config.json` files in the package's `configs/` folder
(`k3`, `k31_pro`, `kimi_linear_48b`, `tiny`, ...), loaded by `ModelConfig.preset(name)`."""

from __future__ import annotations

from pathlib import Path

from ._fields import ConfigError


def preset_dir() -> Path:
    """The folder of preset JSON files (`k31jax/configs`: in a checkout, a link to the repo's
    configs/; installed, the package data)."""
    return Path(__file__).resolve().parents[1] / "configs"


def preset_names() -> list[str]:
    return sorted(p.stem for p in preset_dir().glob("*.json"))


def preset_path(name: str) -> Path:
    """The JSON file of preset `name`; an unknown name is an error listing the known ones."""
    path = preset_dir() / f"{name}.json"
    if not path.exists():
        raise ConfigError(f"unknown preset {name!r}; known presets: {preset_names()}")
    return path
