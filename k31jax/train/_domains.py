"""The two held-out domains of the fine-tuning experiment (`benchmarks/qat_finetune.py`,
`notebooks/qat_finetune.ipynb`), both built from what every Python installation ships, so the
experiment runs on any machine with no download.

- **The new domain**: the Python Language Reference's prose, as `help()` reads it
  (`pydoc_data.topics.topics`: one reStructuredText document per topic, about 79 of them and
  465,000 characters on Python 3.13). English technical documentation, not code: the embedded
  model never saw it (its corpus took only `*.py` files under 100,000 bytes, and `topics.py` is
  larger) and it predicts this text far worse than Python source (about 4.5 nats per token
  against 3.4). Licence: PSF-2.0, as the rest of the standard library. Each topic is one
  document; a topic is held out when sha256(its name) % 5 == 0 (17 topics on 3.13).
- **The base domain**: the embedded model's own held-out files (its `corpus.json` lists them
  with their SHA-256), read from this Python's standard library (none there is an error).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from pathlib import Path

from ..generate import embedded_model_dir

HELDOUT_EVERY = 5
LICENCE = "PSF-2.0 (Python Software Foundation License)"


@dataclasses.dataclass(frozen=True)
class DomainSplit:
    """A domain written out as text files: `train` and `heldout` folders, the documents in each
    and the SHA-256 of their text (in order), so a recorded result names exactly what it read."""

    name: str
    train: Path | None
    heldout: Path
    train_documents: tuple[str, ...]
    heldout_documents: tuple[str, ...]
    sha256: str
    licence: str


def _is_heldout(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def _write(folder: Path, documents: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in documents.items():
        (folder / f"{name}.txt").write_text(text, encoding="utf-8")


def language_reference_domain(out: str | os.PathLike) -> DomainSplit:
    """Write the Language Reference topics under `out/train` and `out/heldout` (one `.txt`
    file per topic)."""
    from pydoc_data.topics import topics

    out = Path(out)
    train = {k: v for k, v in sorted(topics.items()) if not _is_heldout(k)}
    heldout = {k: v for k, v in sorted(topics.items()) if _is_heldout(k)}
    _write(out / "train", train)
    _write(out / "heldout", heldout)
    digest = hashlib.sha256()
    for name, text in sorted(topics.items()):
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return DomainSplit("Python Language Reference (pydoc_data.topics)", out / "train", out / "heldout",
                       tuple(train), tuple(heldout), digest.hexdigest(), LICENCE)


def embedded_heldout_domain(out: str | os.PathLike) -> DomainSplit:
    """Copy the embedded model's held-out standard-library files (the paths its `corpus.json`
    lists) from this Python's standard library to `out/heldout`. The name says how many are
    there and how many have the recorded bytes (all of them on the model's own Python; another
    version's files differ a little, and are held out all the same)."""
    corpus = json.loads((embedded_model_dir() / "corpus.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    folder = Path(out) / "heldout"
    folder.mkdir(parents=True, exist_ok=True)
    kept, same, digest = [], 0, hashlib.sha256()
    for row in corpus["heldout"]:
        source = stdlib / row["path"]
        if not source.is_file():
            continue
        data = source.read_bytes()
        found = hashlib.sha256(data).hexdigest()
        same += found == row["sha256"]
        (folder / row["path"].replace("/", "__")).write_bytes(data)
        kept.append(row["path"])
        digest.update(found.encode())
    if not kept:
        raise ValueError(f"{stdlib}: none of the embedded model's {len(corpus['heldout'])} held-out files "
                         f"(corpus.json, Python {corpus['python']}) is there")
    return DomainSplit(f"the embedded model's held-out standard library ({len(kept)} of {len(corpus['heldout'])} "
                       f"files, {same} with the recorded bytes)", None, folder, (), tuple(kept), digest.hexdigest(),
                       corpus["licence"])
