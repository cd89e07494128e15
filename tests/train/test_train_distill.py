"""Indexer distillation and top-k recall (k31jax.train._distill) against float64 NumPy.

Covers: the per-query KL, its gradient in the scores and top-k recall vs `refs.distill` on
packed rows with padding (top-k below and above the context); a whole model's per-layer sums
(dense warm-up with recall, and the sparse stage on the model's own selection) vs the
reference computed from the model's weights and layer inputs, at a context that is not a
multiple of the query chunk; six warm-up steps through the trainer change only the indexer
(the router bias too stays) and lower the held-out KL; `k31jax eval --indexer-recall
--index-topk dense` on that run and the flags' defaults and errors; (slow) one step of the
sparse stage training everything; a run from a release with a BPE records that tokenizer and
`index_topk`, and both reach its exports.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.model import tiny_config
from helpers.paths import stdlib_corpus
from k31jax.chat import KimiTokenizer, train_bpe, write_tiktoken_model
from k31jax.cli import build_parser, main
from k31jax.cli._train import _config_from_args, _defaults
from k31jax.ckpt import ASSETS_DIR
from k31jax.ckpt import write_synthetic_release
from k31jax.generate import load_model
from k31jax.nn import K31ForCausalLM, abstract_model
from k31jax.train import (DataConfig, OptimConfig, TrainConfig, indexer_distill_terms, indexer_kl, indexer_recall,
                          load_any, load_run, read_metrics, topk_recall, train, with_index_topk)
from k31jax.train._trainer import _tokenizer_dir
import refs as R
from refs import distill as RD


T = 37  # not a multiple of the query chunk (16) below
SEGMENTS = np.array([[1] * 21 + [2] * 13 + [0] * 3, [1] * T], np.int32)  # two documents + padding; one
# The tiny DSA layers (index_topk 8) in three layers: MLA, KDA, MLA (a KDA layer between the
# two MLA layers, so stack slots differ from layer numbers), MoE on layers 1-2. Every compile
# of the 13-layer preset costs ~20 s of CPU; this one ~5 s.
CONFIG = tiny_config(num_hidden_layers=3, layer_types=("mla", "kda", "mla"))


def _allowed(segment_ids):
    """[B, T, T]: causal, same document, real query."""
    seg = np.asarray(segment_ids)
    causal = np.tril(np.ones((seg.shape[1],) * 2, bool))
    return causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, :, None]


# ---------------------------------------------------------------------------- per-query terms
def test_kl_gradient_and_recall_match_the_references():
    rng = np.random.default_rng(0)
    allowed = _allowed(SEGMENTS)
    logits = 2.0 * rng.standard_normal((2, 3, T, T))
    target = np.stack([RD.head_summed_attention(logits[b], allowed[b] | ~allowed[b].any(1, keepdims=True))
                       for b in range(2)]) * allowed
    target[0, 30, 22] = 0.0  # an allowed key without target mass (p log p = 0)
    target = target / np.maximum(target.sum(-1, keepdims=True), 1e-30)
    scores = 1.5 * rng.standard_normal((2, T, T))

    kl = np.asarray(indexer_kl(jnp.asarray(scores, jnp.float32), jnp.asarray(target, jnp.float32),
                               jnp.asarray(allowed)))
    grad = np.asarray(jax.grad(lambda s: indexer_kl(s, jnp.asarray(target, jnp.float32), jnp.asarray(allowed)).sum())(
        jnp.asarray(scores, jnp.float32)))
    for b in range(2):
        np.testing.assert_allclose(kl[b], RD.indexer_kl(target[b], scores[b], allowed[b]), rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(grad[b], RD.indexer_kl_grad(target[b], scores[b], allowed[b]), atol=2e-6)
    candidates = allowed.sum(-1)  # a document's first query and padding: nothing to rank
    assert kl[candidates > 1].min() > 0.01 and np.all(kl[candidates <= 1] == 0)

    for k in (5, 50):  # 50 > T: every query selects all its candidates
        recall, counted = map(np.asarray, topk_recall(jnp.asarray(scores), jnp.asarray(target, jnp.float32),
                                                      jnp.asarray(allowed), k))
        for b in range(2):
            ref_recall, ref_counted = RD.topk_recall(target[b], scores[b], allowed[b], k)
            np.testing.assert_allclose(recall[b], ref_recall, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(counted[b], ref_counted)
        real = SEGMENTS != 0
        if k == 50:
            assert not counted.any()
            np.testing.assert_allclose(recall[real], 1.0, rtol=1e-5)
        else:
            assert counted.sum() == real.sum() - 3 * 5 and 0.2 < recall[counted].mean() < 0.9


# ---------------------------------------------------------------------------- a whole model
@pytest.fixture(scope="module")
def model():
    """`CONFIG` with random weights large enough that attention is far from uniform (norm
    weights near 1); filled on the abstract model, so building it compiles nothing."""
    graphdef, state = nnx.split(abstract_model(CONFIG))
    rng = np.random.default_rng(1)

    def fill(path, leaf):
        name = str(path[-1].key)
        centre = 1.0 if "norm" in name and "bias" not in name else 0.0
        value = centre + 0.15 * rng.standard_normal(leaf.shape)
        if name == "a_log":  # one value per KDA head, then the release's zero padding
            value[..., CONFIG.kda_num_heads:] = 0.0
        return jnp.asarray(value.astype(leaf.dtype))

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def _mla_weights(model, slot):
    """One MLA layer's weights under their release names ([out, in]) and its indexer's."""
    mla = jax.tree.map(lambda a: np.asarray(a[slot], np.float64), nnx.to_pure_dict(nnx.state(model.mla)))
    names = dict(q_a_proj="q_a_proj", q_a_norm="q_a_layernorm", q_b_proj="q_b_proj", kv_a_proj="kv_a_proj_with_mqa",
                 kv_a_norm="kv_a_layernorm", kv_b_proj="kv_b_proj")
    p = {hf: mla[ours].T if mla[ours].ndim == 2 else mla[ours] for ours, hf in names.items()}
    ix = mla["indexer"]
    ip = dict(wq_b=ix["wq_b"].T, wk=ix["wk"].T, k_norm_weight=ix["k_norm_weight"], k_norm_bias=ix["k_norm_bias"],
              weights_proj=ix["weights_proj"].T)
    return p, ip, {**p, "g_proj": mla["g_proj"].T, "o_proj": mla["o_proj"].T}


def test_per_layer_sums_match_the_reference(model):
    """Dense warm-up (recall at 5) and sparse stage (the model's top-8 selection), each against
    the float64 reference run on the model's own layer inputs; the layer input is checked by
    the reference layer reproducing the model's MLA output from it."""
    cfg = model.config
    tokens = jnp.asarray(np.random.default_rng(2).integers(1, cfg.vocab_size, SEGMENTS.shape), jnp.int32)
    seg = jnp.asarray(SEGMENTS)

    def run(m):
        dense = m.config.index_topk >= T
        _, sums, per_layer = indexer_distill_terms(m, tokens, seg, select_k=None if dense else 8,
                                                   recall_k=5 if dense else None, query_chunk=16, collect=("attn_out",))
        return sums, per_layer

    dense_model = with_index_topk(model, T)
    (dense, dense_layers), (sparse, sparse_layers) = jax.jit(lambda a, b: (run(a), run(b)))(dense_model, model)
    ref_cfg = dict(num_heads=cfg.num_attention_heads, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                   kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank)
    norms = np.asarray(model.norms.input_norm[...], np.float64)
    for slot, layer in enumerate(cfg.mla_layers):
        p, ip, full = _mla_weights(model, slot)
        for stage, sums, per_layer in (("dense", dense, dense_layers), ("sparse", sparse, sparse_layers)):
            kl_sum = recall_sum = ceiling_sum = counted_sum = 0.0
            for b in range(2):
                x = R.rms_norm(np.asarray(per_layer["attn_in"][layer, b]), norms[layer], cfg.rms_norm_eps)
                if stage == "dense":  # the layer input is what the model's layer saw
                    y = R.attention.mla_layer_packed(x, full, ref_cfg, SEGMENTS[b])
                    np.testing.assert_allclose(np.asarray(per_layer["attn_out"][layer, b]), y, rtol=2e-4, atol=2e-5)
                kl, recall, ceiling, counted = RD.layer_distill(
                    x, p, ip, ref_cfg, cfg.index_n_heads, cfg.index_head_dim, SEGMENTS[b],
                    select_k=8 if stage == "sparse" else None, recall_k=5 if stage == "dense" else None)
                kl_sum += kl.sum()
                recall_sum += recall[counted].sum()
                ceiling_sum += ceiling[counted].sum()
                counted_sum += counted.sum()
            assert float(sums["queries"][slot]) == (SEGMENTS != 0).sum()
            np.testing.assert_allclose(float(sums["kl_sum"][slot]), kl_sum, rtol=1e-4)
            assert kl_sum > 0.5
            if stage == "dense":
                assert float(sums["counted"][slot]) == counted_sum == (SEGMENTS != 0).sum() - 3 * 5
                np.testing.assert_allclose(float(sums["recall_sum"][slot]), recall_sum, rtol=1e-4)
                np.testing.assert_allclose(float(sums["ceiling_sum"][slot]), ceiling_sum, rtol=1e-4)
                assert recall_sum < ceiling_sum  # an untrained indexer ranks worse than the target itself


# ---------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real text: a few of the Python standard library's own sources (two of them held out)."""
    return stdlib_corpus(tmp_path_factory.mktemp("corpus"),
                         ("bisect.py", "heapq.py", "colorsys.py", "keyword.py", "glob.py", "fnmatch.py"))


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, model, corpus):
    """`model` written as a release, then six steps of the dense warm-up from it (the Python
    API): (the run folder, the starting model, its tokenizer, the data, held-out recall before)."""
    root = tmp_path_factory.mktemp("distill")
    release = write_synthetic_release(root / "release", CONFIG,
                                      params=jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    start, tokenizer, _ = load_any(release)
    data = DataConfig(paths=(str(corpus),), seq_len=T, batch_size=2, holdout_fraction=0.3, seed=1)
    before = indexer_recall(start, tokenizer, data, top_k=8, max_batches=2)
    optim = OptimConfig(learning_rate=2e-2, warmup_steps=0, total_steps=20, weight_decay=0.0, trainable="indexer")
    run = TrainConfig(out=str(root / "run"), data=data, optim=optim, steps=6, init=str(release), save_every=100,
                      eval_batches=2, distill_indexer="dense")
    train(run, progress=False, export=False)
    return root / "run", start, tokenizer, data, before


def _flat(model) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf) for path, leaf in flat}


def test_distillation_trains_only_the_indexer_and_lowers_the_kl(distilled):
    out, start, _, _, before = distilled
    rows = read_metrics(out)
    steps = [r for r in rows if "indexer_kl" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert all(0 < r["indexer_recall"] <= r["indexer_recall_ceiling"] <= 1 and np.isfinite(r["loss"])
               for r in steps)  # recall at the model's k
    final = rows[-1]
    assert final["eval_indexer_kl"] < 0.8 * before.kl and final["eval_indexer_recall"] > before.recall, (before, final)
    trained, _, _ = load_run(out)
    old, new = _flat(start), _flat(trained)
    changed = {path for path in old if not np.array_equal(old[path], new[path])}
    assert changed == {"mla/indexer/wq_b", "mla/indexer/wk", "mla/indexer/weights_proj", "mla/indexer/k_norm_weight",
                       "mla/indexer/k_norm_bias"}  # the router's selection bias did not move either


def test_cli_flags(distilled, capsys):
    out, _, _, data, _ = distilled
    args = build_parser().parse_args(["train", "--distill-indexer", "--out", "x", "--data", "x", "--steps", "1"])
    _defaults(args)
    warm_up = _config_from_args(args)
    assert (warm_up.distill_indexer, warm_up.optim.trainable) == ("dense", "indexer")  # the defaults
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(out), "--data", *data.paths, "--seq-len", str(T), "--batch-size", "2",
                 "--holdout-fraction", "0.3", "--max-batches", "2", "--index-topk", "dense", "--indexer-recall",
                 "--top-k-fraction", "0.22", "--json"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["index_topk"] == T and "dense attention" in printed
    assert result["indexer_recall"]["top_k"] == 8  # round(0.22 * 37)
    assert result["indexer_recall"]["recall"] == pytest.approx(read_metrics(out)[-1]["eval_indexer_recall"], rel=1e-6)
    assert main(["eval", "--data", "x", "--top-k", "3"]) == 2  # --top-k without --indexer-recall
    assert main(["train", "--distill-indexer", "sparse", "--trainable", "all", "--lora-rank", "4", "--data",
                 *data.paths, "--steps", "1", "--out", str(out.parent / "lora")]) == 1  # one line: no LoRA
    assert "distillation trains the indexer" in capsys.readouterr().err


def test_a_run_keeps_its_init_tokenizer_and_index_topk_through_the_export(tmp_path, corpus):
    """Fine-tuning a release that has its own BPE (the embedded model's case) without naming a
    tokenizer: the run records the release's, its exports carry it (a converted Orbax folder
    too), and `index_topk` is the one the run asked for."""
    cfg = CONFIG.replace(vocab_size=300 + 256)
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    release = write_synthetic_release(tmp_path / "release", cfg,
                                      params=jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    write_tiktoken_model(train_bpe([p.read_text() for p in sorted(corpus.iterdir())], 300), release / "tiktoken.model")
    data = DataConfig(paths=(str(corpus),), seq_len=T, batch_size=2, holdout_fraction=0.3, seed=1)
    optim = OptimConfig(learning_rate=2e-2, warmup_steps=0, total_steps=2, weight_decay=0.0, trainable="indexer")
    run = TrainConfig(out=str(tmp_path / "run"), data=data, optim=optim, steps=1, init=str(release), save_every=100,
                      eval_batches=1, distill_indexer="dense", index_topk=5)
    result = train(run, progress=False)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["tokenizer"] == str(release)
    text = (corpus / "heapq.py").read_text()[:500]
    want = KimiTokenizer.from_dir(release).encode(text)
    assert len(want) < len(text.encode())  # the BPE, not bytes
    for loaded in (load_model(result.final_dir / "release"), load_model(result.final_dir / "orbax"),
                   load_any(tmp_path / "run")):
        model, tokenizer = (loaded.model, loaded.tokenizer) if hasattr(loaded, "model") else loaded[:2]
        assert isinstance(tokenizer, KimiTokenizer) and tokenizer.encode(text) == want
        assert model.config.index_topk == 5
    orbax = result.final_dir / "orbax"  # a run from the converted folder finds the release's tokenizer inside it
    assert _tokenizer_dir(dataclasses.replace(run, init=str(orbax))) == str(orbax / ASSETS_DIR)
    with pytest.raises(ValueError, match="index_topk=0"):
        dataclasses.replace(run, index_topk=0)


@pytest.mark.slow  # the backward pass through the whole model compiles for ~40 s of CPU
def test_sparse_stage_trains_the_model_by_lm_loss_and_the_indexer_by_kl(distilled, tmp_path):
    """The sparse stage after the warm-up, everything trainable: one step moves the indexer
    (by the KL over the selection) and the other weights (by the LM loss)."""
    out, start, _, data, _ = distilled
    optim = OptimConfig(learning_rate=1e-3, warmup_steps=0, total_steps=20, trainable="all")
    run = TrainConfig(out=str(tmp_path / "sparse"), data=data, optim=optim, steps=1, init=str(out), save_every=100,
                      eval_batches=1, distill_indexer="sparse")
    result = train(run, progress=False, export=False)
    metrics = result.last_metrics
    assert float(metrics["indexer_kl"]) > 0 and np.isfinite(float(metrics["loss"])) and "indexer_recall" not in metrics
    warm, _, _ = load_run(out)
    old, new = _flat(warm), _flat(load_run(tmp_path / "sparse")[0])
    assert not np.array_equal(old["mla/indexer/wq_b"], new["mla/indexer/wq_b"])
    assert not np.array_equal(old["mla/q_b_proj"], new["mla/q_b_proj"])
    assert np.array_equal(old["moe/gate_bias"], new["moe/gate_bias"])  # no router-bias update in distillation
