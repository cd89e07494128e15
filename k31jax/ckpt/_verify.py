"""`k31jax verify CKPT [--source SRC]`: check a converted checkpoint that already exists.

1. The checksum manifest (`k31jax.ckpt._manifest`): every file it lists is there with its
   byte count, no other file is, and every byte hashes to the recorded XXH3-128 digest.
2. The checkpoint's own metadata: a k31jax checkpoint whose config builds a model.
3. With `source`: the round trip to the release tensors (`compare_with_source`, what
   `convert --verify` runs before publishing): every stored leaf restored through Orbax and
   mapped back by the converter's exact inverse gives each source tensor bytewise.

Read-only: nothing is written anywhere. The first problem found is an `IntegrityError`
(damaged bytes) or `CheckpointError` naming the file, leaf or tensor.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from pathlib import Path

from ._manifest import (HASH_NAME, MANIFEST_FILE, check_checksums, check_sizes, read_manifest,
                              require_manifest)
from ._orbax import checkpoint_config, checkpoint_info, flatten
from ._plan import make_plan
from ._transforms import CheckpointError
from ._safetensors import TensorReader
from ._convert import compare_with_source, read_source
from ._destination import check_stop
from ._progress import human_bytes, progress_bar


@dataclasses.dataclass
class VerifyResult:
    ckpt: Path
    files: int
    bytes: int
    source: Path | None = None
    tensors: int = 0  # source tensors compared (with `source`)
    seconds: float = 0.0

    def line(self) -> str:
        text = (f"verified {self.ckpt}: {self.files:,} files, {human_bytes(self.bytes)} match the manifest "
                f"({HASH_NAME})")
        if self.source is not None:
            text += f"; {self.tensors:,} tensors of {self.source} reproduced bytewise"
        return text


def verify_checkpoint(
    ckpt: str | os.PathLike,
    source: str | os.PathLike | None = None,
    *,
    progress: bool | None = None,
    max_call_bytes: int = 256 << 20,
    stop: threading.Event | None = None,
) -> VerifyResult:
    """Check the converted checkpoint `ckpt` (see module doc); with `source` (the release
    folder it was converted from) also the round trip to its tensors. Raises
    `IntegrityError` / `CheckpointError` on the first problem; `stop` ends it early
    (`Interrupted`)."""
    t0 = time.perf_counter()
    ckpt = Path(ckpt).absolute()
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: no such checkpoint folder")
    if progress is None:
        progress = sys.stderr.isatty()
    if read_manifest(ckpt) is None and not (ckpt / "_CHECKPOINT_METADATA").exists():
        raise CheckpointError(f"{ckpt}: not a k31jax checkpoint (no {MANIFEST_FILE}, no Orbax metadata); "
                              "verify checks a folder written by `k31jax convert`")
    manifest = require_manifest(ckpt)
    total = check_sizes(ckpt, manifest, extra_files=True)
    bar = progress_bar(total, "checksum", enabled=progress)
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:
            bar.update(n)
        check_stop(stop)

    check_checksums(ckpt, manifest, progress=advance)
    bar.close()
    info = checkpoint_info(ckpt)
    checkpoint_config(info)  # the recorded config builds a model
    result = VerifyResult(ckpt, len(manifest["files"]), total)
    if source is not None:
        source = Path(source).absolute()
        _, cfg, index = read_source(source)
        options = info.get("options") or {}
        plan = make_plan(cfg, index.tensors, root=source, dtype=options.get("dtype"),
                         expert_weights=options.get("expert_weights"), no_indexer=bool(options.get("no_indexer")),
                         init_missing_indexer=bool(options.get("init_missing_indexer")),
                         vision=bool(options.get("vision", True)))
        stored = set(flatten(info["stored"]))
        planned = {e.key for e in plan.entries}
        if stored != planned:
            differ = sorted("/".join(k) for k in stored ^ planned)
            raise CheckpointError(f"verify --source: {source} does not match the checkpoint's leaves ({len(differ)} "
                                  f"differ, e.g. {differ[:3]}): not the release it was converted from")
        vbar = progress_bar(plan.source_bytes, "compare ", enabled=progress)
        with TensorReader() as reader:
            result.tensors = compare_with_source(ckpt, plan, reader, vbar, max_call_bytes, stop,
                                                 what="verify --source")
        vbar.close()
        result.source = source
    result.seconds = time.perf_counter() - t0
    return result


__all__ = ["VerifyResult", "verify_checkpoint"]
