"""Groups started apart from test_tensor_parallel's module-wide one (a process holds one
group at a time): a worker node joining from the command line, and idle workers outliving
the collective timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from scheduler_testkit import PROMPTS, drain, greedy
from test_tensor_parallel import LIMITS, RANKS, SERVICES, SINGLE, _run

from tokenline.scheduler.engine import Engine
from tokenline.scheduler.parallel.worker import start
from tokenline.scheduler.runner import ModelRunner


def test_a_worker_node_joins_the_leader_from_the_command_line(tiny_source, eos_ids, encode):
    """Two "nodes" on this machine: `tokenline scheduler --node-rank 1` (what a
    LeaderWorkerSet worker pod runs) holds rank 1; the leader holds rank 0 alone. The group
    gives TP=1's tokens, and the worker node exits 0 when the leader stops it."""
    from tokenline.scheduler.parallel.group import free_port

    port, metrics = free_port(), free_port()
    flags = ["--model", tiny_source.path, "--device", "cpu", "--dtype", "float32",
             "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
             "--master-addr", "127.0.0.1", "--master-port", str(port), "--kv-cache-memory",
             "4MiB", "--torch-threads", "1", "--metrics-port", str(metrics)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SERVICES)}
    node = subprocess.Popen([sys.executable, "-m", "tokenline.cli", "scheduler", *flags], env=env)
    try:
        deaths: list[str] = []
        driver = start(tiny_source, RANKS, 2, 60, deaths.append, master_port=port, local_ranks=1)
        prompts = {"a": encode(PROMPTS[0]), "b": encode(PROMPTS[1])}
        single = Engine(ModelRunner(tiny_source, SINGLE), LIMITS, eos_ids, True)
        expected, _ = _run(single, prompts)
        got, _ = _run(Engine(driver.runner, LIMITS, eos_ids, True), prompts)
        assert got.tokens == expected.tokens
        driver.close()
        assert node.wait(timeout=30) == 0
        assert not deaths
    finally:
        node.kill()
        node.wait()


def test_idle_workers_outlive_the_collective_timeout(tiny_source, eos_ids, encode):
    """An idle engine sends nothing; rank 0's heartbeat keeps the waiting worker inside its
    collective timeout, so a long idle spell is not mistaken for a dead rank."""
    deaths: list[str] = []
    # The timeout bounds the rendezvous too, where the spawned worker must have imported torch
    # and joined: 2 s was too short on a loaded 2-core machine.
    driver = start(tiny_source, RANKS, 2, timeout_s=6, on_death=deaths.append)
    try:
        time.sleep(15)  # idle for 2.5 timeouts
        engine = Engine(driver.runner, LIMITS, eos_ids, True)
        engine.add("late", encode(PROMPTS[0]), greedy(4))
        assert drain(engine).reasons["late"] in ("stop", "length")
        assert not deaths
    finally:
        driver.close()
