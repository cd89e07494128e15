"""Parameter counts and byte sizes, computed on paper with `nnx.eval_shape` (no allocation).

Counts are of logical weights (architecture.md §13): an MXFP4 matrix counts `out × in`, its
scales are not counted, and `A_log` counts its stored length.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ._model import abstract_model

# Components in the order of the spec's table (architecture.md §13).
COMPONENTS = (
    "kda_mixer", "mla_mixer", "indexer", "layer_norms", "dense_mlp", "moe_non_expert",
    "routed_experts", "embed_head",
)
_LABELS = {
    "kda_mixer": "KDA mixer", "mla_mixer": "MLA mixer", "indexer": "indexer (K3.1 DSA)",
    "layer_norms": "per-layer norms + AttnRes vectors", "dense_mlp": "dense MLP",
    "moe_non_expert": "MoE non-expert (router, bias, latent, shared)",
    "routed_experts": "routed experts", "embed_head": "embed + lm_head + final norm (+ AttnRes)",
}
_ROUTED = ("w_gate", "w_up", "w_down")
_PACKED_BITS = 4.25  # E2M1 codes + one E8M0 byte per 32


def _component(path: tuple[str, ...]) -> str:
    head = path[0]
    if head == "kda":
        return "kda_mixer"
    if head == "mla":
        return "indexer" if "indexer" in path else "mla_mixer"
    if head == "norms":
        return "layer_norms"
    if head == "dense":
        return "dense_mlp"
    if head == "moe":
        return "routed_experts" if path[1] in _ROUTED else "moe_non_expert"
    return "embed_head"


def _logical_size(path, leaf) -> int:
    """Elements of the logical weight; a packed MXFP4 leaf holds two weights per byte."""
    if path[-1] == "packed":
        return int(np.prod(leaf.shape)) * 2
    if path[-1] == "scale":
        return 0
    return int(np.prod(leaf.shape))


@dataclasses.dataclass(frozen=True)
class ParamCount:
    config: ModelConfig
    by_component: dict[str, int]
    units: dict[str, int]
    f32_params: int

    @property
    def total(self) -> int:
        return sum(self.by_component.values())

    @property
    def embedding(self) -> int:
        return self.config.vocab_size * self.config.hidden_size

    @property
    def active(self) -> int:
        """Params used per token: all non-expert weights plus top-k of each layer's experts."""
        c = self.config
        experts = self.by_component["routed_experts"]
        active_experts = experts * c.num_experts_per_token // c.num_experts if c.num_experts else 0
        return self.total - experts + active_experts

    @property
    def active_excluding_embedding(self) -> int:
        return self.active - self.embedding

    def bytes(self, expert_bits: float = _PACKED_BITS, rest_bytes: int = 2) -> int:
        """Storage bytes: routed experts at `expert_bits` per weight, f32 leaves at 4 bytes,
        everything else at `rest_bytes` (bf16 by default)."""
        experts = self.by_component["routed_experts"]
        rest = self.total - experts - self.f32_params
        return int(experts * expert_bits / 8) + rest * rest_bytes + self.f32_params * 4

    def table(self) -> str:
        rows = [("component", "per unit", "units", "params")]
        for name in COMPONENTS:
            n = self.by_component[name]
            if n == 0:
                continue
            u = self.units[name]
            rows.append((_LABELS[name], f"{n // u:,}" if u > 1 else "—", f"{u}", f"{n:,}"))
        rows.append(("text model total", "", "", f"{self.total:,}"))
        rows.append(("active per token (excl. embedding)", "", "", f"{self.active_excluding_embedding:,}"))
        gb = 1e9
        rows.append(("bytes, MXFP4 experts + bf16 rest", "", "", f"{self.bytes():,} ({self.bytes() / gb:,.1f} GB)"))
        rows.append(("bytes, all bf16", "", "", f"{self.bytes(16):,} ({self.bytes(16) / gb:,.1f} GB)"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for j, r in enumerate(rows):
            lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]))
            if j == 0:
                lines.append("-" * len(lines[0]))
        return "\n".join(lines)


def count_params(config: ModelConfig) -> ParamCount:
    """Exact parameter counts of the text model, per component, from the abstract model."""
    state = nnx.to_pure_dict(nnx.state(abstract_model(config), nnx.Param))
    by = dict.fromkeys(COMPONENTS, 0)
    f32 = 0
    for kp, leaf in jax.tree_util.tree_leaves_with_path(state):
        path = tuple(str(getattr(k, "key", k)) for k in kp)
        n = _logical_size(path, leaf)
        by[_component(path)] += n
        if leaf.dtype == np.float32 and config.dtype != "float32":
            f32 += n
    units = dict(
        kda_mixer=len(config.kda_layers), mla_mixer=len(config.mla_layers),
        indexer=len(config.mla_layers), layer_norms=config.num_hidden_layers,
        dense_mlp=len(config.dense_layers), moe_non_expert=len(config.moe_layers),
        routed_experts=len(config.moe_layers), embed_head=1,
    )
    return ParamCount(config, by, {k: max(v, 1) for k, v in units.items()}, f32)
