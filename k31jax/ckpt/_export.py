"""`k31jax export DST OUT`: a converted k31jax checkpoint back to the release safetensors layout.

With the source layout recorded at conversion (`k31jax_source_layout.json`) the export
reproduces the same shard files, tensor order and header metadata, and every tensor
bytewise, the per-expert MXFP4 `weight_packed` / `weight_scale` included: the stored values
go through the exact inverse of the converter's transforms (`k31jax.ckpt._plan.unbuild_value`)
and back to the source dtype. Only a checkpoint whose experts were decoded to bf16
(`--expert-weights bf16`) is re-quantised (OCP floor rule), which may choose different but
equivalent bytes. Without a recorded layout (or when it no longer matches, e.g. a freshly
initialised indexer) the canonical release layout for the config is written.

Streaming like the converter: one layer group at a time is restored and written at its
offsets in preallocated shard files, in a temporary folder renamed to OUT when complete,
with the converter's safety (`_destination.py`). Before anything is written every stored
byte is checked against the checkpoint's checksum manifest: a damaged checkpoint is refused
(`IntegrityError`), never exported as a release that no longer matches its source. OUT gets
a small marker file
(`.k31jax_export.json`) so that `overwrite=True` later recognises it as an export to replace;
any other non-empty folder is never replaced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ._manifest import IntegrityError, check_checksums, check_sizes, read_manifest
from ._orbax import ASSETS_DIR, checkpoint_config, checkpoint_info, flatten, load_stored, read_layout
from ._plan import Plan, make_plan
from ._transforms import CheckpointError, unbuild_value
from ._release_layout import release_layout
from ._safetensors import SAFETENSORS_DTYPE_NAMES, ShardWriter
from ._destination import atomic_destination, check_stop, preflight
from ._orbax_save import fsync_tree
from ._progress import human_bytes, progress_bar


EXPORT_MARKER = ".k31jax_export.json"
_EXPORT_FORMAT = "k31jax.export/1"


def is_export_folder(path: Path) -> bool:
    """Whether `path` is a release folder written by `export` (its marker file): what
    `overwrite=True` may replace. A release folder from anywhere else is never replaced."""
    try:
        marker = json.loads((Path(path) / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == _EXPORT_FORMAT


@dataclasses.dataclass
class ExportResult:
    ckpt: Path
    out: Path
    plan: Plan
    seconds: float
    bytes: int
    recorded_layout: bool
    files: list[str]


def _canonical_layout(cfg, stored: dict, num_shards: int) -> list:
    shards = release_layout(cfg, num_shards=num_shards)
    vision = [(".".join(k[1:]), SAFETENSORS_DTYPE_NAMES[np.dtype(m.dtype)], tuple(m.shape))
              for k, m in sorted(stored.items()) if k[0] == "vision"]
    if vision:
        n = len(shards) + 1
        shards = [(f"model-{i + 1:05d}-of-{n:06d}.safetensors", ts) for i, (_, ts) in enumerate(shards)]
        shards.append((f"model-{n:05d}-of-{n:06d}.safetensors", vision))
    return [(name, {"format": "pt"}, ts) for name, ts in shards]


def _stored_bytes(stored: dict) -> int:
    return sum(int(np.prod(m.shape, dtype=np.int64)) * np.dtype(m.dtype).itemsize for m in stored.values())


def _plan_for(cfg, options, shards, tmp: Path, stored: dict):
    """Open the shard writers for `shards` and plan them; (plan, writers) or a CheckpointError."""
    writers = {}
    try:
        for name, meta, tensors in shards:
            writers[name] = ShardWriter(tmp / name, [(n, d, tuple(s)) for n, d, s in tensors], meta or None)
        infos = {n: i for w in writers.values() for n, i in w.infos.items()}
        plan = make_plan(cfg, infos, root=tmp, dtype=options.get("dtype"), expert_weights=cfg.expert_weights,
                         vision=True)
        keys = {e.key for e in plan.entries}
        text = {k for k in stored}
        if keys != text or any(e.mode == "init" for e in plan.entries):
            raise CheckpointError(f"layout does not match the stored leaves ({len(keys ^ text)} differ)")
        return plan, writers
    except Exception:
        for w in writers.values():
            w.close()
        for name in writers:
            (tmp / name).unlink(missing_ok=True)
        raise


def _check_input(ckpt: Path, progress: bool) -> None:
    """Every stored byte of `ckpt` against its manifest; a checkpoint without one (converted
    before k31jax wrote manifests) is exported with a warning line."""
    if not ckpt.is_dir():
        return  # `checkpoint_info` names the problem
    manifest = read_manifest(ckpt)
    if manifest is None:
        print(f"k31jax export: warning: {ckpt} has no checksum manifest (converted by an older k31jax); its bytes "
              "are not checked", file=sys.stderr)
        return
    try:
        total = check_sizes(ckpt, manifest, extra_files=True)
        bar = progress_bar(total, "check  ", enabled=progress)
        lock = threading.Lock()

        def advance(n: int) -> None:
            with lock:
                bar.update(n)

        check_checksums(ckpt, manifest, progress=advance)
        bar.close()
    except IntegrityError as e:
        raise IntegrityError(f"{e}; export refuses a damaged checkpoint (nothing was written)") from None


def export(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool | None = None,
    num_shards: int = 8,
    max_call_bytes: int = 256 << 20,
    sync: bool = True,
    stop: threading.Event | None = None,
) -> ExportResult:
    """Write the converted checkpoint `ckpt` as a release-layout folder `out` (see module doc).
    overwrite: replace an existing `out` only if `export` wrote it (or it is an empty folder).
    stop: when set (e.g. by a SIGINT handler) the run stops between layer groups, removes its
    temporary folder and raises `Interrupted`."""
    t0 = time.perf_counter()
    ckpt = Path(ckpt).absolute()
    destination = dict(src=ckpt, overwrite=overwrite, replaceable=is_export_folder,
                       what="a release folder written by k31jax export")
    out = preflight(out, **destination)
    if progress is None:
        progress = sys.stderr.isatty()
    _check_input(ckpt, progress)
    info = checkpoint_info(ckpt)
    cfg = checkpoint_config(info)
    options = info.get("options") or {}
    stored = flatten(info["stored"])
    layout = read_layout(ckpt)
    with (atomic_destination(out, **destination, stage_name="release", stop=stop,
                             needed_bytes=_stored_bytes(stored), command="k31jax export") as tmp):
        tmp.mkdir()
        plan = writers = None
        recorded = False
        if layout is not None:
            dropped = set(layout.get("dropped", []))
            shards = [(name, meta, [t for t in ts if t[0] not in dropped]) for name, meta, ts in layout["shards"]]
            try:
                plan, writers = _plan_for(cfg, options, [s for s in shards if s[2]], tmp, stored)
                recorded = True
            except CheckpointError:
                plan = None
        if plan is None:
            plan, writers = _plan_for(cfg, options, _canonical_layout(cfg, stored, num_shards), tmp, stored)
        try:
            bar = progress_bar(plan.source_bytes, "export ", enabled=progress)
            for group, entries in plan.calls(max_call_bytes):
                check_stop(stop)
                host = load_stored(ckpt, [e.key for e in entries], stored)
                for e in entries:
                    for tinfo, arr in unbuild_value(e, host.pop(e.key), plan.cfg):
                        writers[tinfo.file.name].write(tinfo.name, arr)
                    bar.set_postfix_str(group, refresh=False)
                    bar.update(e.source_bytes)
                del host
        finally:
            for w in writers.values():
                w.close()
        files = sorted(writers)
        if len(writers) > 1 or (recorded and not layout.get("single_file")):
            weight_map = {n: f for f, w in writers.items() for n in w.infos}
            meta = dict(layout.get("index_metadata") or {}) if recorded else {}
            meta["total_size"] = sum(i.nbytes for w in writers.values() for i in w.infos.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2) + "\n")
        assets = ckpt / ASSETS_DIR
        if assets.is_dir():
            for f in sorted(assets.iterdir()):
                shutil.copy2(f, tmp / f.name)
        if not (tmp / "config.json").exists():
            (tmp / "config.json").write_text(json.dumps(info["config"], indent=2) + "\n")
        (tmp / EXPORT_MARKER).write_text(json.dumps({"format": _EXPORT_FORMAT, "checkpoint": str(ckpt)}) + "\n")
        if sync:
            fsync_tree(tmp)
        bar.close()
    seconds = time.perf_counter() - t0
    if progress:
        print(f"exported {ckpt} -> {out}: {len(files)} shard(s), {human_bytes(plan.source_bytes)} in "
              f"{seconds:.1f} s{'' if recorded else ' (canonical layout)'}", file=sys.stderr)
    return ExportResult(ckpt, out, plan, seconds, plan.source_bytes, recorded, files)


__all__ = ["EXPORT_MARKER", "ExportResult", "export", "is_export_folder"]
