"""`watch_peers` on three real processes (loopback coordinator) that run no collective at all,
as when a survivor compiles or waits in a checkpoint barrier: a killed process is named to every
survivor within seconds, and processes that leave in order, in any order, alarm no one."""

import signal
import subprocess
import sys
import time

import pytest

from helpers.processes import free_port, subprocess_env

PROCESSES = 3
# Each process enters the watch, says so, then stays the seconds it is given (or is killed).
WORKER = """
import os, sys, time
from k31jax import distributed
port, process, stay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
distributed.initialize(f"127.0.0.1:{port}", %d, process)
def lost(line):
    print("LOST", line, flush=True)
    os._exit(3)
with distributed.watch_peers(lost):
    print("WATCHING", flush=True)
    time.sleep(stay)
print("LEFT", flush=True)
""" % PROCESSES


def _start(stays: list[float]) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(i), str(stay)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=subprocess_env())
            for i, stay in enumerate(stays)]


def _all_watching(procs) -> None:
    for p in procs:
        line = p.stdout.readline()
        assert line.strip() == "WATCHING", (line, p.poll(), p.stderr.read()[-2000:] if p.poll() is not None else "")


def _finish(procs, timeout) -> list[tuple[int, str]]:
    try:
        return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("killed", [0, 2])
def test_a_killed_process_is_named_to_every_survivor_at_once(killed):
    procs = _start([120.0] * PROCESSES)
    _all_watching(procs)
    procs[killed].send_signal(signal.SIGKILL)
    killed_at = time.time()
    results = _finish([p for i, p in enumerate(procs) if i != killed], timeout=60)
    took = time.time() - killed_at
    assert took < 10, took  # the coordination service would take its 100 s heartbeat timeout
    for code, out in results:
        assert code == 3 and out.strip() == f"LOST process {killed} of {PROCESSES} stopped answering (its process ended)", \
            (code, out)


@pytest.mark.parametrize("stays", [[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]], ids=["process 0 first", "process 0 last"])
def test_processes_that_leave_in_order_alarm_no_one(stays):
    procs = _start(stays)
    _all_watching(procs)
    for code, out in _finish(procs, timeout=60):
        assert code == 0 and out.strip() == "LEFT", (code, out)
