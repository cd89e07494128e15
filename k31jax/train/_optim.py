"""Optimizers for fine-tuning: AdamW or Muon(+AdamW), trainable subsets, decay masks.

Every decision is made per parameter from its path and its logical axis names (the
`out_sharding` metadata every k31jax `nnx.Param` carries), so pass the Variable-bearing
state, `nnx.state(model, nnx.Param)` (or its `nnx.eval_shape` twin), to the functions here.
The returned transformation then works on that state, on its pure-array twin
(`nnx.as_pure`, what `nnx.Optimizer.update` passes) and on `nnx.to_pure_dict` trees alike:
leaves are looked up by their path names.

- Stacked layers carry a leading "layers" axis and routed experts an "expert" axis: both
  are batch axes. A leaf's *logical* rank is its rank without the "layers" axes, so a
  per-layer norm `[L, D]` is a vector and a projection `[L, D, F]` a matrix.
- Weight decay (decoupled, scaled by the learning rate as in `optax.adamw`) applies to
  logical matrices and larger only: never to norms, `gate_bias`, `dt_bias`, `a_log`, the
  indexer's LayerNorm, AttnRes `*_res_norm` / `*_res_proj`, or any other vector.
- Muon (`optax.contrib.muon`) takes the logical matrices except the embedding and the
  head (axis "vocab", AdamW as in Moonlight / Kimi K2: they are lookups / classifiers, not
  linear maps between hidden spaces) and the short-conv taps (axis "conv", a depthwise
  filter). Orthogonalisation runs per matrix: `MuonDimensionNumbers` names the trailing
  two axes, so "layers" / "expert" are vmapped batch axes. Routed experts are stored
  `[E, out, in]` (contraction axis last), everything else `[in, out]`.
  `muon_consistent_rms=0.2` scales Muon updates to AdamW's RMS (Liu et al. 2025), so one
  learning rate and weight decay serve both groups.
- `gate_bias` (the router's selection bias) is never trained by gradient
  (architecture.md §7): it is always frozen here and set by `k31jax.train` balancing.
- Frozen leaves go to `optax.set_to_zero()` inside `optax.multi_transform`: zero updates and
  no optimizer state (no Adam moments, no Muon momentum). Their gradients are zeroed before
  the global-norm clip, so the clip sees only what is trained.
- MXFP4-packed experts (`PackedExperts`, uint8 `packed` / `scale`) are never trainable: QAT
  trains float master weights (`k31jax.nn.dequantize_experts` first); asking for a
  trainable set that includes them raises.

The Muon group uses optax's own `muon` on that group alone; optax's built-in Adam side is
not used because it cannot mask weight decay (norms and biases must not decay), so the
AdamW groups are plain `optax.adamw` partitions.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

# the training memory planner, a layer below, counts the same choices: one definition, there
from ..distributed import OPTIMIZERS, TRAINABLE_SETS, is_trained

# optimizer labels; a leaf's label decides its transformation (and its state)
MUON, ADAMW, ADAMW_NO_DECAY, FROZEN = "muon", "adamw", "adamw_no_decay", "frozen"

_BATCH_AXES = ("layers", "expert")
_ROUTER_BIAS = re.compile(r"(.*/)?gate_bias")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer settings.

    The learning rate warms up linearly from 0 over `warmup_steps`, then follows a cosine to
    `learning_rate * min_lr_ratio` at `total_steps` (optimizer updates). `clip_norm` (None:
    off) clips the global gradient norm of the trainable leaves. Gradient accumulation is the
    training step's (`TrainConfig.grad_accum`): it sums micro-batch gradients of one loss
    normalised by the whole step's tokens, which equals the large batch exactly.
    """

    optimizer: str = "adamw"
    learning_rate: float = 1e-5
    warmup_steps: int = 100
    total_steps: int = 10_000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0
    trainable: str = "all"
    muon_beta: float = 0.95
    muon_ns_steps: int = 5
    muon_consistent_rms: float | None = 0.2

    def __post_init__(self):
        problems = []
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer={self.optimizer!r}: expected one of {OPTIMIZERS}")
        if self.trainable not in TRAINABLE_SETS:
            problems.append(f"trainable={self.trainable!r}: expected one of {TRAINABLE_SETS}")
        if not self.learning_rate > 0:
            problems.append(f"learning_rate={self.learning_rate}: must be > 0")
        if not 0 <= self.warmup_steps < self.total_steps:
            problems.append(f"warmup_steps={self.warmup_steps}, total_steps={self.total_steps}: "
                            "need 0 <= warmup_steps < total_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.weight_decay < 0:
            problems.append(f"weight_decay={self.weight_decay}: must be >= 0")
        if self.clip_norm is not None and not self.clip_norm > 0:
            problems.append(f"clip_norm={self.clip_norm}: must be > 0 or None")
        if not (isinstance(self.muon_ns_steps, int) and self.muon_ns_steps >= 1):
            problems.append(f"muon_ns_steps={self.muon_ns_steps!r}: must be an int >= 1")
        if problems:
            raise ValueError("OptimConfig: " + "; ".join(problems))


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0, then cosine decay to `learning_rate * min_lr_ratio`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)


# ----------------------------------------------------------------------------- leaf table


@dataclasses.dataclass(frozen=True)
class _Leaf:
    path: str
    axes: tuple[str | None, ...]
    shape: tuple[int, ...]
    is_float: bool

    @property
    def logical_rank(self) -> int:
        """Rank without the stacking ("layers") axes: [L, D] is a vector."""
        return len(self.shape) - self.axes.count("layers")

    @property
    def muon_dims(self) -> optax.contrib.MuonDimensionNumbers | None:
        """Per-matrix Muon axes, or None for leaves that belong to AdamW."""
        if not self.is_float or self.logical_rank < 2 or {"vocab", "conv"} & set(self.axes):
            return None
        n = len(self.shape)
        batch = sum(a in _BATCH_AXES for a in self.axes)
        if n - batch != 2 or any(a not in _BATCH_AXES for a in self.axes[:batch]):
            return None  # not "batch axes, then one matrix": leave it to AdamW
        if "expert" in self.axes:  # routed experts [.., E, out, in]: contract the last axis
            return optax.contrib.MuonDimensionNumbers(reduction_axis=n - 1, output_axis=n - 2)
        return optax.contrib.MuonDimensionNumbers(reduction_axis=n - 2, output_axis=n - 1)


def _path_name(key_path) -> str:
    return jax.tree_util.keystr(key_path, simple=True, separator="/")


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def map_by_path(fn, tree) -> Any:
    """`fn(path_name, leaf)` over a parameter tree, where a whole `nnx.Variable` counts as one
    leaf, so an `nnx.State` of Variables and its pure twin give the same path names
    ("moe/w_gate", "mla/indexer/wk"): the result is a prefix of either tree."""
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(_path_name(p), x), tree, is_leaf=_is_variable)


def _leaf_table(params_state) -> dict[str, _Leaf]:
    table = {}
    for path, var in nnx.to_flat_state(params_state):
        name = "/".join(str(p) for p in path)
        axes = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if axes is None or len(axes) != len(value.shape):
            raise ValueError(
                f"parameter {name!r} (shape {tuple(value.shape)}): expected an nnx.Variable with "
                f"`out_sharding` axis names, one per dim, got {axes!r}; pass nnx.state(model, nnx.Param)")
        table[name] = _Leaf(name, tuple(axes), tuple(value.shape), bool(jnp.issubdtype(value.dtype, jnp.floating)))
    return table


def _lookup(table: dict[str, _Leaf], path: str) -> _Leaf:
    try:
        return table[path]
    except KeyError:
        raise KeyError(f"parameter {path!r} is not in the state the optimizer was built from") from None


# ----------------------------------------------------------------------------- masks / labels


def decay_mask(params_state) -> Any:
    """True where decoupled weight decay applies: leaves of logical rank >= 2 (matrices,
    stacked expert tensors). False for every (per-layer) vector: norms, biases, gate vectors,
    AttnRes vectors. A prefix of `params_state` (one bool per Variable)."""
    table = _leaf_table(params_state)
    return map_by_path(lambda p, _: _decays(_lookup(table, p)), params_state)


def _decays(leaf: _Leaf) -> bool:
    return leaf.is_float and leaf.logical_rank >= 2


def _label(leaf: _Leaf, trainable: str, optimizer: str) -> str:
    if (not leaf.is_float or _ROUTER_BIAS.fullmatch(leaf.path)
            or not is_trained(trainable, leaf.path)):
        return FROZEN
    if optimizer == "muon" and leaf.muon_dims is not None:
        return MUON
    return ADAMW if _decays(leaf) else ADAMW_NO_DECAY


def _check_trainable(table: dict[str, _Leaf], trainable: str) -> None:
    packed = [leaf.path for leaf in table.values() if not leaf.is_float and is_trained(trainable, leaf.path)]
    if packed:
        raise ValueError(
            f"trainable={trainable!r} includes non-float (MXFP4-packed) parameters {packed}: QAT trains "
            "float master weights; dequantise the experts first (k31jax.nn.dequantize_experts)")


def param_labels(params_state, trainable: str = "all", optimizer: str = "adamw") -> Any:
    """Each parameter's optimizer label: "muon", "adamw", "adamw_no_decay" or "frozen".

    trainable: "all" (everything but `gate_bias`), "experts" (routed expert weights
    `moe/w_gate|w_up|w_down`), "indexer" (`mla/indexer/*`), "no_embed" (all but `embed` and
    `lm_head`). A prefix of `params_state` (one label per Variable).
    """
    if trainable not in TRAINABLE_SETS:
        raise ValueError(f"trainable={trainable!r}: expected one of {TRAINABLE_SETS}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: expected one of {OPTIMIZERS}")
    table = _leaf_table(params_state)
    _check_trainable(table, trainable)
    return map_by_path(lambda p, _: _label(_lookup(table, p), trainable, optimizer), params_state)


# ----------------------------------------------------------------------------- optimizer


# The jitted steps take the optimizer as a static argument, hashed by identity: handing out one
# object per (settings, parameter layout) lets a second Trainer in the process (a resume, a
# notebook's next run) reuse the compiled step instead of compiling it again.
_OPTIMIZERS: dict[tuple, optax.GradientTransformation] = {}
_OPTIMIZERS_KEPT = 16


def make_optimizer(cfg: OptimConfig, params_state) -> optax.GradientTransformation:
    """The optax transformation for `cfg` over parameters shaped like `params_state`
    (`nnx.state(model, nnx.Param)`): zero frozen gradients -> clip -> per-label update. The
    same object for the same settings and parameter layout."""
    layout = tuple((jax.tree_util.keystr(path), tuple(leaf.shape), str(leaf.dtype))
                   for path, leaf in jax.tree_util.tree_flatten_with_path(params_state)[0])
    key = (cfg, layout)
    if key not in _OPTIMIZERS:
        while len(_OPTIMIZERS) >= _OPTIMIZERS_KEPT:
            del _OPTIMIZERS[next(iter(_OPTIMIZERS))]
        _OPTIMIZERS[key] = _build_optimizer(cfg, params_state)
    return _OPTIMIZERS[key]


@functools.lru_cache(maxsize=_OPTIMIZERS_KEPT)
def make_lora_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """AdamW (after the clip) over LoRA adapters, every one trained; one object per settings."""
    return optax.chain(*([optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm else []),
                       optax.adamw(learning_rate_schedule(cfg), cfg.b1, cfg.b2, cfg.eps,
                                   weight_decay=cfg.weight_decay))


def _build_optimizer(cfg: OptimConfig, params_state) -> optax.GradientTransformation:
    table = _leaf_table(params_state)
    _check_trainable(table, cfg.trainable)
    label_of = {p: _label(leaf, cfg.trainable, cfg.optimizer) for p, leaf in table.items()}

    def labels(tree):
        return map_by_path(lambda p, _: label_of[_lookup(table, p).path], tree)

    def trained(tree):  # the clip must only see the gradients that are trained
        return map_by_path(lambda p, label: "frozen" if label == FROZEN else "trained", labels(tree))

    def muon_dims(tree):
        return map_by_path(lambda p, _: _lookup(table, p).muon_dims, tree)

    schedule = learning_rate_schedule(cfg)
    adamw = dict(learning_rate=schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    transforms = {
        ADAMW: optax.adamw(weight_decay=cfg.weight_decay, **adamw),
        ADAMW_NO_DECAY: optax.adamw(weight_decay=0.0, **adamw),
        FROZEN: optax.set_to_zero(),
    }
    if cfg.optimizer == "muon":
        transforms[MUON] = optax.contrib.muon(
            learning_rate=schedule, ns_steps=cfg.muon_ns_steps, beta=cfg.muon_beta, eps=cfg.eps,
            weight_decay=cfg.weight_decay, muon_weight_dimension_numbers=muon_dims,
            consistent_rms=cfg.muon_consistent_rms)
    steps = [optax.multi_transform({"trained": optax.identity(), "frozen": optax.set_to_zero()}, trained)]
    if cfg.clip_norm is not None:
        steps.append(optax.clip_by_global_norm(cfg.clip_norm))
    steps.append(optax.multi_transform(transforms, labels))
    return optax.chain(*steps)
