"""Header-only planning of a checkpoint conversion, and the per-leaf value builders.

`make_plan(cfg, tensors)` matches a safetensors inventory (`{name: TensorInfo}`, headers
only) against the name table (`_names.param_sources`) and the model's abstract parameter
tree, and returns one `Entry` per stored leaf: the Orbax key it is written under, its
stored shape and dtype, and the source tensors it is built from. Every problem (unknown,
missing or unused tensors, wrong shapes or dtypes, a config that disagrees with the
weights, the K3.1 indexer guard) is collected and raised as one `CheckpointError` naming
the files and tensors (spec checkpoint_format.md §6).

The values are built by `_transforms.build_value(entry, reader, cfg)` and mapped back by
its exact inverse `_transforms.unbuild_value`; the in-memory loader
(`load_hf_weights`), the streaming converter, `--verify` and `export` all go through them.

On-disk (Orbax) layout: unstacked leaves keep their model path (`embed`, `lm_head`, ...);
the slot of a stacked leaf for layer i lives under `layers/layer_{i:03d}/<model path>`;
the vision tower and projector live under `vision/<dotted name as a path>`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..nn import abstract_model
from ._names import F32_PARAMS, INDEXER_RE, VISION_PREFIXES, Source, detect_prefix, param_sources, vision_sources
from ._safetensors import SAFETENSORS_DTYPES, TensorInfo, no_gc
from ._transforms import FLOAT_DTYPES, CheckpointError, Entry, expected_dtypes, expected_shapes, get_path

__all__ = ["STORE_DTYPES", "Plan", "layer_key", "make_plan", "stored_float_dtype"]

def layer_key(layer: int) -> str:
    return f"layer_{layer:03d}"


@dataclasses.dataclass
class Plan:
    """The checked conversion plan. `cfg` is the effective config (indexer switch and expert
    format resolved); `dropped` lists source tensors deliberately left out."""

    cfg: ModelConfig
    entries: list[Entry]
    dropped: list[str]
    options: dict

    def groups(self) -> list[tuple[str, list[Entry]]]:
        """Entries by group (globals, layer_000, ..., vision), in source-file order."""
        by: dict[str, list[Entry]] = {}
        for e in self.entries:
            by.setdefault(e.group, []).append(e)
        def first(es):
            locs = [(e.tensors[0].file.name, e.tensors[0].start) for e in es if e.tensors]
            return min(locs) if locs else ("~", 0)
        out = []
        for g, es in sorted(by.items(), key=lambda kv: first(kv[1])):
            es.sort(key=lambda e: (e.tensors[0].file.name, e.tensors[0].start) if e.tensors else ("~", 0))
            out.append((g, es))
        return out

    def calls(self, max_bytes: int) -> list[tuple[str, list[Entry]]]:
        """Write calls of at most `max_bytes`: whole consecutive groups packed together, and a
        group larger than that split between leaves (a single larger leaf goes alone)."""
        out: list[tuple[str, list[Entry]]] = []
        cur: list[Entry] = []
        names: list[str] = []
        size = 0

        def flush():
            nonlocal cur, names, size
            if cur:
                out.append((names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}", cur))
            cur, names, size = [], [], 0

        for g, es in self.groups():
            total = sum(e.nbytes for e in es)
            if total > max_bytes:
                flush()
                for e in es:
                    if cur and size + e.nbytes > max_bytes:
                        flush()
                    cur.append(e)
                    names[:] = [g]
                    size += e.nbytes
                flush()
                continue
            if cur and size + total > max_bytes:
                flush()
            cur += es
            names.append(g)
            size += total
        flush()
        return out

    def tree(self) -> dict:
        """The stored (Orbax) tree with `jax.ShapeDtypeStruct` leaves."""
        tree: dict = {}
        for e in self.entries:
            _set(tree, e.key, jax.ShapeDtypeStruct(e.shape, e.dtype))
        return tree

    @property
    def source_bytes(self) -> int:
        return sum(e.source_bytes for e in self.entries)

    @property
    def stored_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


# What `dtype=` may store the non-expert weights as: the model's own parameter dtypes (an
# integer or 8-bit float would silently change the weights).
STORE_DTYPES = ("bfloat16", "float16", "float32")


def stored_float_dtype(dtype) -> np.dtype:
    """`dtype` as a NumPy dtype if it is one of `STORE_DTYPES`, else a `CheckpointError`."""
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d is None or d.name not in STORE_DTYPES:
        raise CheckpointError(f"dtype={dtype!r}: the non-expert weights can be stored as {', '.join(STORE_DTYPES)} "
                              "only (floating types that hold the release's values)")
    return d


def _set(tree: dict, key, value) -> None:
    for k in key[:-1]:
        tree = tree.setdefault(k, {})
    if key[-1] in tree:
        raise CheckpointError(f"internal: two stored leaves at {'/'.join(key)}")
    tree[key[-1]] = value


def _fmt_shapes(shapes) -> str:
    return " or ".join(str(list(s)) for s in shapes)


def _where(info: TensorInfo) -> str:
    return f"{info.file.name}: tensor {info.name!r}"


# ----------------------------------------------------------------------------- planning
class _Problems:
    def __init__(self):
        self.config: list[str] = []
        self.missing: list[str] = []
        self.mismatch: list[str] = []
        self.unknown: list[str] = []

    def __bool__(self):
        return bool(self.config or self.missing or self.mismatch or self.unknown)

    def raise_(self, root) -> None:
        lines = []
        for title, items in (("config.json disagrees with the weights", self.config),
                             ("missing tensors", self.missing), ("wrong shape or dtype", self.mismatch),
                             ("unknown or unused tensors", self.unknown)):
            if items:
                lines.append(f"{title} ({len(items)}):")
                lines += [f"  - {x}" for x in items[:10]]
                if len(items) > 10:
                    lines.append(f"  - ... and {len(items) - 10} more")
        raise CheckpointError(f"{root}: the checkpoint does not match its config:\n" + "\n".join(lines))


_EXPERT_NUM_RE = re.compile(r"\.experts\.(\d+)\.")


def _indexer_guard(cfg: ModelConfig, names, tensors, no_indexer: bool, init_missing_indexer: bool,
                   problems: _Problems) -> tuple[ModelConfig, set[str], bool]:
    """The K3.1 switch: (config, indexer tensors to drop, whether to initialise missing ones)."""
    found = {n for n in names if INDEXER_RE.search(n)}
    layers = sorted({int(INDEXER_RE.search(n).group(1)) for n in found})
    mla = list(cfg.mla_layers)
    if no_indexer:
        if cfg.use_indexer:
            cfg = cfg.replace(index_topk=None, index_n_heads=0, index_head_dim=0)
        return cfg, found, False
    if cfg.use_indexer and not found:
        if init_missing_indexer:
            return cfg, set(), True
        problems.config.append(
            f"config.json asks for the K3.1 lightning indexer (index_topk={cfg.index_topk}, index_n_heads="
            f"{cfg.index_n_heads}, index_head_dim={cfg.index_head_dim}) but the weights hold no indexer "
            f"tensors (`layers.{{i}}.self_attn.indexer.*` on the MLA layers {mla[:6]}{'...' if len(mla) > 6 else ''}). "
            "Pass --no-indexer (no_indexer=True) to load them as dense gated MLA (K3), or "
            "--init-missing-indexer (init_missing_indexer=True) to start a fresh indexer, which must be "
            "trained before index_topk < context is used")
    elif found and not cfg.use_indexer:
        example = sorted(found)[0]
        problems.config.append(
            f"the weights hold {len(found)} lightning-indexer tensors (e.g. {_where(tensors[example])}, on layers "
            f"{layers[:6]}{'...' if len(layers) > 6 else ''}) but config.json has no index_topk / index_n_heads / "
            "index_head_dim: add them to text_config to load K3.1 Gated DSA, or pass --no-indexer "
            "(no_indexer=True) to drop these tensors and load dense gated MLA")
    elif found:
        off = [i for i in layers if i not in cfg.mla_layers]
        if off:
            problems.config.append(f"indexer tensors sit on non-MLA layers {off[:8]}; they must be exactly on the "
                                   f"MLA layers {mla[:8]}{'...' if len(mla) > 8 else ''}")
    return cfg, set(), False


def _count_checks(cfg: ModelConfig, names, tensors, pre: str, problems: _Problems) -> None:
    """Layer and expert counts: the clearest message for a config/weights disagreement."""
    lp = pre + "layers."
    layers: dict[int, str] = {}
    experts: dict[int, str] = {}
    for n in names:
        if not n.startswith(lp):
            continue
        dot = n.find(".", len(lp))
        i = n[len(lp):dot]
        if i.isdigit() and int(i) not in layers:
            layers[int(i)] = n
        k = n.find(".experts.", dot)
        if k >= 0:
            e = n[k + 9:n.find(".", k + 9)]
            if e.isdigit() and int(e) not in experts:
                experts[int(e)] = n
    if layers:
        extra = sorted(i for i in layers if i >= cfg.num_hidden_layers)
        if extra:
            mtp = " (MTP / extra layers are not supported)" if extra[0] == cfg.num_hidden_layers else ""
            problems.config.append(f"config.json num_hidden_layers={cfg.num_hidden_layers}, but the weights have "
                                   f"layers up to {max(layers)} (e.g. {_where(tensors[layers[extra[0]]])}){mtp}")
        absent = sorted(set(range(cfg.num_hidden_layers)) - set(layers))
        if absent:
            problems.config.append(f"config.json num_hidden_layers={cfg.num_hidden_layers}, but the weights have no "
                                   f"tensors for layers {absent[:8]}{'...' if len(absent) > 8 else ''}")
    if experts and cfg.moe_layers:
        if max(experts) >= cfg.num_experts:
            problems.config.append(f"config.json num_experts={cfg.num_experts}, but the weights have experts up to "
                                   f"{max(experts)} (e.g. {_where(tensors[experts[max(experts)]])})")
        elif max(experts) + 1 < cfg.num_experts:
            problems.config.append(f"config.json num_experts={cfg.num_experts}, but the weights have only experts "
                                   f"0..{max(experts)}")


def _resolve(src: Source, tensors, used: set[str], problems: _Problems, what: str) -> TensorInfo | None:
    present = [n for n in src.names if n in tensors]
    if not present:
        alts = " or ".join(repr(n) for n in src.names)
        problems.missing.append(f"{alts} (for parameter {what})")
        return None
    if len(present) > 1:
        problems.mismatch.append(f"{present} are alternative spellings of one tensor (for {what}); keep one")
    name = present[0]
    if name in used:
        problems.mismatch.append(f"{_where(tensors[name])} is used twice (internal name-table error)")
    used.add(name)
    return tensors[name]


def _check(info: TensorInfo, shapes, dtypes, what: str, problems: _Problems) -> bool:
    if tuple(info.shape) in [tuple(s) for s in shapes] and info.dtype in dtypes:
        return True
    quant = " (a quantised tensor where a float one is expected)" if info.dtype == "U8" and "U8" not in dtypes else ""
    problems.mismatch.append(f"{_where(info)}: expected shape {_fmt_shapes(shapes)} dtype {'|'.join(dtypes)}, got "
                             f"shape {list(info.shape)} dtype {info.dtype}{quant} (for parameter {what}, from config.json)")
    return False


def make_plan(
    cfg: ModelConfig,
    tensors: Mapping[str, TensorInfo],
    *,
    root="checkpoint",
    dtype=None,
    expert_weights: str | None = None,
    no_indexer: bool = False,
    init_missing_indexer: bool = False,
    vision: bool = True,
    abstract: dict | None = None,
) -> Plan:
    """Check `tensors` against `cfg` and plan every stored leaf (headers only, no data read).

    dtype: stored dtype of the non-expert float weights (None keeps each tensor's own dtype;
    the model's float32 parameters stay float32). expert_weights: "mxfp4" keeps routed
    experts packed, "bf16" decodes them; None follows the checkpoint (packed if stored packed).
    vision: keep `vision_tower.*` / `mm_projector.*` (False drops them).
    """
    with no_gc():
        return _make_plan(cfg, tensors, root=root, dtype=dtype, expert_weights=expert_weights, no_indexer=no_indexer,
                          init_missing_indexer=init_missing_indexer, vision=vision, abstract=abstract)


def _make_plan(cfg, tensors, *, root, dtype, expert_weights, no_indexer, init_missing_indexer, vision,
               abstract) -> Plan:

    problems = _Problems()
    names = set(tensors)
    pre, _ = detect_prefix(names)
    cfg, dropped, init_indexer = _indexer_guard(cfg, names, tensors, no_indexer, init_missing_indexer, problems)
    experts_packed = any(n.endswith(".weight_packed") for n in names)
    if expert_weights is None:
        expert_weights = "mxfp4" if experts_packed else "bf16"
    if cfg.moe_layers and cfg.expert_weights != expert_weights:
        cfg = cfg.replace(expert_weights=expert_weights)
    _count_checks(cfg, names, tensors, pre, problems)
    if abstract is None:
        abstract = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
    store_dtype = None if dtype is None else stored_float_dtype(dtype)
    entries: list[Entry] = []
    used: set[str] = set()
    sources = param_sources(cfg, names)
    vis = [n for n in names if n.startswith(VISION_PREFIXES)]
    if vision:
        sources += vision_sources(vis)
    else:
        dropped |= set(vis)
    for src in sources:
        if src.transform == "raw":
            info = tensors[src.names[0]]
            used.add(info.name)
            entries.append(Entry(src.path, src, None, info.shape, SAFETENSORS_DTYPES.get(info.dtype, np.dtype(np.uint8)),
                                 (info,), "tensor", "vision"))
            continue
        try:
            leaf = get_path(abstract, src.path)
        except KeyError:
            raise CheckpointError(f"internal: no parameter {'/'.join(src.path)} for this config") from None
        group = "globals" if src.layer is None else layer_key(src.layer)
        key = src.path if src.layer is None else ("layers", group) + src.path
        slot = "" if src.slot is None else f"[{src.slot}]"
        what = "/".join(src.path) + slot
        if src.transform == "experts":
            entries += _plan_experts(src, leaf, key, group, tensors, used, problems, what)
            continue
        shape = tuple(leaf.shape[1:] if src.slot is not None else leaf.shape)
        if init_indexer and src.path[:2] == ("mla", "indexer"):
            entries.append(Entry(key, src, None, shape, store_dtype or np.dtype(leaf.dtype), (), "init", group))
            continue
        info = _resolve(src, tensors, used, problems, what)
        if info is None or not _check(info, expected_shapes(src, shape, cfg), expected_dtypes(src), what, problems):
            continue
        if src.path in F32_PARAMS:
            stored = np.dtype(np.float32)
        else:
            stored = store_dtype or SAFETENSORS_DTYPES[info.dtype]
        entries.append(Entry(key, src, None, shape, stored, (info,), "tensor", group))
    unused = sorted(names - used - dropped)
    for n in unused:
        hint = ""
        if INDEXER_RE.search(n):
            hint = " (an indexer tensor with an unexpected name: only wq_b, wk, k_norm, weights_proj are specified)"
        elif _EXPERT_NUM_RE.search(n):
            hint = " (a routed-expert tensor this config or --expert-weights does not use)"
        problems.unknown.append(f"{_where(tensors[n])}{hint}")
    if problems:
        problems.raise_(root)
    _check_coverage(entries, abstract, cfg)
    options = dict(dtype=None if store_dtype is None else str(store_dtype), expert_weights=cfg.expert_weights,
                   no_indexer=no_indexer, init_missing_indexer=init_indexer, vision=vision)
    return Plan(cfg, entries, sorted(dropped), options)


def _check_coverage(entries: list[Entry], abstract: dict, cfg: ModelConfig) -> None:
    """Every parameter leaf (every slot of a stacked one) is filled by exactly one entry."""
    filled: dict[tuple, list] = {}
    for e in entries:
        if e.source.transform != "raw":
            filled.setdefault(e.source.path + ((e.part,) if e.part else ()), []).append(e.source.slot)
    bad = []
    for kp, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        path = tuple(str(getattr(k, "key", k)) for k in kp)
        want = [None] if path[0] not in ("norms", "kda", "mla", "dense", "moe") else list(range(leaf.shape[0]))
        if sorted(filled.pop(path, []), key=lambda s: -1 if s is None else s) != want:
            bad.append("/".join(path))
    if bad or filled:
        raise CheckpointError(f"internal: parameters not filled exactly once: {bad[:8]}; unknown: {list(filled)[:8]}")


def _plan_experts(src, leaf, key, group, tensors, used, problems, what) -> list[Entry]:
    packed_target = isinstance(leaf, dict)
    e = len(src.names)
    if packed_target:
        out: list[Entry] = []
        for part, suffix in (("packed", ".weight_packed"), ("scale", ".weight_scale")):
            shape = tuple(leaf[part].shape[1:])
            infos = []
            for p in src.names:
                name = p + suffix
                if name not in tensors:
                    if p + ".weight" in tensors:
                        info = tensors[p + ".weight"]
                        if part == "packed":
                            problems.mismatch.append(
                                f"{_where(info)}: a float expert where MXFP4 weight_packed/weight_scale are expected "
                                f"(for {what}); convert with --expert-weights bf16 (expert_weights='bf16')")
                            used.add(info.name)
                    else:
                        problems.missing.append(f"{name!r} (for parameter {what})")
                    continue
                info = tensors[name]
                used.add(name)
                if _check(info, [shape[1:]], ("U8",), f"{what} {part}", problems):
                    infos.append(info)
            if len(infos) == e:
                out.append(Entry(key + (part,), src, part, shape, np.dtype(np.uint8), tuple(infos), "stack", group))
        return out
    shape = tuple(leaf.shape[1:])
    o, i = shape[1:]
    first = src.names[0]
    if first + ".weight_packed" in tensors or first + ".weight_scale" in tensors:  # decode MXFP4
        infos = []
        for p in src.names:
            pair = []
            for suffix, want in ((".weight_packed", (o, i // 2)), (".weight_scale", (o, i // 32))):
                name = p + suffix
                if name not in tensors:
                    problems.missing.append(f"{name!r} (for parameter {what})")
                    continue
                used.add(name)
                if _check(tensors[name], [want], ("U8",), what, problems):
                    pair.append(tensors[name])
            infos += pair
        if len(infos) == 2 * e:
            return [Entry(key, src, None, shape, np.dtype(ml_dtypes.bfloat16), tuple(infos), "dequant", group)]
        return []
    infos = []
    for p in src.names:
        name = p + ".weight"
        if name not in tensors:
            problems.missing.append(f"{name!r} (for parameter {what})")
            continue
        used.add(name)
        if _check(tensors[name], [(o, i)], FLOAT_DTYPES, what, problems):
            infos.append(tensors[name])
    if len(infos) == e and len({t.dtype for t in infos}) == 1:
        return [Entry(key, src, None, shape, SAFETENSORS_DTYPES[infos[0].dtype], tuple(infos), "stack", group)]
    if len(infos) == e:
        problems.mismatch.append(f"{what}: experts mix dtypes {sorted({t.dtype for t in infos})}")
    return []


