"""`k31jax convert SRC DST`: a release-layout safetensors folder -> a k31jax Orbax checkpoint.

Streaming and bounded: the plan is built from the headers alone (`k31jax.ckpt.make_plan`),
then the stored leaves are built and written group by group (one layer, or the leaves of
one layer in calls of at most `max_call_bytes`) with Orbax v1 partial saves, the next
call's tensors being read while the current one is written. Routed experts are stacked by
reading each expert's bytes straight into the stacked `[E, out, in/2]` / `[E, out, in/32]`
buffers (no dequantisation, no transpose) unless `expert_weights="bf16"` asks for decoding.

Safety (`_destination.py`): DST may not overlap SRC; an exclusive lock on DST is held for
the run; everything is written into a temporary folder with a generated name next to DST,
finalised, given its checksum manifest (`k31jax.ckpt._manifest`: every file's byte count
and XXH3-128 digest, for `k31jax verify`, `load_checkpoint` and `export`), synced, optionally
verified, and only then renamed to DST in one atomic step. An existing DST is replaced only
with `overwrite=True`, only if it is a k31jax checkpoint or an empty folder, and only once the
new checkpoint is complete. After any failure, interruption (`stop`) or disk full the writers
are stopped, the temporary folder is removed, and DST holds nothing new.

Every stored float value is checked for NaN / Inf on the way (`_values.py`): counted per
source tensor in `ConvertResult.nonfinite`, refused with `strict=True`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from ._manifest import build_manifest, write_manifest
from ._orbax import ASSETS_DIR, FORMAT, LAYOUT_FILE, META_KEY, flatten, load_stored, quiet_orbax
from ._plan import Plan, make_plan
from ._transforms import CheckpointError, build_value, build_values, unbuild_value
from ._safetensors import SAFETENSORS_DTYPES, SafetensorsIndex, TensorReader, no_gc
from ..config import ModelConfig
from ..nn import abstract_model
from ._destination import atomic_destination, check_stop, preflight
from ._export import EXPORT_MARKER
from ._orbax_save import fast_partial_saves, flush_new_files, fsync_tree, literal_root, save_context, settled_writes
from ._progress import human_bytes, progress_bar
from ._values import NonFinite, nonfinite_of

_ASSET_MAX_BYTES = 64 << 20


@dataclasses.dataclass
class ConvertResult:
    src: Path
    dst: Path | None
    plan: Plan
    seconds: float
    source_bytes: int
    stored_bytes: int
    verified: bool = False
    # NaN / Inf found in the converted values, one record per source tensor that holds any
    nonfinite: list[NonFinite] = dataclasses.field(default_factory=list)
    manifest_files: int = 0

    @property
    def tensors(self) -> int:
        """Source tensors converted (each checked for non-finite values)."""
        return sum(len(e.tensors) for e in self.plan.entries)

    @property
    def mb_per_s(self) -> float:
        return self.source_bytes / 1e6 / max(self.seconds, 1e-9)


def read_source(src: str | os.PathLike) -> tuple[dict, ModelConfig, SafetensorsIndex]:
    """The raw `config.json`, the `ModelConfig` built from it, and the header index."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such source folder")
    cfg_path = src / "config.json"
    try:
        raw = json.loads(cfg_path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path}: missing (a release folder has config.json next to the shards)") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object (the config fields), got a {type(raw).__name__}")
    cfg = ModelConfig.from_hf(cfg_path)
    return raw, cfg, SafetensorsIndex(src)


def _overrides(plan: Plan, raw: dict) -> dict:
    """Config fields that differ from what `ModelConfig.from_hf(raw)` gives (indexer switch,
    expert storage format)."""
    base = ModelConfig.from_hf(raw)
    return {f.name: getattr(plan.cfg, f.name) for f in dataclasses.fields(plan.cfg)
            if f.name != "dtype" and getattr(plan.cfg, f.name) != getattr(base, f.name)}


def describe_plan(plan: Plan, index: SafetensorsIndex, *, max_rows: int = 200) -> str:
    """The dry-run report: the accounting and the target tree as `load_checkpoint` returns it."""
    cfg = plan.cfg
    used = sum(len(e.tensors) for e in plan.entries)
    n_src = len(index.tensors)
    lines = [
        f"source   {index.root}: {len(index.shards)} shard(s), {n_src:,} tensors, {human_bytes(index.total_bytes)} "
        f"({index.total_bytes:,} B)",
        f"config   {cfg.num_hidden_layers} layers ({len(cfg.kda_layers)} KDA, {len(cfg.mla_layers)} MLA"
        f"{' + lightning indexer' if cfg.use_indexer else ''}), {cfg.num_experts} experts top-"
        f"{cfg.num_experts_per_token}, hidden {cfg.hidden_size}; experts stored {cfg.expert_weights}"
        f"{' (packed bytes, verbatim)' if cfg.expert_weights == 'mxfp4' else ''}; non-expert dtype "
        f"{plan.options['dtype'] or 'as stored'}",
        f"accounted {used:,} of {n_src:,} tensors used exactly once, {len(plan.dropped):,} dropped on request, "
        f"{n_src - used - len(plan.dropped):,} unused; every parameter leaf filled "
        f"({'indexer initialised fresh; ' if plan.options['init_missing_indexer'] else ''}"
        f"{len(plan.entries):,} stored leaves in {len(plan.groups())} groups)",
        f"writes   {human_bytes(plan.stored_bytes)} ({plan.stored_bytes:,} B)",
        "target tree (stacked, as load_checkpoint returns it):",
    ]
    state = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
    rows = [("/".join(str(getattr(k, "key", k)) for k in kp), leaf)
            for kp, leaf in jax.tree_util.tree_leaves_with_path(state)]
    width = max(len(r[0]) for r in rows)
    for name, leaf in rows[:max_rows]:
        lines.append(f"  {name.ljust(width)}  {str(list(leaf.shape)):>28}  {leaf.dtype}")
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more")
    vision = [e for e in plan.entries if e.group == "vision"]
    if vision:
        lines.append(f"  vision/ (verbatim)  {len(vision)} tensors, {human_bytes(sum(e.nbytes for e in vision))}")
    return "\n".join(lines)


def is_k31jax_checkpoint(path: Path) -> bool:
    """Whether `path` is a finalized k31jax checkpoint (Orbax's checkpoint metadata carries the
    k31jax custom metadata): what `overwrite=True` may replace."""
    try:
        meta = json.loads((Path(path) / "_CHECKPOINT_METADATA").read_text())
    except (OSError, ValueError):
        return False
    info = (meta.get("custom_metadata") or {}).get(META_KEY) if isinstance(meta, dict) else None
    return isinstance(info, dict) and info.get("format") == FORMAT


def _layout_record(index: SafetensorsIndex, plan: Plan) -> dict:
    return {"format": 1, "index_metadata": index.index_metadata, "single_file": not (
                index.root / "model.safetensors.index.json").exists(),
            "dropped": plan.dropped,
            "shards": [[shard, meta, [[n, index.tensors[n].dtype, list(index.tensors[n].shape)] for n in names]]
                       for shard, (names, meta) in sorted(index.shards.items())]}


def _copy_assets(src: Path, dst: Path) -> list[str]:
    out = []
    for f in sorted(src.iterdir()):
        if (f.is_file() and not f.name.endswith(".safetensors")
                and f.name not in ("model.safetensors.index.json", EXPORT_MARKER)
                and f.stat().st_size <= _ASSET_MAX_BYTES):
            (dst / ASSETS_DIR).mkdir(exist_ok=True)
            shutil.copy2(f, dst / ASSETS_DIR / f.name)
            out.append(f.name)
    return out


class _Arena:
    """One reusable buffer the leaves of a write call are carved from: a conversion touches
    fresh pages only for its first calls instead of faulting in every byte it converts."""

    _ALIGN = 64

    def __init__(self):
        self.buf = np.empty(0, np.uint8)
        self.pos = 0

    def reset(self, entries) -> None:
        need = sum(-(-e.nbytes // self._ALIGN) * self._ALIGN for e in entries)
        if self.buf.nbytes < need:
            self.buf = np.empty(0, np.uint8)  # drop the old one before allocating the new one
            self.buf = np.empty(need, np.uint8)
        self.pos = 0

    def alloc(self, shape, dtype) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        view = self.buf[self.pos:self.pos + n].view(dtype).reshape(shape)
        self.pos += -(-n // self._ALIGN) * self._ALIGN
        return view


def _nest(items) -> dict:
    tree: dict = {}
    for key, v in items:
        t = tree
        for k in key[:-1]:
            t = t.setdefault(k, {})
        t[key[-1]] = v
    return tree


def compare_with_source(ckpt: Path, plan: Plan, reader: TensorReader, progress: tqdm | None,
                        max_call_bytes: int, stop: threading.Event | None = None, *, what: str = "--verify") -> int:
    """Restore every stored leaf of `ckpt` and compare its values with the source tensors of
    `plan`: a leaf copied from one or more tensors must give back each of them bytewise once
    cast back to the source dtype, so a stored dtype that changes any value (a narrower
    float, an integer) fails, naming the leaf, file and tensor. Decoded MXFP4 experts and
    freshly initialised leaves are compared with a fresh conversion. Returns the number of
    source tensors compared; `what` prefixes the error messages."""
    import orbax.checkpoint.experimental.v1 as ocp1  # heavy: imported when a conversion runs

    with quiet_orbax():
        stored = flatten(ocp1.metadata(ckpt).metadata)
    compared = 0
    for group, entries in plan.calls(max_call_bytes):
        check_stop(stop)
        host = load_stored(ckpt, [e.key for e in entries], stored)
        for e in entries:
            got = host.pop(e.key)
            if e.mode in ("tensor", "stack"):
                for info, arr in unbuild_value(e, got, plan.cfg):
                    src = reader.read(info)
                    compared += 1
                    if arr.shape == src.shape and arr.tobytes() == src.tobytes():
                        continue
                    flat_a, flat_s = arr.reshape(-1), src.reshape(-1)
                    diff = np.flatnonzero(flat_a.view(np.uint8) != flat_s.view(np.uint8)) if (
                        arr.shape == src.shape) else np.zeros(0, int)
                    at = ""
                    if diff.size:
                        i = int(diff[0]) // src.dtype.itemsize
                        at = f"; first difference at element {i}: source {flat_s[i]}, stored {flat_a[i]}"
                    cast = (f", stored as {e.dtype} from {np.dtype(SAFETENSORS_DTYPES[info.dtype])}: the stored dtype changes "
                            "its values" if e.dtype != SAFETENSORS_DTYPES[info.dtype] else "")
                    raise CheckpointError(f"{what}: stored leaf {'/'.join(e.key)} does not reproduce {info.file}: "
                                          f"tensor {info.name!r}{cast}{at}")
            else:
                want = build_value(e, reader, plan.cfg)
                compared += len(e.tensors)
                if want.shape != got.shape or want.dtype != got.dtype or want.tobytes() != got.tobytes():
                    first = f"{e.tensors[0].file}: {e.tensors[0].name!r}" if e.tensors else "a fresh initialisation"
                    raise CheckpointError(f"{what}: stored leaf {'/'.join(e.key)} differs from the conversion "
                                          f"of {first}{' ...' if len(e.tensors) > 1 else ''}")
            if progress is not None:
                progress.set_postfix_str(group, refresh=False)
                progress.update(e.source_bytes)
    return compared


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    *,
    dtype=None,
    expert_weights: str | None = None,
    no_indexer: bool = False,
    init_missing_indexer: bool = False,
    vision: bool = True,
    dry_run: bool = False,
    verify: bool = False,
    strict: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    max_call_bytes: int = 256 << 20,
    chunk_byte_size: int = 1 << 28,
    sync: bool = True,
    use_ocdbt: bool = True,
    out=None,
    stop: threading.Event | None = None,
) -> ConvertResult:
    """Convert the release folder `src` into an Orbax checkpoint at `dst` (see module doc).

    dtype: stored dtype of the non-expert weights, a float type (None keeps the release's bf16;
    the f32 tensors stay f32). expert_weights: "mxfp4" (packed bytes, the default for an MXFP4
    release) or "bf16" (decoded while streaming). no_indexer / init_missing_indexer: the
    K3.1 guard (see `k31jax.ckpt.make_plan`). dry_run: headers only, print the plan.
    verify: re-read the written checkpoint and compare its values with the source before
    publishing (`compare_with_source`: fails when the stored dtype changed any value).
    strict: refuse NaN / Inf in any converted value (otherwise they are counted in
    `ConvertResult.nonfinite`).
    overwrite: replace an existing `dst`, only if it is a k31jax checkpoint or an empty folder
    (anything else is refused, see `_destination.py`).
    progress: a progress bar on stderr (None: only when stderr is a terminal).
    max_call_bytes: stored bytes per Orbax write call (whole layers packed together, a larger
    layer split between leaves). Two calls are in flight (one read, one written), so peak
    memory is about 3 x max(max_call_bytes, largest leaf) over the interpreter's baseline.
    A call is never smaller than the largest leaf (a leaf is written whole), so the release
    (4.9 GB expert leaves) is written in 647 calls, not 1,139: Orbax's finalize merges one
    OCDBT database per call, superlinearly in their number.
    use_ocdbt: OCDBT (the default) packs the per-expert chunks into large data files;
    False writes one zarr3 folder per leaf with a file per chunk (a per-expert file for the
    experts: ~500,000 files for the release).
    stop: when set (e.g. by a SIGINT handler) the run stops at its next safe point (between
    write calls), removes its temporary folder and raises `Interrupted`.
    """
    out = out or sys.stdout
    t0 = time.perf_counter()
    src = Path(src).absolute()
    raw, cfg, index = read_source(src)
    destination = dict(src=src, overwrite=overwrite, replaceable=is_k31jax_checkpoint, what="a k31jax checkpoint")
    if dst is not None and not dry_run:
        dst = preflight(dst, **destination)
    plan = make_plan(cfg, index.tensors, root=src, dtype=dtype, expert_weights=expert_weights,
                     no_indexer=no_indexer, init_missing_indexer=init_missing_indexer, vision=vision)
    if dry_run:
        print(describe_plan(plan, index), file=out)
        return ConvertResult(src, None, plan, time.perf_counter() - t0, 0, plan.stored_bytes)
    if dst is None:
        raise CheckpointError("convert: DST is required unless dry_run=True")
    import orbax.checkpoint.experimental.v1 as ocp1  # heavy: imported when a conversion runs

    if progress is None:
        progress = sys.stderr.isatty()
    meta = {META_KEY: {"format": FORMAT, "config": raw, "overrides": _overrides(plan, raw),
                       "options": plan.options, "source": {"root": str(src.resolve()), "tensors": len(index.tensors),
                                                           "bytes": index.total_bytes}}}
    calls = plan.calls(max(max_call_bytes, max((e.nbytes for e in plan.entries), default=0)))
    bar = progress_bar(plan.source_bytes, "convert", enabled=progress)
    arenas = (_Arena(), _Arena())  # one call being read while the previous one is written
    with (atomic_destination(dst, **destination, stage_name="checkpoint", stop=stop, needed_bytes=plan.stored_bytes,
                             command="k31jax convert") as tmp,
          literal_root(tmp.parent), TensorReader(drop_cache=True) as reader):

        def build(i):
            group, entries = calls[i]
            arena = arenas[i % 2]
            arena.reset(entries)
            outs = build_values(entries, reader, plan.cfg, [arena.alloc(e.shape, e.dtype) for e in entries])
            found = [bad for e, out in zip(entries, outs) for bad in nonfinite_of(e, out)]
            return _nest((e.key, out) for e, out in zip(entries, outs)), found

        nonfinite: list[NonFinite] = []
        flushed: set[str] = set()
        digests: dict = {}  # file identity -> checksum, hashed while the pages are cached
        flushing = None  # the previous call's files being written back while the next is saved
        with (settled_writes(), save_context(chunk_byte_size=chunk_byte_size, use_ocdbt=use_ocdbt),
              fast_partial_saves(), ThreadPoolExecutor(1) as pool, ThreadPoolExecutor(1) as flusher, no_gc()):
            nxt = pool.submit(build, 0) if calls else None
            for i, (group, entries) in enumerate(calls):
                tree, found = nxt.result()
                nonfinite += found
                if strict and found:
                    raise CheckpointError(_strict_message(found))
                check_stop(stop)
                nxt = pool.submit(build, i + 1) if i + 1 < len(calls) else None
                ocp1.partial.save(str(tmp), tree, custom_metadata=meta if i == 0 else None)
                del tree
                if sync:
                    if flushing is not None:
                        flushing.result()
                    flushing = flusher.submit(flush_new_files, tmp.parent, flushed,  # saves live next to tmp
                                              digests=digests)
                bar.set_postfix_str(group, refresh=False)
                bar.update(sum(e.source_bytes for e in entries))
            if flushing is not None:
                flushing.result()
            check_stop(stop)
            ocp1.partial.finalize(str(tmp))
        (tmp / LAYOUT_FILE).write_text(json.dumps(_layout_record(index, plan), separators=(",", ":")))
        _copy_assets(src, tmp)
        manifest = build_manifest(tmp, known=digests)
        write_manifest(tmp, manifest)
        if sync:
            fsync_tree(tmp)
        seconds = time.perf_counter() - t0
        bar.close()
        verified = False
        if verify:
            vbar = progress_bar(plan.source_bytes, "verify ", enabled=progress)
            compare_with_source(tmp, plan, reader, vbar, max_call_bytes, stop)
            vbar.close()
            verified = True
    if progress:
        print(f"converted {src} -> {dst}: {human_bytes(plan.source_bytes)} in {seconds:.1f} s "
              f"({human_bytes(plan.source_bytes / max(seconds, 1e-9))}/s){'; verified' if verified else ''}",
              file=sys.stderr)
    return ConvertResult(src, dst, plan, seconds, plan.source_bytes, plan.stored_bytes, verified, nonfinite,
                         len(manifest["files"]))


def _strict_message(found: list[NonFinite]) -> str:
    shown = "; ".join(f.describe() for f in found[:3])
    more = f"; and {len(found) - 3} more tensors" if len(found) > 3 else ""
    return f"--strict: non-finite values in the source: {shown}{more}; nothing was published"
