"""The k31jax Orbax checkpoint: reading it back into a model (`load_checkpoint`).

A converted checkpoint (`k31jax convert`) is an Orbax v1 pytree checkpoint written layer by
layer with partial saves. Its tree (see `_plan.py`): unstacked leaves under their model
path (`embed`, `lm_head`, `final_norm`, ...), each layer's slots under
`layers/layer_{i:03d}/<kind>/<leaf>` (routed experts as `packed`/`scale` uint8 leaves or
float leaves), and the vision tower / projector verbatim under `vision/`. Its custom
metadata (`k31jax`) holds the release `config.json`, the effective config overrides and
the conversion options; `k31jax_source_layout.json` records the source shards for `export`.
With `vision=True`, `load_checkpoint` also builds the `VisionModel` from `vision/`
(`_vision.py`); `load_checkpoint_vision` reads only that, from either kind of folder.

`load_checkpoint` restores the text model layer group by layer group (a bounded number of
bytes per Orbax call) and stacks the per-layer slots into the model's stacked parameters on
the target shardings: the host holds one call's bytes at a time, and the devices at most
one extra copy of one leaf while its slots are concatenated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ..config import ModelConfig
from ..nn import K31ForCausalLM, abstract_model
from ..sharding import Rules, place_host_array
from ..vision import VisionModel
from ._manifest import check_checksums, check_sizes, read_manifest, require_manifest
from ._names import stack_layers
from ._plan import layer_key
from ._transforms import CheckpointError
from ._safetensors import SafetensorsIndex
from ._vision import ModelWithVision, build_vision, vision_config_of

FORMAT = "k31jax.orbax/1"
META_KEY = "k31jax"
LAYOUT_FILE = "k31jax_source_layout.json"
ASSETS_DIR = "k31jax_assets"
_STACKED = ("norms", "kda", "mla", "dense", "moe")


def _ocp():
    # Orbax (and TensorStore under it) is imported on first use: a heavy import that
    # `import k31jax` should not pay for.
    import orbax.checkpoint.experimental.v1 as ocp1

    return ocp1


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


# ----------------------------------------------------------------------------- reading
def check_integrity(path: str | os.PathLike, *, checksums: bool) -> None:
    """The stored files against the checkpoint's manifest (`_manifest.py`): their sizes, and
    with `checksums` every byte. Without a manifest (a checkpoint converted before k31jax wrote
    one) sizes are not checked and `checksums=True` is an `IntegrityError`."""
    path = Path(path)
    if not path.is_dir():
        return  # `checkpoint_info` names the problem
    manifest = require_manifest(path) if checksums else read_manifest(path)
    if manifest is None:
        return
    check_sizes(path, manifest)
    if checksums:
        check_checksums(path, manifest)


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


def flatten(tree, prefix=()) -> dict[tuple[str, ...], object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, prefix + (k,)))
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
            stored = flatten(ocp1.metadata(path).metadata)
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
    return {k: np.asarray(v) for k, v in flatten(out).items()}


def load_vision(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The vision tower and projector tensors by release name, as stored (verbatim)."""
    return _stored_vision(path, flatten(checkpoint_info(path)["stored"]))


def _stored_vision(path, stored: dict) -> dict[str, np.ndarray]:
    keys = [k for k in stored if k[0] == "vision"]
    return {".".join(k[1:]): v for k, v in load_stored(path, keys, stored).items()}


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """A finalized Orbax checkpoint (the converter's output), not a safetensors folder."""
    p = Path(path)
    return (p / "_CHECKPOINT_METADATA").exists() or (p.is_dir() and not any(p.glob("*.safetensors")))


def load_checkpoint_vision(path: str | os.PathLike, config: ModelConfig | None = None, *, dtype=None,
                           mesh: jax.sharding.Mesh | None = None,
                           rules: Rules | str | None = None) -> VisionModel:
    """Only the `VisionModel` (tower + merge + projector) of a checkpoint folder: a converted
    Orbax checkpoint or a release-layout safetensors folder; the text model is not read.

    config: default the checkpoint's own (its Orbax metadata, or `config.json`). dtype:
    default as the text model's loader: bfloat16 for an Orbax checkpoint (`load_checkpoint`),
    the config's for a release folder (`load_hf_weights`). mesh: each parameter placed by its
    logical axes (`rules`: a table or its name; default the mesh's), i.e. tensor parallel
    over the attention heads and the MLP width; None: the default device. A config without
    a `vision_config` is a `CheckpointError`; missing or misshapen vision tensors are a
    `VisionLoadError`; both name the folder.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if is_orbax_checkpoint(path):
        info = checkpoint_info(path)
        cfg = config or checkpoint_config(info)
        vision_config_of(cfg, path)  # before reading any tensor
        dtype = dtype or jnp.bfloat16
        tensors = _stored_vision(path, flatten(info["stored"]))
    else:
        cfg = config or ModelConfig.from_hf(path)
        vision_config_of(cfg, path)
        tensors = SafetensorsIndex(path)
    return build_vision(tensors, cfg, path, dtype=dtype, mesh=mesh, rules=rules)


def _resolve_shardings(shardings, targets: dict) -> dict[tuple[str, ...], object]:
    flat_t = flatten(targets)
    if shardings is None:  # uncommitted arrays on the default device, like a freshly built model
        return dict.fromkeys(flat_t)
    if isinstance(shardings, jax.sharding.Sharding):
        return dict.fromkeys(flat_t, shardings)
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
    return place_host_array(host, sharding)


def _concat(parts: tuple, sharding) -> jax.Array:
    if sharding is None:
        return jnp.concatenate(parts)
    return jax.jit(lambda *p: jnp.concatenate(p), out_shardings=sharding)(*parts)


def _vision_placement(shardings, shard: dict) -> dict:
    """Where `load_checkpoint(vision=True)` puts the vision modules: on the default device
    without `shardings`, on the one sharding given for every parameter, else by their
    logical axes on the mesh of the given (Named) shardings."""
    if shardings is None:
        return {}
    if isinstance(shardings, jax.sharding.Sharding):
        return {"sharding": shardings}
    for sh in shard.values():
        if isinstance(sh, NamedSharding):
            return {"mesh": sh.mesh}
    return {"sharding": next((sh for sh in shard.values() if sh is not None), None)}


@overload
def load_checkpoint(path: str | os.PathLike, *, dtype=..., shardings=..., max_bytes_per_call: int = ...,
                    verify: bool = ..., vision: Literal[False] = ..., rules=...) -> K31ForCausalLM: ...


@overload
def load_checkpoint(path: str | os.PathLike, *, dtype=..., shardings=..., max_bytes_per_call: int = ...,
                    verify: bool = ..., vision: Literal[True], rules=...) -> ModelWithVision: ...


def load_checkpoint(
    path: str | os.PathLike,
    *,
    dtype=None,
    shardings=None,
    max_bytes_per_call: int = 2 << 30,
    verify: bool = False,
    vision: bool = False,
    rules: Rules | str | None = None,
):
    """Restore a converted checkpoint as a ready `K31ForCausalLM` (with `vision=True`, a
    `ModelWithVision(model, vision)`).

    dtype: compute / parameter dtype (e.g. `jnp.float32` for exact comparisons; default
    bfloat16); the model's float32 parameters stay float32 and packed MXFP4 experts stay
    uint8. shardings: None (the default device), one `jax.sharding.Sharding` for every
    parameter, or a tree like `nnx.to_pure_dict(nnx.state(model, nnx.Param))` (or the
    abstract state of `nnx.get_abstract_model`) of shardings / arrays carrying one.
    Layers are restored in calls of at most `max_bytes_per_call` bytes.
    verify: check every stored byte against the checksum manifest first (reads the whole
    checkpoint once more); without it only the files' sizes are checked. A damaged or
    truncated file is an `IntegrityError` naming it.
    vision: also build the `VisionModel` (MoonViT tower, merge, projector) from the stored
    `vision/` subtree, in `dtype`. Its placement follows `shardings`: none, the default
    device; one sharding, that one; a tree, each vision parameter by its logical axes on
    the mesh of those shardings (tensor parallel over heads and MLP width) under `rules`
    (a table or its name; default the mesh's). A checkpoint whose config has no
    `vision_config` is a `CheckpointError`. Without `vision` the subtree is not read
    (`load_vision` returns its tensors, `load_checkpoint_vision` the vision model alone).
    """
    path = Path(path).absolute()
    check_integrity(path, checksums=verify)
    info = checkpoint_info(path)
    cfg = checkpoint_config(info, dtype=str(jnp.dtype(dtype or jnp.bfloat16)))
    if vision:
        vision_config_of(cfg, path)  # fail before reading the text model
    abstract = abstract_model(cfg)
    graphdef, abs_state = nnx.split(abstract)
    targets = nnx.to_pure_dict(abs_state)
    flat_t = flatten(targets)
    shard = _resolve_shardings(shardings, targets)
    stored = flatten(info["stored"])
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
    model = nnx.merge(graphdef, abs_state)
    if not vision:
        return model
    vision_model = build_vision(_stored_vision(path, stored), cfg, path, rules=rules,
                                **_vision_placement(shardings, shard))
    return ModelWithVision(model, vision_model)


def _run_sharding(sh):
    """The sharding for a run of consecutive layer slots: the stacked spec with the layers
    axis unsharded (it is usually unsharded already). None stays None (default device)."""
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
