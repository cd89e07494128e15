"""LoRA on the frozen packed base (issue 31): the routed experts stay packed MXFP4 through
training (no float copy of them in the compiled step), adapters beside them equal the float
model with the adapters merged in, the separate adapter export leaves the base's bytes alone and
loads and generates; the merged export re-rounds the experts.

Runs in a fresh process, as the other tests that compile a whole training step
(`test_train_runs.test_only_the_selected_weights_train`: compiling such steps late in the
full suite's process once crashed XLA:CPU)."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k31jax.cli import main
from k31jax.generate import Engine, embedded_model_dir, load_model
from k31jax.nn import dequantize_experts, merge_expert_adapters
from k31jax.train import (DataConfig, OptimConfig, TrainConfig, Trainer, language_reference_domain,
                          load_generation_model)

_ISOLATED = "K31JAX_TEST_ISOLATED"
_ROUTED = ("w_gate", "w_up", "w_down")


def _packed(params) -> dict[str, np.ndarray]:
    return {f"{w}/{part}": np.asarray(params["moe"][w][part]) for w in _ROUTED for part in ("packed", "scale")}


def test_lora_trains_on_the_packed_experts_and_exports_their_bytes(tmp_path, capsys):
    if os.environ.get(_ISOLATED) != "lora-packed":
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}"],
                             env={**os.environ, _ISOLATED: "lora-packed"}, capture_output=True, text=True,
                             timeout=900)
        assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
        return
    domain = language_reference_domain(tmp_path / "text")
    data = DataConfig(paths=(str(domain.train),), seq_len=64, batch_size=2)
    cfg = TrainConfig(out=str(tmp_path / "run"), data=data, steps=2, init=str(embedded_model_dir()), lora_rank=2,
                      lora_experts=True,
                      optim=OptimConfig(learning_rate=1e-2, warmup_steps=1, total_steps=2), save_every=2)
    shipped = load_model()
    base = _packed(nnx.to_pure_dict(nnx.state(shipped.model)))
    with Trainer(cfg, progress=False) as trainer:
        mc = trainer.model_config
        assert mc.expert_weights == "mxfp4" and not mc.expert_qat and mc.expert_adapter_rank == 2
        assert {p for p in trainer.trainable.a if p.startswith("moe/w_")} == {"moe/w_gate", "moe/w_up", "moe/w_down"}
        assert {k: v.dtype for k, v in _packed(trainer.params).items()} == {k: np.uint8 for k in base}

        # the compiled step: the packed codes and scales are its expert arguments, and no float
        # array holds more than one layer's experts (the stacked float masters a full fine-tune
        # trains are [moe layers, E, out, in]: the LoRA step has none)
        batch = trainer._next_batch()
        program = trainer._step_fn.compiled(trainer._step_graphdef, trainer.tx, trainer.settings, trainer.params,
                                            trainer.opt_state, trainer.trainable, batch)
        e, i, ell = mc.num_experts, mc.moe_intermediate_size, mc.expert_in_dim
        float_expert_shapes = {dims for dims in re.findall(r"(?:f32|bf16|f16)\[([\d,]+)\]", program.as_text())
                               if dims.endswith((f"{e},{i},{ell}", f"{e},{ell},{i}"))}
        assert float_expert_shapes, "expected each layer's decoded experts (the forward pass's temporaries)"
        assert float_expert_shapes <= {f"{e},{i},{ell}", f"{e},{ell},{i}"}, float_expert_shapes
        float_stack = sum(np.asarray(v).size for k, v in base.items() if k.endswith("packed")) * 2 * 4
        assert program.memory_analysis().argument_size_in_bytes < float_stack

        metrics = trainer.train_steps(2)
        for name, value in _packed(trainer.params).items():
            np.testing.assert_array_equal(value, base[name], err_msg=name)
        assert all(np.abs(np.asarray(trainer.trainable.b[f"moe/{w}"])).max() > 0 for w in _ROUTED)
        assert all(np.isfinite(m["loss"]) for m in metrics)
        trained = trainer.model()
        trainer.export(tmp_path / "export")

    # the adapters beside the packed experts compute what the float model with them merged does
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 2000, (2, 29)), jnp.int32)
    unmerged = np.asarray(trained(tokens).logits, np.float64)
    np.testing.assert_allclose(unmerged, np.asarray(dequantize_experts(trained)(tokens).logits, np.float64),
                               rtol=0, atol=1e-4)

    # the separate adapter: the base's packed bytes as shipped, the same model once loaded
    adapter = tmp_path / "export" / "adapter"
    assert {f.name for f in adapter.iterdir()} == {"adapter_config.json", "adapter.safetensors"}
    loaded = load_generation_model(lora=adapter)
    for name, value in _packed(nnx.to_pure_dict(nnx.state(loaded.model))).items():
        np.testing.assert_array_equal(value, base[name], err_msg=f"adapter-loaded {name}")
    np.testing.assert_allclose(np.asarray(loaded.model(tokens).logits, np.float64), unmerged, rtol=0, atol=1e-5)
    assert "LoRA adapter" in loaded.banner
    engine = Engine(loaded.model, loaded.tokenizer, max_len=64)
    out = engine.generate([[1, 2, 3, 4]], max_new_tokens=4, stop_ids=())
    assert len(out.completions[0].tokens) == 4

    # the command line: generate with the adapter; a folder without one is named in one line
    assert main(["generate", "--lora", str(adapter), "--prompt", "def f(", "--max-new-tokens", "3"]) == 0
    assert f"LoRA adapter {adapter}" in capsys.readouterr().err
    assert main(["generate", "--lora", str(tmp_path), "--prompt", "x", "--max-new-tokens", "1"]) != 0
    assert f"{tmp_path / 'adapter_config.json'}: missing" in capsys.readouterr().err

    # the merged export: adapters merged into the experts and re-rounded to MXFP4
    exported = load_model(tmp_path / "export" / "orbax")
    assert exported.model.config.expert_weights == "mxfp4" and not exported.model.config.expert_adapter_rank
    merged = _packed(nnx.to_pure_dict(nnx.state(merge_expert_adapters(trained))))
    for name, value in _packed(nnx.to_pure_dict(nnx.state(exported.model))).items():
        np.testing.assert_array_equal(value, merged[name], err_msg=f"exported {name}")
    assert any(not np.array_equal(merged[name], base[name]) for name in base)

    # an adapter is refused on a base whose packed experts differ
    with pytest.raises(ValueError, match="packed experts"):
        load_generation_model(tmp_path / "export" / "orbax", lora=adapter)
