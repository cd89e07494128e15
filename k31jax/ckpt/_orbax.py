"""The k31jax Orbax checkpoint: reading it back into a model (`load_checkpoint`).

A converted checkpoint (`k31jax convert`) is an Orbax v1 pytree checkpoint written layer by
layer with partial saves. Its tree (see `_plan.py`): unstacked leaves under their model
path (`embed`, `lm_head`, `final_norm`, ...), each layer's slots under
`layers/layer_{i:03d}/<kind>/<leaf>` (routed experts as `packed`/`scale` uint8 leaves or
float leaves), and the vision tower / projector verbatim under `vision/`. Its custom
metadata (`k31jax`) holds the release `config.json`, the effective config overrides and
the conversion options; `k31jax_source_layout.json` records the source shards for `export`.

`load_checkpoint` restores the text model layer group by layer group (a bounded number of
bytes per Orbax call) and stacks the per-layer slots into the model's stacked parameters on
the target shardings: the host holds one call's bytes at a time, and the devices at most
one extra copy of one leaf while its slots are concatenated.
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ._names import stack_layers
from ._plan import CheckpointError, layer_key

FORMAT = "k31jax.orbax/1"
META_KEY = "k31jax"
LAYOUT_FILE = "k31jax_source_layout.json"
ASSETS_DIR = "k31jax_assets"
_STACKED = ("norms", "kda", "mla", "dense", "moe")


def _ocp():
    import orbax.checkpoint.experimental.v1 as ocp1

    return ocp1


# ----------------------------------------------------------------------------- saving options
@contextlib.contextmanager
def save_context(*, chunk_byte_size: int = 1 << 28, fsync_each_write: bool = False, use_ocdbt: bool = True):
    """Orbax options for the converter: no compression (MXFP4 bytes do not compress), no
    defensive copy of host arrays, and leaves larger than `chunk_byte_size` (the routed
    experts: 4.9 GB per leaf in K3) stored in chunks of at most that size, split along the
    leading (expert / vocab) axis first, so a sharded restore reads only the chunks it needs;
    smaller leaves are one chunk each (chunking costs write speed). With `fsync_each_write=False`
    TensorStore's per-write fsync is switched off for the duration (the converter syncs every
    file once at the end).

    With OCDBT every partial save leaves its own database, and finalize merges them all in
    one transaction, superlinearly in their number: a 93-layer tree in 442 calls converts in
    82 s all told, in 1,549 calls it had not finished merging after 8 minutes (3 GB held).
    Hence few, large calls (`convert` never writes less than the largest leaf per call).
    `use_ocdbt=False` avoids the merge but stores a file per chunk: a file per expert."""
    ocp1 = _ocp()
    ctx = ocp1.Context()
    ctx.array.saving.use_compression = False
    ctx.array.saving.use_ocdbt = use_ocdbt
    ctx.memory.deepcopy_host_arrays = False
    storage = ocp1.options.ArrayOptions.Saving.StorageOptions

    def chunked(_, value):  # split the leading axis (experts, vocab) first: that is what restores shard
        if getattr(value, "nbytes", 0) <= chunk_byte_size:
            return None
        return storage(chunk_byte_size=chunk_byte_size, shard_axes=(0,))

    ctx.array.saving.scoped_storage_options_creator = chunked
    overrides = {} if fsync_each_write else {"file_io_sync": False}
    patched = []
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

        defaults = (tsu._BASE_TS_CONTEXT, tsu._DEFAULT_OCDBT_TS_CONTEXT)
    except (ImportError, AttributeError):  # a different orbax: keep its defaults
        defaults = ()
    for d in defaults:
        for key, value in overrides.items():
            patched.append((d, key, key in d, d.get(key)))
            d[key] = value
    try:
        with ctx, quiet_orbax():
            yield ctx
    finally:
        for d, key, had, old in patched:
            if had:
                d[key] = old
            else:
                d.pop(key, None)


class _DropMessages(logging.Filter):
    # Orbax's warnings that are wrong for this checkpoint layout (zarr3 without OCDBT):
    # partial saves report the absent OCDBT databases on every call, and the v1 loader looks
    # only for zarr v2 `.zarray` files and calls the checkpoint possibly malformed.
    SPURIOUS = ("Skipping merge of OCDBT checkpoints", "TensorStore data files not found in checkpoint path")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.SPURIOUS)


@contextlib.contextmanager
def quiet_orbax():
    """Drop Orbax's spurious warnings about the converter's zarr3 layout (`_DropMessages`)."""
    logger, drop = logging.getLogger("absl"), _DropMessages()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def drop_interior_keys(d: dict) -> dict:
    """Drop every metadata key that is a strict prefix of another (an interior node, not a
    leaf): tuple keys (their `repr`) by tuple prefix, other pairs by string prefix ending in
    '.' or '/'. The same result as Orbax's partial-save `_filter_conflicting_keys`, which
    compares every ordered pair of keys — quadratic in the leaf count, for every call being
    merged: a 93-layer tree of K3's 3,180 leaves in 442 calls had not finished after 16
    CPU-minutes."""
    parsed = {}
    for k in d:
        try:
            parsed[k] = ast.literal_eval(k)
        except (ValueError, SyntaxError):
            parsed[k] = k
    tuple_prefixes, prefixes_of_all, prefixes_of_plain = set(), set(), set()
    for k, t in parsed.items():
        is_tuple = isinstance(t, tuple)
        if is_tuple:
            tuple_prefixes.update(t[:i] for i in range(len(t)))
        cuts = {k[:i] for i, ch in enumerate(k) if ch in "./"}
        prefixes_of_all |= cuts
        if not is_tuple:
            prefixes_of_plain |= cuts
    for k, t in parsed.items():
        if isinstance(t, tuple):
            interior = t in tuple_prefixes or k in prefixes_of_plain
        else:
            interior = k in prefixes_of_all
        if interior:
            del d[k]
    return d


@contextlib.contextmanager
def fast_partial_saves():
    """Orbax partial saves and their finalize in time linear in the leaves written.

    Orbax's partial save re-reads and re-merges the metadata of every earlier call and checks
    each new key against all saved keys, and its finalize filters keys pairwise per call:
    for K3's 3,180 leaves in 647 calls that grows with the square of the calls (a 93-layer
    synthetic tree in 442 calls had not finished after 16 CPU-minutes). Inside this context the
    replacement check keeps a set of the keys written so far (same errors: a key written
    twice, or a key that is a prefix of another, is refused) and finalize uses
    `drop_interior_keys`; both are restored afterwards. Where Orbax lacks these private
    functions nothing is patched (correct, just slow)."""
    try:
        from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as handler
        from orbax.checkpoint.experimental.v1._src.partial import saving
    except ImportError:  # pragma: no cover - a different orbax layout
        yield
        return
    patches = [(handler, "_get_partial_save_additions"), (saving, "_filter_conflicting_keys")]
    if not all(hasattr(mod, name) for mod, name in patches):  # pragma: no cover
        yield
        return
    seen: set[tuple] = set()
    interior: set[tuple] = set()

    async def additions(directory, flat_item, pytree_metadata_options):
        for key in flat_item:
            path = key if isinstance(key, tuple) else (key,)
            if path in seen or path in interior or any(path[:i] in seen for i in range(1, len(path))):
                raise handler.PartialSaveReplacementError(
                    f"Key {key!r} was found in a previous partial save in this session (or is a prefix "
                    "of / prefixed by one). Partial saving does not support REPLACEMENT.")
            seen.add(path)
            interior.update(path[:i] for i in range(1, len(path)))
        return set(flat_item)

    old = [getattr(mod, name) for mod, name in patches]
    handler._get_partial_save_additions = additions
    saving._filter_conflicting_keys = drop_interior_keys
    try:
        yield
    finally:
        for (mod, name), fn in zip(patches, old):
            setattr(mod, name, fn)


def flush_new_files(root: Path, seen: set[str], *, sealed_depth: int = 2) -> None:
    """fsync the files written under `root` since the last call and drop them from the page
    cache (a streaming writer's pages are never read again; recycling them keeps the cache
    footprint of a 1.5 TB conversion at one write call). `seen` carries state between calls.

    Orbax writes each partial save into a new folder `sealed_depth` levels below the
    converter's box (`<box>/<name>.partial_save/<pending>`) and leaves it alone until
    finalize, so a folder at that depth is walked once, when it first appears: each call
    costs what it wrote, not what the checkpoint holds. (Anything rewritten later is synced
    by the final `fsync_tree`.) Safe to run while the next save writes: files that vanish
    mid-walk are skipped."""
    base = len(Path(root).parts)
    for dirpath, dirnames, files in os.walk(root):
        depth = len(Path(dirpath).parts) - base
        if depth == sealed_depth - 1:
            fresh = [d for d in dirnames if os.path.join(dirpath, d) not in seen]
            seen.update(os.path.join(dirpath, d) for d in fresh)
            dirnames[:] = fresh
        for f in files:
            path = os.path.join(dirpath, f)
            if depth < sealed_depth and path in seen:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # renamed or removed by a save running meanwhile
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            if depth < sealed_depth:
                seen.add(path)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (durability before the final rename)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- reading
def checkpoint_info(path: str | os.PathLike) -> dict:
    """The k31jax metadata of a complete converted checkpoint, or a `CheckpointError`."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    ocp1 = _ocp()
    if not (path / "_CHECKPOINT_METADATA").exists() or not ocp1.is_orbax_checkpoint(path):
        raise CheckpointError(f"{path}: not a finalized Orbax checkpoint (an interrupted conversion leaves none)")
    try:
        with quiet_orbax():
            meta = ocp1.metadata(path)
    except Exception as e:  # noqa: BLE001 - any orbax failure means "not a usable checkpoint"
        raise CheckpointError(f"{path}: unreadable Orbax metadata ({type(e).__name__}: {e})") from None
    info = (meta.custom_metadata or {}).get(META_KEY)
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a k31jax checkpoint (custom metadata {META_KEY!r} with format "
                              f"{FORMAT!r} missing); convert a release folder with `k31jax convert`")
    info = dict(info, stored=meta.metadata)
    return info


def checkpoint_config(info: dict, **overrides) -> ModelConfig:
    fields = dict(info.get("overrides") or {})
    fields.update(overrides)
    return ModelConfig.from_hf(info["config"], **fields)


def _flat(tree, prefix=()) -> dict[tuple[str, ...], object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _nest(flat: dict) -> dict:
    tree: dict = {}
    for key, v in flat.items():
        t = tree
        for k in key[:-1]:
            t = t.setdefault(k, {})
        t[key[-1]] = v
    return tree


def load_stored(path: str | os.PathLike, keys, stored: dict | None = None) -> dict[tuple[str, ...], np.ndarray]:
    """Host (numpy) copies of the stored leaves `keys` (Orbax key paths), in their stored dtype."""
    ocp1 = _ocp()
    path = Path(path).absolute()
    if stored is None:
        with quiet_orbax():
            stored = _flat(ocp1.metadata(path).metadata)
    targets = {}
    for k in keys:
        if k not in stored:
            raise CheckpointError(f"{path}: stored leaf {'/'.join(k)} is missing")
        m = stored[k]
        targets[k] = np.empty(tuple(m.shape), np.dtype(m.dtype))
    if not targets:
        return {}
    ctx = ocp1.Context()
    ctx.pytree.loading.partial_load = True
    with ctx:
        with quiet_orbax():
            out = ocp1.load(str(path), _nest(targets))
    return {k: np.asarray(v) for k, v in _flat(out).items()}


def load_vision(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The vision tower and projector tensors by release name, as stored (verbatim)."""
    info = checkpoint_info(path)
    stored = _flat(info["stored"])
    keys = [k for k in stored if k[0] == "vision"]
    return {".".join(k[1:]): v for k, v in load_stored(path, keys, stored).items()}


def _resolve_shardings(shardings, targets: dict) -> dict[tuple[str, ...], object]:
    flat_t = _flat(targets)
    if shardings is None:  # uncommitted arrays on the default device, like a freshly built model
        return dict.fromkeys(flat_t)
    if isinstance(shardings, jax.sharding.Sharding):
        return dict.fromkeys(flat_t, shardings)
    from flax import nnx

    if isinstance(shardings, nnx.State):
        shardings = nnx.to_pure_dict(shardings)
    flat_s = {}
    for kp, leaf in jax.tree_util.tree_leaves_with_path(
            shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)):
        key = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in kp)
        flat_s[key] = leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)
    missing = [k for k in flat_t if flat_s.get(k) is None]
    if missing:
        raise CheckpointError(f"shardings: no sharding for parameters {['/'.join(k) for k in missing[:6]]}")
    return {k: flat_s[k] for k in flat_t}


def _place(host: np.ndarray, sharding) -> jax.Array:
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _concat(parts: tuple, sharding) -> jax.Array:
    if sharding is None:
        return jnp.concatenate(parts)
    return jax.jit(lambda *p: jnp.concatenate(p), out_shardings=sharding)(*parts)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    dtype=None,
    shardings=None,
    max_bytes_per_call: int = 2 << 30,
):
    """Restore a converted checkpoint as a ready `K31ForCausalLM`.

    dtype: compute / parameter dtype (e.g. `jnp.float32` for exact comparisons; default
    bfloat16); the model's float32 parameters stay float32 and packed MXFP4 experts stay
    uint8. shardings: None (the default device), one `jax.sharding.Sharding` for every
    parameter, or a tree like `nnx.to_pure_dict(nnx.state(model, nnx.Param))` (or the
    abstract state of `nnx.get_abstract_model`) of shardings / arrays carrying one.
    Layers are restored in calls of at most `max_bytes_per_call` bytes. The vision subtree
    is not read (see `load_vision`).
    """
    from flax import nnx

    from ..nn import K31ForCausalLM

    path = Path(path).absolute()
    info = checkpoint_info(path)
    cfg = checkpoint_config(info, dtype=str(jnp.dtype(dtype or jnp.bfloat16)))
    abstract = nnx.eval_shape(lambda: K31ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    targets = nnx.to_pure_dict(abs_state)
    flat_t = _flat(targets)
    shard = _resolve_shardings(shardings, targets)
    stored = _flat(info["stored"])
    layers_of = stack_layers(cfg)

    def where(key, slot):  # model leaf (+ slot) -> stored key
        if key[0] in _STACKED:
            return ("layers", layer_key(layers_of[key[0]][slot])) + key
        return key

    def check(key, skey, want_shape):
        m = stored.get(skey)
        if m is None:
            raise CheckpointError(f"{path}: stored leaf {'/'.join(skey)} is missing (needed for "
                                  f"{'/'.join(key)})")
        if tuple(m.shape) != tuple(want_shape):
            raise CheckpointError(f"{path}: stored leaf {'/'.join(skey)} has shape {list(m.shape)}, the model "
                                  f"built from the checkpoint's config expects {list(want_shape)}")

    out: dict[tuple[str, ...], jax.Array] = {}
    used: set[tuple[str, ...]] = set()
    plain = [k for k in flat_t if k[0] not in _STACKED]
    for k in plain:
        check(k, k, flat_t[k].shape)
    host = load_stored(path, plain, stored)
    for k in plain:
        out[k] = _place(host[k].astype(flat_t[k].dtype, copy=False), shard[k])
        used.add(k)
    del host
    # Stacked leaves: consecutive layers per call, bounded bytes; each leaf's slots of a call
    # are consecutive, so they land in the stacked buffer with one update.
    per_layer: dict[int, list[tuple[tuple[str, ...], int]]] = {}
    for k in flat_t:
        if k[0] in _STACKED:
            for slot, layer in enumerate(layers_of[k[0]]):
                per_layer.setdefault(layer, []).append((k, slot))
    calls, cur, size = [], [], 0
    for layer in sorted(per_layer):
        b = sum(int(np.prod(flat_t[k].shape[1:])) * np.dtype(flat_t[k].dtype).itemsize for k, _ in per_layer[layer])
        if cur and size + b > max_bytes_per_call:
            calls.append(cur)
            cur, size = [], 0
        cur.append(layer)
        size += b
    if cur:
        calls.append(cur)
    # A leaf's slots arrive in runs of consecutive layers. Small leaves are assembled on the
    # host; the others as device arrays on the target sharding, concatenated once complete.
    host_limit = max(max_bytes_per_call // 64, 1 << 16)
    pending: dict[tuple[str, ...], list] = {}
    for layers in calls:
        items = [(k, slot) for layer in layers for k, slot in per_layer[layer]]
        for k, slot in items:
            check(k, where(k, slot), flat_t[k].shape[1:])
        host = load_stored(path, [where(k, slot) for k, slot in items], stored)
        by_leaf: dict[tuple[str, ...], list[int]] = {}
        for k, slot in items:
            by_leaf.setdefault(k, []).append(slot)
            used.add(where(k, slot))
        for k, slots in by_leaf.items():
            t = flat_t[k]
            chunk = np.stack([host.pop(where(k, s)) for s in slots]).astype(t.dtype, copy=False)
            if len(slots) == t.shape[0]:
                out[k] = _place(chunk, shard[k])
                continue
            small = t.size * np.dtype(t.dtype).itemsize <= host_limit
            parts = pending.setdefault(k, [])
            parts.append(chunk if small else _place(chunk, _run_sharding(shard[k])))
            if sum(p.shape[0] for p in parts) == t.shape[0]:
                del pending[k]
                if small:
                    out[k] = _place(np.concatenate(parts), shard[k])
                else:
                    out[k] = _concat(tuple(parts), shard[k])
                del parts
        del host
    extra = sorted("/".join(k) for k in stored if k[0] != "vision" and k not in used)
    if extra:
        raise CheckpointError(f"{path}: stored leaves {extra[:6]} are not parameters of the model built from the "
                              "checkpoint's config (a checkpoint written for another config?)")
    nnx.replace_by_pure_dict(abs_state, _nest(out))
    return nnx.merge(graphdef, abs_state)


def _run_sharding(sh):
    """The sharding for a run of consecutive layer slots: the stacked spec with the layers
    axis unsharded (it is usually unsharded already). None stays None (default device)."""
    from jax.sharding import NamedSharding, PartitionSpec

    if isinstance(sh, NamedSharding):
        spec = tuple(sh.spec)
        return NamedSharding(sh.mesh, PartitionSpec(None, *spec[1:]))
    return sh


def read_layout(path: str | os.PathLike) -> dict | None:
    """The recorded source layout of a converted checkpoint (None when absent)."""
    f = Path(path) / LAYOUT_FILE
    if not f.exists():
        return None
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: corrupt layout record ({e})") from None
