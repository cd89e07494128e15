"""`k31jax serve` beyond one unsharded process: its argument checks, `--mesh` on 8 fake CPU
devices (with the bounded queue's 429), and the multi-process mode (2 processes on loopback,
process 0 serving HTTP, both stepping the same sharded batch). Each server is a real process on
127.0.0.1, stopped by its own pid; greedy text is compared with the unsharded engine's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers.processes import cli_env, free_port, subprocess_env
from k31jax.cli import main
from k31jax.generate import Engine, Request, load_model

MODEL, MAX_LEN, NEW = "k31jax-tiny", 256, 10
CHUNK = 2  # prefill widths 2 and 1: two prefill programs to compile per server, the fewest that chunk
PROMPT = [5, 77, 201, 13, 90, 44, 300, 8, 61, 150, 9, 222]  # token ids (raw /v1/completions prompt)
LONG = MAX_LEN - 16  # the longest greedy run the engine's prompt bucket (16) leaves room for


def _env() -> dict[str, str]:
    return subprocess_env(cli_env())


def _serve(log: Path, *args: str) -> subprocess.Popen:
    """A server process; its stderr goes to `log` (an unread pipe would fill with compiler
    warnings and block it)."""
    cmd = [sys.executable, "-m", "k31jax.cli", "serve", "--config", "tiny", "--max-len", str(MAX_LEN),
           "--prefill-chunk", str(CHUNK), *args]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, env=_env())
    proc.log = log
    return proc


def _tail(proc: subprocess.Popen) -> str:
    return proc.log.read_text()[-3000:]


def _wait_healthy(proc: subprocess.Popen, base: str, others=()) -> None:
    deadline = time.time() + 900  # the warm-up compiles every program; slow on a shared 2-core machine
    while time.time() < deadline:
        for p in (proc, *others):
            if p.poll() is not None:
                pytest.fail(f"server exited ({p.returncode}): {_tail(p)}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    pytest.fail(f"server did not become healthy: {_tail(proc)}")


def _stop(proc: subprocess.Popen, timeout: float = 30) -> int | None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def _compiles(base: str) -> dict[str, int]:
    lines = httpx.get(f"{base}/metrics").text.splitlines()
    return {ln.split('"')[1]: int(ln.split()[-1]) for ln in lines if ln.startswith("k31jax_compiles_total{")}


def _complete(base: str, max_tokens: int = NEW, **kw) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=300,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **kw})


@pytest.fixture(scope="module")
def unsharded() -> dict[int, str]:
    """The unsharded engine's greedy text of PROMPT for each max_tokens the tests use."""
    lm = load_model(config="tiny")
    engine = Engine(lm.model, lm.tokenizer, max_len=MAX_LEN, prefill_chunk=CHUNK)
    # the long request below must run to its length, not stop early, for the queue to stay full
    long = engine.generate([Request(PROMPT, max_new_tokens=LONG)]).completions[0]
    assert len(long.tokens) == LONG and long.finish_reason == "length"
    return {n: engine.generate([Request(PROMPT, max_new_tokens=n)]).texts[0] for n in (2, NEW - 4, NEW)}


def test_cli_rejects_bad_sizes_and_processes_without_a_mesh(capsys):
    assert main(["serve", "--max-len", "1"]) == 2
    assert "--max-len 1: expected an integer >= 2" in capsys.readouterr().err
    assert main(["serve", "--default-max-tokens", "0"]) == 2
    assert "--default-max-tokens 0: expected an integer >= 1" in capsys.readouterr().err
    assert main(["serve", "--port", "-1"]) == 2
    assert "--port -1" in capsys.readouterr().err
    assert main(["serve", "--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1:1"]) == 2
    assert "needs --mesh" in capsys.readouterr().err


def test_mesh_on_8_cpu_devices_matches_unsharded_and_a_full_queue_answers_429(unsharded, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _serve(tmp_path / "serve.log", "--port", str(port), "--num-cpu-devices", "8", "--mesh", "expert=4,tensor=2",
                  "--max-batch", "1", "--max-queue", "1")
    try:
        _wait_healthy(proc, base)
        compiled = _compiles(base)
        r = _complete(base)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == unsharded[NEW]
        waiter: list[httpx.Response] = []
        with httpx.Client(timeout=300) as client:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
            with client.stream("POST", f"{base}/v1/completions", json=body) as holder:  # holds the one slot
                assert holder.status_code == 200
                thread = threading.Thread(target=lambda: waiter.append(_complete(base, 2)))
                thread.start()  # waits in the queue of one
                deadline = time.time() + 60
                while httpx.get(f"{base}/health").json()["queue_depth"] < 1:
                    assert time.time() < deadline, "the second request never reached the queue"
                    time.sleep(0.02)
                full = _complete(base, 2)
                assert full.status_code == 429, full.text
                assert full.headers["retry-after"] == "1"
                assert full.json()["error"]["type"] == "rate_limit_error"
            # the holder disconnected: its slot frees at the next step and the waiting request runs
            thread.join(120)
        assert waiter and waiter[0].status_code == 200
        assert waiter[0].json()["choices"][0]["text"] == unsharded[2]
        assert _compiles(base) == compiled  # the sharded programs compiled once, in warm-up
    finally:
        _stop(proc)


@pytest.mark.slow  # two sharded warm-ups (~1 min of CPU each); the follower test in test_serve_scheduler is the fast check
def test_two_processes_serve_one_sharded_batch(unsharded, tmp_path):
    port, coordinator = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    common = ("--port", str(port), "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2",
              "--num-cpu-devices", "2", "--cpu-collectives", "gloo", "--mesh", "expert=2,tensor=2",
              "--max-batch", "2")
    procs = [_serve(tmp_path / f"serve{i}.log", *common, "--process-id", str(i)) for i in range(2)]
    try:
        _wait_healthy(procs[0], base, procs[1:])
        results: list[httpx.Response] = [None, None]  # two requests at once: one batch on both processes

        def ask(i):
            results[i] = _complete(base, NEW - 4 * i)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for i, r in enumerate(results):
            assert r is not None and r.status_code == 200, r and r.text
            assert r.json()["choices"][0]["text"] == unsharded[NEW - 4 * i]
        # stopping process 0 stops the follower too (process 0 broadcasts the end); both exit cleanly
        assert _stop(procs[0], timeout=120) == 128 + signal.SIGTERM, _tail(procs[0])
        assert procs[1].wait(timeout=120) == 0, _tail(procs[1])
    finally:
        for p in procs:
            _stop(p)
