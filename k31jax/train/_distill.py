"""Indexer distillation (DeepSeek-V3.2's two indexer stages, attention.md §5) and top-k recall.

For every MLA layer with an indexer and every query t of a packed row, the candidates A_t are
the keys s <= t of t's own document (a padding query has none and counts nowhere). On a
candidate set C_t:

- target   p_t = Σ_h softmax_{s∈C_t}(logit_{t,s,h}) / H: the layer's attention summed over its
  heads and L1-normalised (each head's row sums to 1, so that is the mean over heads), held
  constant (`stop_gradient`);
- indexer  q_t = softmax_{s∈C_t}(I_{t,s}) of the indexer's scores;
- KL_t = Σ_{s∈C_t} p_{t,s} (log p_{t,s} − log q_{t,s}) in nats.

Stages (`TrainConfig.distill_indexer`):
- "dense", the warm-up: attention runs with the indexer off (full causal attention) and
  C_t = A_t; only the indexer trains.
- "sparse": attention runs with the layer's own top-k selection S_t (the model's
  `index_topk`) and C_t = S_t. The indexer trains by the KL; any other trainable weight by the
  LM loss alone (the layer inputs reach the KL under `stop_gradient`, and the selection is
  discrete, so no gradient crosses between the two).

The distillation loss is the MEAN over the indexed layers of the mean KL over the step's real
queries (nats per query per layer: the same scale for a model of any depth).

Top-k recall at k: per query, the dense target's mass on the k candidates the indexer ranks
highest, `Σ_{s∈TopK_k(I_t)} p_{t,s}` over A_t. A query with n_t = |A_t| <= k selects all its
candidates (recall exactly 1) and is left out of the mean: `recall` averages the queries with
n_t > k over every layer (each layer has the same queries), `counted` says how many there are.
The ceiling is the same average of the target's mass on its own k largest entries: the recall
of a perfect ranking, which a diffuse attention keeps well below 1.

Memory: queries are scored `query_chunk` at a time (a rematerialised scan), so the largest
temporary is one chunk's `[B, H, chunk, S]` logits, not `[B, H, T, S]`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.scipy.special import xlogy
from jaxtyping import Array, Bool, Float

from ..chat import TokenizerBase
from ..nn import K31ForCausalLM, reconfigure
from ..ops import Backends, indexer_scores, mla_attention_logits, rms_norm, selection_mask
from ._config import DISTILL_STAGES, TrainConfig
from ._data import DataConfig, make_dataset
from ._loss import chunked_cross_entropy
from ._steps import overlay

QUERY_CHUNK = 256
_NEG = float(jnp.finfo(jnp.float32).min)  # a finite "minus infinity": masked rows stay NaN-free
_F32 = jnp.float32


# ---------------------------------------------------------------------------- per-query terms
def indexer_kl(
    scores: Float[Array, "... T S"], target: Float[Array, "... T S"], allowed: Bool[Array, "... T S"]
) -> Float[Array, "... T"]:
    """Per query `KL(target ‖ softmax(scores over allowed))` in nats (fp32).

    target: a distribution over the allowed keys of each row (held constant: no gradient);
    keys outside `allowed` contribute nothing. A row with no allowed key gives 0. The gradient
    in `scores` is `softmax − target` on the allowed keys.
    """
    p = jnp.where(allowed, jax.lax.stop_gradient(target).astype(_F32), 0.0)
    log_q = jax.nn.log_softmax(jnp.where(allowed, scores.astype(_F32), _NEG), axis=-1)
    return jnp.sum(xlogy(p, p) - jnp.where(allowed, p * log_q, 0.0), axis=-1)


def topk_recall(
    scores: Float[Array, "... T S"], target: Float[Array, "... T S"], allowed: Bool[Array, "... T S"], top_k: int
) -> tuple[Float[Array, "... T"], Bool[Array, "... T"]]:
    """Per query: (`target`'s mass on the top-min(top_k, n_t) allowed keys by `scores`, whether
    n_t > top_k), n_t being the row's allowed keys. Ties go to the lower key index, as in the
    model's selection (`lax.top_k`)."""
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"topk_recall: top_k must be a positive int, got {top_k!r}")
    vals, idx = jax.lax.top_k(jnp.where(allowed, scores.astype(_F32), -jnp.inf), min(top_k, scores.shape[-1]))
    mass = jnp.take_along_axis(target.astype(_F32), idx, axis=-1)
    return jnp.sum(jnp.where(vals > -jnp.inf, mass, 0.0), axis=-1), jnp.sum(allowed, axis=-1) > top_k


# ---------------------------------------------------------------------------- one layer
def _layer_sums(mixer, x, segment_ids, *, select_k: int | None, recall_k: int | None, query_chunk: int):
    """One MLA layer's sums over a batch: kl_sum, queries (real ones), and with `recall_k`
    recall_sum, ceiling_sum and counted (real queries with more than `recall_k` candidates)."""
    x = jax.lax.stop_gradient(x)
    c_q, q_nope, q_pe, k_nope, k_pe = jax.lax.stop_gradient(mixer.dense_heads(x))
    index_q, index_w = mixer.indexer.queries(c_q, x)
    # rounded to the activation dtype and back, as the layer stores its index keys
    index_k = mixer.indexer.keys(x).astype(x.dtype).astype(_F32)
    b, t = x.shape[:2]
    chunk = min(query_chunk, t)
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t

    def chunks(a):  # [B, T, ...] -> [n_chunks, B, chunk, ...]; padded queries get segment 0
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(b, n_chunks, chunk, *a.shape[2:]), 1, 0)

    xs = (chunks(q_nope), chunks(q_pe), chunks(index_q), chunks(index_w), chunks(segment_ids),
          jnp.arange(n_chunks * chunk).reshape(n_chunks, chunk))
    key_pos = jnp.arange(t)

    @jax.checkpoint  # the backward pass recomputes a chunk instead of keeping [B, H, chunk, S] per chunk
    def one_chunk(carry, inputs):
        qn, qp, qi, wi, seg, pos = inputs
        allowed = ((key_pos[None, None, :] <= pos[None, :, None])
                   & (seg[:, :, None] == segment_ids[:, None, :]) & (seg != 0)[:, :, None])
        scores = indexer_scores(qi, wi, index_k)
        if select_k is not None:  # the layer's own selection: top-min(k, n_t) of its candidates
            vals, idx = jax.lax.top_k(jnp.where(allowed, jax.lax.stop_gradient(scores), -jnp.inf), min(select_k, t))
            allowed = allowed & selection_mask(idx, vals > -jnp.inf, t)
        logits = mla_attention_logits(qn, qp, k_nope, k_pe, mixer.scale)
        target = jax.lax.stop_gradient(jax.nn.softmax(jnp.where(allowed[:, None], logits, _NEG), axis=-1).mean(1))
        real = seg != 0
        sums = dict(kl_sum=jnp.sum(jnp.where(real, indexer_kl(scores, target, allowed), 0.0)),
                    queries=jnp.sum(real).astype(_F32))
        if recall_k is not None:
            recall, counted = topk_recall(jax.lax.stop_gradient(scores), target, allowed, recall_k)
            ceiling, _ = topk_recall(target, target, allowed, recall_k)
            counted = counted & real
            sums.update(recall_sum=jnp.sum(jnp.where(counted, recall, 0.0)),
                        ceiling_sum=jnp.sum(jnp.where(counted, ceiling, 0.0)), counted=jnp.sum(counted).astype(_F32))
        return jax.tree.map(jnp.add, carry, sums), None

    names = ("kl_sum", "queries") + (("recall_sum", "ceiling_sum", "counted") if recall_k is not None else ())
    sums, _ = jax.lax.scan(one_chunk, {k: jnp.zeros((), _F32) for k in names}, xs)
    return sums


def indexer_distill_terms(
    model: K31ForCausalLM,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    select_k: int | None = None,
    recall_k: int | None = None,
    query_chunk: int = QUERY_CHUNK,
    backends: Backends | None = None,
    remat: str = "none",
    collect: tuple[str, ...] = (),
) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
    """One forward of `model` over `tokens [B, T]` -> (final hidden states, per-layer sums,
    the forward's per-layer intermediates: "attn_in" and those named in `collect`).

    The forward runs as `model` is configured: with its indexer selecting when its
    `index_topk` is below T (use `with_index_topk(model, T)` for the dense warm-up). Each MLA
    layer's input is read from the forward; on it the layer's target and indexer scores are
    recomputed (module docstring): with `select_k` on the layer's top-`select_k` selection
    (the sparse stage), else on every causal candidate. Sums, each `[n_mla_layers]`:
    `kl_sum`, `queries` (real tokens), and with `recall_k` `recall_sum` / `ceiling_sum` /
    `counted`.
    segment_ids `[B, T]`: packed documents (0 = padding); None: one document per row.
    """
    cfg = model.config
    if not cfg.use_indexer:
        raise ValueError("indexer distillation needs a model with the lightning indexer (index_topk is None)")
    if not isinstance(query_chunk, int) or query_chunk < 1:
        raise ValueError(f"query_chunk must be a positive int, got {query_chunk!r}")
    if segment_ids is None:
        segment_ids = jnp.ones(tokens.shape, jnp.int32)
    out = model.hidden_states(tokens, segment_ids=segment_ids, backends=backends, remat=remat,
                              collect=tuple(dict.fromkeys(("attn_in", *collect))))
    hidden, per_layer = out.hidden, out.intermediates
    rows = np.asarray(cfg.mla_layers)
    layer_inputs = jax.lax.stop_gradient(per_layer["attn_in"][rows])
    input_norms = model.norms.input_norm[...][rows]
    graphdef, stacked = nnx.split(model.mla)

    def one_layer(_, inputs):
        attn_in, norm, state = inputs
        # the mixer's input exactly as the decoder layer makes it (k31jax.nn._model._decoder_layer)
        x = rms_norm(attn_in, norm, cfg.rms_norm_eps)
        return None, _layer_sums(nnx.merge(graphdef, state), x, segment_ids, select_k=select_k,
                                 recall_k=recall_k, query_chunk=query_chunk)

    _, sums = jax.lax.scan(one_layer, None, (layer_inputs, input_norms, stacked))
    return hidden, sums, per_layer


def with_index_topk(model: K31ForCausalLM, top_k: int) -> K31ForCausalLM:
    """The same parameters with the indexer selecting `top_k` keys; `top_k` >= the context
    turns selection off (the layer is then exactly dense gated MLA, architecture.md §10.2)."""
    if not model.config.use_indexer:
        raise ValueError("the model has no lightning indexer (index_topk is None)")
    return reconfigure(model, index_topk=int(top_k))


# ---------------------------------------------------------------------------- training step
@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """Static settings of `distill_step` (hashable: part of the compiled program's key).

    stage: "dense" (recall at `top_k` is logged too, unless it is None) or "sparse" (`top_k`
    must be the model's `index_topk`: the selection the forward makes). lm_loss: also train
    the non-indexer trainable weights by the LM loss (the sparse stage with more than the
    indexer trainable)."""

    backends: Backends
    stage: str
    top_k: int | None
    lm_loss: bool = False
    query_chunk: int = QUERY_CHUNK
    vocab_chunk: int = 4096
    remat: str = "none"

    def __post_init__(self):
        if self.stage not in DISTILL_STAGES:
            raise ValueError(f"DistillSettings.stage={self.stage!r}: expected one of {DISTILL_STAGES}")
        if self.stage == "sparse" and self.top_k is None:
            raise ValueError("DistillSettings: the sparse stage needs top_k (the model's index_topk)")
        if self.lm_loss and self.stage == "dense":
            raise ValueError("DistillSettings: the dense warm-up trains the indexer only (lm_loss=False)")


def distill_step(graphdef, tx: optax.GradientTransformation, s: DistillSettings, params, opt_state, trainable,
                 batch: dict[str, jax.Array]):
    """One optimizer step of indexer distillation over `batch` `[A, B, T]` -> (params,
    opt_state, trainable, metrics); the same contract as `train_step` (`params` / `trainable`
    are the halves of `partition`). `params` never changes: no router-bias update (the
    warm-up's model is frozen), and the sparse stage adds no balance loss either.

    Metrics: `indexer_kl` (the distillation loss, nats per query per layer),
    `indexer_kl_layers`, with the dense stage `indexer_recall` at `s.top_k` (over queries with
    more than `s.top_k` candidates) and its `indexer_recall_ceiling`; `loss` / `accuracy` the LM loss of the same forward (dense
    in the warm-up), `grad_norm`, `update_norm`."""
    queries = jnp.maximum(jnp.sum(batch["segment_ids"] != 0), 1).astype(_F32)
    lm_tokens = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
    recall_k = s.top_k if s.stage == "dense" else None

    def objective(tr, mb):
        model = nnx.merge(graphdef, overlay(params, tr))
        hidden, sums, _ = indexer_distill_terms(model, mb["tokens"], mb["segment_ids"],
                                             select_k=s.top_k if s.stage == "sparse" else None, recall_k=recall_k,
                                             query_chunk=s.query_chunk, backends=s.backends, remat=s.remat)
        head = model.lm_head[...]
        if not s.lm_loss:  # logged only: nothing but the indexer trains
            hidden, head = jax.lax.stop_gradient((hidden, head))
        lm_sum, stats = chunked_cross_entropy(hidden, head, mb["targets"], mb["loss_mask"], vocab_chunk=s.vocab_chunk)
        kl = jnp.mean(sums["kl_sum"]) / queries
        value = kl + lm_sum / lm_tokens if s.lm_loss else kl
        aux = dict(sums, nll_sum=stats["nll_sum"], tokens=stats["tokens"], correct=stats["correct"],
                   bytes=jnp.sum(mb["target_bytes"] * mb["loss_mask"]))
        return value, aux

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def accumulate(carry, mb):
        grads, sums = carry
        (_, aux), g = grad_fn(trainable, mb)
        return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, aux)), None

    n_layers = jax.tree.leaves(overlay(params, trainable)["mla"])[0].shape[0]  # the stacked MLA layers
    per_layer = ("kl_sum", "queries") + (("recall_sum", "ceiling_sum", "counted") if recall_k is not None else ())
    sums0 = {k: jnp.zeros((n_layers,), _F32) for k in per_layer}
    sums0.update({k: jnp.zeros((), _F32) for k in ("nll_sum", "tokens", "correct", "bytes")})
    (grads, sums), _ = jax.lax.scan(accumulate, (jax.tree.map(jnp.zeros_like, trainable), sums0), batch)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    tokens = jnp.maximum(sums["tokens"], 1.0)
    metrics = dict(loss=sums["nll_sum"] / tokens, accuracy=sums["correct"] / tokens, tokens=sums["tokens"],
                   bytes=sums["bytes"], indexer_kl=jnp.mean(sums["kl_sum"]) / queries,
                   indexer_kl_layers=sums["kl_sum"] / queries, grad_norm=optax.tree.norm(grads),
                   update_norm=optax.tree.norm(updates))
    if recall_k is not None:
        counted = jnp.maximum(jnp.sum(sums["counted"]), 1.0)
        metrics["indexer_recall"] = jnp.sum(sums["recall_sum"]) / counted
        metrics["indexer_recall_ceiling"] = jnp.sum(sums["ceiling_sum"]) / counted
    return params, opt_state, trainable, metrics


def distill_setup(model: K31ForCausalLM, cfg: TrainConfig) -> tuple[nnx.GraphDef, DistillSettings]:
    """(the graphdef the steps run, their settings) for the run `cfg` of `model`: the dense
    warm-up runs the model with selection off (`index_topk` = the context) and logs recall at
    the model's own `index_topk`; the sparse stage runs the model as configured."""
    mc, seq_len, stage = model.config, cfg.data.seq_len, cfg.distill_indexer
    if not mc.use_indexer:
        raise ValueError(f"distill_indexer={stage!r}: the model has no lightning indexer (its config has "
                         "index_topk None)")
    if stage == "dense":
        graphdef = nnx.split(with_index_topk(model, seq_len))[0]
        top_k = mc.index_topk if mc.index_topk < seq_len else None
    else:
        if mc.index_topk >= seq_len:
            raise ValueError(f"distill_indexer='sparse': the model's index_topk={mc.index_topk} >= seq_len={seq_len} "
                             "selects every key, so attention is dense; use a longer --seq-len or the dense warm-up")
        graphdef, top_k = nnx.split(model)[0], mc.index_topk
    settings = DistillSettings(backends=Backends(), stage=stage, top_k=top_k,
                               lm_loss=stage == "sparse" and cfg.optim.trainable != "indexer",
                               vocab_chunk=cfg.vocab_chunk, remat=cfg.remat)
    return graphdef, settings


# ---------------------------------------------------------------------------- evaluation
@dataclasses.dataclass(frozen=True)
class RecallResult:
    """Top-k recall and the dense-warm-up KL of a model's indexers over a data split."""

    top_k: int
    recall: float                     # mean over layers and queries with more than top_k candidates
    recall_layers: tuple[float, ...]  # per MLA layer
    ceiling: float                    # the same for a perfect ranking: the target's own top-k mass
    kl: float                         # nats per query per layer (every real query)
    kl_layers: tuple[float, ...]
    queries: int                      # real queries (per layer)
    counted: int                      # of them, those with more than top_k candidates
    batches: int

    def line(self) -> str:
        layers = ", ".join(f"{r:.4f}" for r in self.recall_layers)
        return (f"top-{self.top_k} recall {self.recall:.4f} (per MLA layer: {layers}) over {self.counted:,} queries "
                f"with more than {self.top_k} candidates ({self.queries:,} queries in all; a perfect ranking "
                f"would reach {self.ceiling:.4f}); indexer KL {self.kl:.4f} nats/query")


@dataclasses.dataclass(frozen=True)
class _RecallSettings:
    top_k: int
    query_chunk: int
    backends: Backends


def _recall_batch(graphdef, s: _RecallSettings, params, batch):
    model = nnx.merge(graphdef, params)
    _, sums, _ = indexer_distill_terms(model, batch["tokens"], batch["segment_ids"], recall_k=s.top_k,
                                    query_chunk=s.query_chunk, backends=s.backends)
    return sums


def indexer_recall(model: K31ForCausalLM, tokenizer: TokenizerBase, data: DataConfig, *, top_k: int,
                   max_batches: int | None = None, split: str = "heldout", query_chunk: int = QUERY_CHUNK,
                   backends: Backends | None = None) -> RecallResult:
    """Top-k recall of every indexer of `model` against its dense attention (the indexer
    off), over `data`'s `split` (every batch, or the first `max_batches`), and the KL of the
    dense warm-up. `top_k` need not be the model's `index_topk`."""
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"indexer_recall: top_k must be a positive int, got {top_k!r}")
    graphdef, state = nnx.split(with_index_topk(model, data.seq_len))
    params = nnx.to_pure_dict(state)
    settings = _RecallSettings(top_k, query_chunk, backends or Backends())
    step = jax.jit(_recall_batch, static_argnums=(0, 1))
    totals = None
    batches = 0
    for batch in make_dataset(data, tokenizer, split):
        if max_batches is not None and batches >= max_batches:
            break
        sums = jax.device_get(step(graphdef, settings, params, {k: jnp.asarray(v) for k, v in batch.items()}))
        sums = {k: np.asarray(v, np.float64) for k, v in sums.items()}
        totals = sums if totals is None else {k: totals[k] + sums[k] for k in totals}
        batches += 1
    if totals is None or not totals["queries"].sum():
        raise ValueError(f"the {split} split of {list(data.paths)} has no tokens")
    counted = totals["counted"]
    recall_layers = np.where(counted > 0, totals["recall_sum"] / np.maximum(counted, 1), math.nan)
    kl_layers = totals["kl_sum"] / totals["queries"]
    return RecallResult(top_k=top_k,
                        recall=float(totals["recall_sum"].sum() / counted.sum()) if counted.sum() else math.nan,
                        recall_layers=tuple(map(float, recall_layers)),
                        ceiling=float(totals["ceiling_sum"].sum() / counted.sum()) if counted.sum() else math.nan, kl=float(kl_layers.mean()),
                        kl_layers=tuple(map(float, kl_layers)), queries=int(totals["queries"][0]),
                        counted=int(counted[0]), batches=batches)
