"""MXFP8 activations at inference (`load_model(expert_activations="mxfp8")`, the
`--mxfp8-activations` switch of generate / chat / serve / eval): the packed MXFP4 model with its
routed experts' GEMM inputs rounded to MXFP8 computes what QAT's training-side fake-quant
computes (float masters, STE weight fake-quant, MXFP8 activation fake-quant), prefill + decode
included, and visibly differs from the unrounded model."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k31jax.cli import main
from k31jax.generate import Engine, load_model
from k31jax.nn import reconfigure
from k31jax.train import OptimConfig, TrainConfig
from k31jax.train._trainer import training_form

TEXT = "The scheduler drains the queue before it admits a new request, so that"


@pytest.fixture(scope="module")
def embedded():
    return load_model()


def test_reconfigure_shares_the_arrays_and_refuses_a_change_of_shapes(embedded):
    model = embedded.model
    assert model.config.expert_weights == "mxfp4" and model.config.expert_activations == "bf16"
    quant = reconfigure(model, expert_activations="mxfp8")
    assert quant.config.expert_activations == "mxfp8" and model.config.expert_activations == "bf16"
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(quant)):
        assert a is b  # no copy of the weights
    assert reconfigure(model, expert_activations="bf16") is model
    with pytest.raises(ValueError, match="num_experts=16.*changes parameter shapes"):
        reconfigure(model, num_experts=16)
    with pytest.raises(ValueError, match="expert_activations"):
        reconfigure(model, expert_activations="fp8")


def test_mxfp8_inference_equals_the_training_fake_quant(embedded):
    """Full forward: the packed model under the switch (inference's MoE form on CPU) against the
    training form of the same weights; then greedy prefill + decode, teacher-forced through the
    training form, picks the same tokens."""
    tok = embedded.tokenizer
    served = load_model(expert_activations="mxfp8").model
    settings = TrainConfig(out="unused", data=None, optim=OptimConfig(), steps=1, qat=True, mxfp8_activations=True)
    trained = training_form(embedded.model, settings)
    assert trained.config.expert_weights != "mxfp4" and trained.config.expert_qat
    ids = jnp.asarray([tok.encode(TEXT)], jnp.int32)
    got, want, plain = (np.asarray(m(ids).logits, np.float64) for m in (served, trained, embedded.model))
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-5 * scale  # (measured 3e-7: float32 sums in another order)
    assert np.abs(plain - want).max() >= 1e-3 * scale  # the rounding shows (measured 4e-3): the switch is on

    engine = Engine(served, tok, max_len=128, prefill_chunk=16)
    new = engine.generate([ids[0].tolist()], 12, stop_ids=frozenset()).tokens[0]
    full = jnp.asarray([ids[0].tolist() + new], jnp.int32)
    teacher = np.asarray(trained(full).logits[0, ids.shape[1] - 1:-1]).argmax(-1)
    assert teacher.tolist() == new


def test_cli_generate_serve_and_eval_take_the_switch(tmp_path, capsys, monkeypatch):
    """`k31jax generate` / `serve --mxfp8-activations` hand the engine the switched model;
    `k31jax eval --mxfp8-activations` says so and reports a different loss on the same data."""
    from k31jax.cli import _generate, _serve

    seen = []

    class Stop(Exception):
        pass

    def spy(real, stop):
        def engine(model, *a, **kw):
            seen.append(model.config.expert_activations)
            if stop:
                raise Stop  # the server would start here
            return real(model, *a, **kw)
        return engine

    monkeypatch.setattr(_generate, "Engine", spy(Engine, False))
    monkeypatch.setattr(_serve, "Engine", spy(Engine, True))
    args = ["generate", "--prompt", TEXT, "--raw", "--max-new-tokens", "4"]
    assert main([*args, "--mxfp8-activations"]) == 0
    for extra in ([], ["--mxfp8-activations"]):  # (the command runner reports the spy's Stop in one line)
        assert main(["serve", "--port", "0", *extra]) == 1
    assert seen == ["mxfp8", "bf16", "mxfp8"]
    capsys.readouterr()

    data = tmp_path / "notes.txt"
    data.write_text((TEXT + " The cache keeps the prefix it shares.\n") * 40)
    rows = []
    for extra in ([], ["--mxfp8-activations"]):
        assert main(["eval", "--data", str(data), "--seq-len", "64", "--batch-size", "2", "--max-batches", "2",
                     "--no-progress", "--json", *extra]) == 0
        out, _ = capsys.readouterr()
        rows.append((out.splitlines()[0], json.loads(out.splitlines()[-1])))
    (line_plain, plain), (line_q, quant) = rows
    assert "MXFP8" in line_q and "MXFP8" not in line_plain
    assert quant["expert_activations"] == "mxfp8" and plain["expert_activations"] == "bf16"
    assert quant["loss"] != plain["loss"] and abs(quant["loss"] - plain["loss"]) < 0.05 * plain["loss"]
