"""A real 2-process run on localhost (jax.distributed, CPU gloo collectives, 2 CPU devices
each): the sharded `tiny` forward equals the single-process one."""

import subprocess
import sys

import numpy as np
from flax import nnx

from helpers.paths import MULTIPROCESS_DIR
from helpers.processes import free_port, subprocess_env
from k31jax import K31ForCausalLM, ModelConfig

WORKER = MULTIPROCESS_DIR / "sharded_forward.py"


def test_two_processes_equal_single_process(tmp_path):
    out = tmp_path / "logits.npz"
    port = str(free_port())
    env = subprocess_env()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), "2", port, "expert=2,tensor=2", str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=540)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    got = np.load(out)
    assert int(got["processes"]) == 2 and int(got["devices"]) == 4

    cfg = ModelConfig.preset("tiny", dtype="float32", expert_weights="mxfp4")
    model = K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 13)).astype(np.int32)
    step = nnx.jit(lambda m, t, c: m(t, c))
    first = step(model, tokens[:, :12], model.init_cache(4, 16))
    prefill, decode = first.logits, step(model, tokens[:, 12:], first.cache).logits
    for name, ref in (("prefill", prefill), ("decode", decode)):
        ref = np.asarray(ref)
        np.testing.assert_allclose(got[name], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=name)
