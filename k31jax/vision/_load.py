"""Building a `VisionModel` from the release tensors (`vision_tower.*`, `mm_projector.*`).

The source is any mapping-like object from tensor name to array: `k31jax.ckpt.load_vision`
of a converted checkpoint (the tensors are kept verbatim there), a `k31jax.ckpt.SafetensorsIndex`
of a release folder (it reads a tensor on `[name]`), or a plain dict. Every vision tensor must
be used exactly once and have its spec shape (checkpoint_format.md §3.7), or the load fails
naming it. Under a mesh, each parameter is placed on the sharding its logical axes give.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from ..config import VisionConfig
from ..sharding import logical_to_spec, place_host_array
from ._modules import VisionModel, abstract_vision_model

TOWER, PROJECTOR = "vision_tower.", "mm_projector."


class VisionLoadError(ValueError):
    """Vision tensors that do not make the configured tower; the message names the tensor."""


def _names(tensors) -> list[str]:
    if hasattr(tensors, "names"):
        return list(tensors.names())
    return list(tensors.keys())


def release_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every vision tensor of the release and its shape (checkpoint_format.md §3.7)."""
    d, p, f, e = cfg.hidden_size, cfg.patch_size, cfg.intermediate_size, cfg.qkv_hidden_size
    m = cfg.merged_hidden_size
    out = {TOWER + "patch_embed.proj.weight": (d, 3, p, p),
           TOWER + "patch_embed.pos_emb.weight": (cfg.pos_emb_height, cfg.pos_emb_width, d)}
    for j in range(cfg.num_hidden_layers):
        b = f"{TOWER}encoder.blocks.{j}."
        out.update({b + "norm0.weight": (d,), b + "norm1.weight": (d,), b + "wqkv.weight": (3 * e, d),
                    b + "wo.weight": (d, e), b + "mlp.fc0.weight": (f, d), b + "mlp.fc1.weight": (d, f)})
    out[TOWER + "encoder.final_layernorm.weight"] = (d,)
    out.update({PROJECTOR + "proj.0.weight": (m, m), PROJECTOR + "proj.2.weight": (cfg.text_hidden_size, m),
                PROJECTOR + "post_norm.weight": (cfg.text_hidden_size,)})
    return out


def _block_leaf(name: str, value: np.ndarray, cfg: VisionConfig) -> tuple[str, np.ndarray]:
    """A block tensor in the module's layout."""
    if name == "wqkv.weight":  # [3*e, D] rows q | k | v -> [D, 3, e]
        return "wqkv", value.reshape(3, cfg.qkv_hidden_size, cfg.hidden_size).transpose(2, 0, 1)
    if name in ("norm0.weight", "norm1.weight"):
        return name.split(".")[0], value
    return {"wo.weight": "wo", "mlp.fc0.weight": "fc0", "mlp.fc1.weight": "fc1"}[name], value.T


def vision_state(tensors, cfg: VisionConfig) -> dict:
    """`nnx.to_pure_dict`-shaped NumPy state of `VisionModel(cfg)` from the release tensors."""
    want = release_shapes(cfg)
    names = [n for n in _names(tensors) if n.startswith((TOWER, PROJECTOR))]
    missing = sorted(set(want) - set(names))
    extra = sorted(set(names) - set(want))
    if missing:
        raise VisionLoadError(f"missing vision tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                              f"({len(missing)} of {len(want)}) for a {cfg.num_hidden_layers}-block tower")
    if extra:
        raise VisionLoadError(f"unexpected vision tensors {extra[:5]}: not part of the configured tower "
                              f"(vt_num_hidden_layers={cfg.num_hidden_layers})")

    def get(name):
        value = np.asarray(tensors[name])
        if tuple(value.shape) != want[name]:
            raise VisionLoadError(f"{name}: shape {list(value.shape)}, expected {list(want[name])}")
        return value

    d = cfg.hidden_size
    blocks: dict[str, list] = {}
    for j in range(cfg.num_hidden_layers):
        b = f"{TOWER}encoder.blocks.{j}."
        for short in ("norm0.weight", "wqkv.weight", "wo.weight", "norm1.weight", "mlp.fc0.weight", "mlp.fc1.weight"):
            leaf, value = _block_leaf(short, get(b + short), cfg)
            blocks.setdefault(leaf, []).append(value)
    tower = {"patch_embed": get(TOWER + "patch_embed.proj.weight").reshape(d, -1).T,
             "pos_emb": get(TOWER + "patch_embed.pos_emb.weight"),
             "blocks": {k: np.stack(v) for k, v in blocks.items()},
             "final_norm": get(TOWER + "encoder.final_layernorm.weight")}
    projector = {"proj0": get(PROJECTOR + "proj.0.weight").T, "proj2": get(PROJECTOR + "proj.2.weight").T,
                 "post_norm": get(PROJECTOR + "post_norm.weight")}
    return {"tower": tower, "projector": projector}


def _logical_axes(var) -> tuple:
    meta = var.get_metadata()
    axes = tuple(meta.get("out_sharding") or ())
    return ("layers",) + axes if len(axes) == len(var.shape) - 1 else axes


def load_vision_model(tensors, cfg: VisionConfig, *, dtype="bfloat16", mesh: jax.sharding.Mesh | None = None,
                      rules=None, sharding: jax.sharding.Sharding | None = None,
                      attention_block: int = 1024) -> VisionModel:
    """A ready `VisionModel` from the release tensors (see the module docstring), every
    parameter cast to `dtype`; with `mesh`, each placed by its logical axes (`rules`: a rule
    table or its name; default the mesh's): tensor parallel over the attention heads and the
    MLP width. `sharding`: one sharding for every parameter instead (e.g. replicated).
    Neither: the default device."""
    if mesh is not None and sharding is not None:
        raise ValueError("load_vision_model: pass mesh (placement by logical axes) or sharding (one for every "
                         "parameter), not both")
    graphdef, abstract = nnx.split(abstract_vision_model(cfg, dtype, attention_block=attention_block))
    host = vision_state(tensors, cfg)
    flat_abs = dict(nnx.to_flat_state(abstract))
    flat_host = {tuple(k): v for k, v in _flatten(host)}
    if set(flat_abs) != set(flat_host):  # the layout table above and the modules disagree
        raise VisionLoadError(f"internal: state paths differ: {sorted(set(flat_abs) ^ set(flat_host))[:4]}")
    values = {}
    for path, var in flat_abs.items():
        value = flat_host[path]
        if tuple(value.shape) != tuple(var.shape):
            raise VisionLoadError(f"internal: {'/'.join(map(str, path))} built as {list(value.shape)}, "
                                  f"expected {list(var.shape)}")
        value = np.asarray(value).astype(var.dtype)
        if sharding is not None:
            values[path] = place_host_array(value, sharding)
        elif mesh is None:
            values[path] = jnp.asarray(value)
        else:
            spec = logical_to_spec(_logical_axes(var), value.shape, dict(mesh.shape), rules)
            values[path] = place_host_array(value, NamedSharding(mesh, spec))
    state = nnx.to_pure_dict(abstract)
    for path, value in values.items():
        node = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    nnx.replace_by_pure_dict(abstract, state)
    return nnx.merge(graphdef, abstract)


def _flatten(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value
