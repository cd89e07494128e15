"""One frozen description of a training run (`TrainConfig`), saved with every run."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ..distributed import MASTER_DTYPES  # the training memory planner's, checked the same way
from ..nn import REMAT_POLICIES
from ._data import DataConfig
from ._optim import OptimConfig

DISTILL_STAGES = ("dense", "sparse")  # indexer distillation (k31jax.train._distill.STAGES)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run.

    model: a preset name or a `config.json` path, for a model built from random weights;
      `init` (a converted Orbax checkpoint, a release safetensors folder or an earlier run's
      `out`) starts from trained weights instead, and its config wins.
    dtype: the master weights' (and the compute) dtype, "float32" or "bfloat16".
    qat: routed experts fake-quantised to MXFP4 in the forward pass (straight-through
      gradient); `mxfp8_activations` also rounds the expert GEMM inputs to MXFP8.
    grad_accum: micro-batches per optimizer step, summed in one jitted step, so the update
      equals one step on their union (the loss is the mean over all trained tokens).
    remat: per-layer rematerialisation ("none", "full", "dots").
    vocab_chunk / z_loss: the streamed cross entropy (`chunked_cross_entropy`).
    bias_update_rate: DeepSeek-V3 sign update of the router's selection bias per step
      (0: off); `balance_loss`: weight of the sequence-level balance loss (0: off).
    lora_rank: > 0 trains LoRA adapters on the attention and shared-expert projections and
      freezes the base weights (the router's selection bias too: `bias_update_rate` does not
      apply), merged at export; packed MXFP4 routed experts stay packed.
      `lora_experts` adapts the routed experts too (beside packed ones, unmerged).
    save_every / keep: Orbax checkpoints every N steps (asynchronous), the newest K kept.
    eval_every / eval_batches: held-out loss every N steps (0: only at the end).
    mesh / rules: train under this mesh (`"data=2,fsdp=4"`) and rule table.
    index_topk: the indexer's top-k for this run and its export (None: the model's own); a
      value >= `data.seq_len` trains dense gated MLA (DeepSeek-V3.2's order: dense first,
      then `distill_indexer`, then sparse).
    distill_indexer: None (language-model training), or indexer distillation
      (`k31jax.train._distill`): "dense" (the warm-up: attention with the indexer off, only
      the indexer trains, `optim.trainable="indexer"`) or "sparse" (attention on the model's
      top-k selection; the indexer trains by the KL over it, other trainable weights by the
      LM loss).
    """

    out: str
    data: DataConfig
    optim: OptimConfig
    steps: int
    model: str = "tiny"
    init: str | None = None
    tokenizer: str | None = None
    dtype: str = "float32"
    qat: bool = False
    mxfp8_activations: bool = False
    grad_accum: int = 1
    remat: str = "none"
    vocab_chunk: int = 4096
    z_loss: float = 0.0
    bias_update_rate: float = 1e-3
    balance_loss: float = 0.0
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_experts: bool = False
    save_every: int = 100
    keep: int = 3
    log_every: int = 1
    eval_every: int = 0
    eval_batches: int = 16
    mesh: str | None = None
    rules: str | None = None
    seed: int = 0
    distill_indexer: str | None = None
    index_topk: int | None = None

    def __post_init__(self):
        problems = []
        if self.steps < 1:
            problems.append(f"steps={self.steps}: must be >= 1")
        if self.dtype not in MASTER_DTYPES:
            problems.append(f"dtype={self.dtype!r}: expected one of {MASTER_DTYPES}")
        if self.remat not in REMAT_POLICIES:
            problems.append(f"remat={self.remat!r}: expected one of {REMAT_POLICIES}")
        if self.index_topk is not None and self.index_topk < 1:
            problems.append(f"index_topk={self.index_topk}: must be >= 1")
        if self.grad_accum < 1:
            problems.append(f"grad_accum={self.grad_accum}: must be >= 1")
        for name in ("vocab_chunk", "save_every", "keep", "log_every", "eval_batches"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("z_loss", "bias_update_rate", "balance_loss", "eval_every", "lora_rank"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)}: must be >= 0")
        if self.lora_experts and not self.lora_rank:
            problems.append("lora_experts=True with lora_rank=0: adapters need a rank")
        if self.lora_rank and self.optim.trainable != "all":
            problems.append(f"lora_rank={self.lora_rank} with trainable={self.optim.trainable!r}: LoRA trains "
                            "only its adapters")
        if self.distill_indexer is not None:
            if self.distill_indexer not in DISTILL_STAGES:
                problems.append(f"distill_indexer={self.distill_indexer!r}: expected None or one of {DISTILL_STAGES}")
            elif self.distill_indexer == "dense" and self.optim.trainable != "indexer":
                problems.append(f"distill_indexer='dense' with trainable={self.optim.trainable!r}: the dense warm-up "
                                "trains only the indexer (trainable='indexer')")
            if self.lora_rank:
                problems.append(f"distill_indexer with lora_rank={self.lora_rank}: distillation trains the indexer "
                                "itself, not LoRA adapters")
        if problems:
            raise ValueError("TrainConfig: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "TrainConfig":
        raw = dict(raw)
        raw["data"] = DataConfig(**{**raw["data"], "paths": tuple(raw["data"]["paths"])})
        raw["optim"] = OptimConfig(**raw["optim"])
        return cls(**raw)

    def save(self, path: str | os.PathLike) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=2)
        os.replace(tmp, path)
