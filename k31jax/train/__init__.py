"""QAT fine-tuning: data (packed rows, assistant-only chat loss), the streamed cross entropy,
AdamW / Muon with trainable subsets and LoRA, MoE load balancing, sharded jitted steps, Orbax
checkpoints with bit-exact resume, metrics, held-out bits per byte and the MXFP4 export; and
DeepSeek-V3.2-style indexer distillation with its top-k recall (`TrainConfig.distill_indexer`,
`indexer_recall`).

    cfg = TrainConfig(out="runs/a", data=DataConfig(paths=("corpus/",), seq_len=256, batch_size=8),
                      optim=OptimConfig(learning_rate=3e-4, warmup_steps=20, total_steps=200), steps=200,
                      qat=True)
    result = train(cfg)                     # or: k31jax train --config tiny --data corpus/ --out runs/a ...

The step itself, for code that drives it (benchmarks): `split_for_training(state, optim)` ->
(frozen rest, trained leaves, optimizer), `train_step(graphdef, tx, StepSettings(...), ...)`;
`StepProgram(train_step)` runs it as `Trainer` does (the donated state laid out by the
compiler on a TPU).
A run folder holds `RUN_FILE`; a run stopped by SIGTERM exits with `SIGTERM_EXIT`.
"""

from ._balance import BiasUpdateRule, SignBiasUpdate, expert_load, load_metrics, sequence_balance_loss
from ._config import DISTILL_STAGES, MASTER_DTYPES, TrainConfig
from ._data import (DataConfig, HoldoutSplit, ShardedIterator, ShardedStream, heldout_bytes, holdout_split, load_documents,
                    make_dataset)
from ._domains import DomainSplit, embedded_heldout_domain, language_reference_domain
from ._distill import RecallResult, indexer_distill_terms, indexer_kl, indexer_recall, topk_recall, with_index_topk
from ._lora import (DEFAULT_LORA_TARGETS, EXPERT_LORA_TARGET, LoraState, apply_lora, init_lora, load_adapter,
                    routed_expert_digest, save_adapter, with_adapter)
from ._loss import bits_per_byte, chunked_cross_entropy, full_cross_entropy
from ._metrics import plot_metrics, read_metrics
from ._optim import OPTIMIZERS, TRAINABLE_SETS, OptimConfig, decay_mask, make_optimizer, param_labels
from ._programs import StepProgram
from ._runs import eval_split, load_generation_model, training_files
from ._steps import StepSettings, train_step
from ._trainer import (RUN_FILE, SIGTERM_EXIT, EvalResult, Trainer, TrainResult, abstract_train_step, evaluate, load_any,
                       load_run, split_for_training, train, with_config)

__all__ = [
    "DISTILL_STAGES", "MASTER_DTYPES", "OPTIMIZERS", "RUN_FILE", "SIGTERM_EXIT", "TRAINABLE_SETS", "StepProgram", "StepSettings",
    "split_for_training", "train_step", "with_config",
    "BiasUpdateRule", "DEFAULT_LORA_TARGETS", "EXPERT_LORA_TARGET", "load_adapter", "routed_expert_digest", "save_adapter", "with_adapter", "DomainSplit", "embedded_heldout_domain", "language_reference_domain", "abstract_train_step", "DataConfig", "EvalResult", "HoldoutSplit", "LoraState", "OptimConfig",
    "RecallResult", "ShardedIterator", "ShardedStream", "SignBiasUpdate", "TrainConfig", "TrainResult", "Trainer", "apply_lora", "bits_per_byte",
    "chunked_cross_entropy", "decay_mask", "eval_split", "evaluate", "expert_load", "full_cross_entropy",
    "heldout_bytes", "holdout_split", "indexer_distill_terms", "indexer_kl", "indexer_recall", "init_lora",
    "load_any", "load_documents", "load_generation_model", "load_metrics", "load_run", "make_dataset",
    "make_optimizer", "param_labels", "plot_metrics", "read_metrics", "sequence_balance_loss", "topk_recall",
    "train", "training_files", "with_index_topk",
]
