"""Tensor parallelism on gloo: two ranks give TP=1's greedy tokens and logits (within float32
rounding of a sum split in two), on the tiny model (2 KV heads, one per rank) and on a GQA
variant with 1 KV head (replicated on both ranks); under load with aborts nothing leaks; a
dead rank ends the stage fast."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from scheduler_testkit import PROMPTS, assert_idle, collect, drain, greedy

from tokenline import model_source, tiny_model
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.parallel.worker import RunnerArgs, start
from tokenline.scheduler.runner import ModelRunner

MiB = 2**20
MAX_TOKENS = 12
LIMITS = EngineLimits(tiny_model.MAX_POSITIONS, 256, 7)  # 7-token steps: prefill is chunked
SERVICES = Path(__file__).resolve().parents[2] / "services"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", params=[2, 1], ids=["kv2", "kv1"])
def source(request, tiny_source, tmp_path_factory):
    if request.param == 2:
        return tiny_source
    path = tiny_model.build(tmp_path_factory.mktemp("tiny-kv1"), num_key_value_heads=1)
    return model_source.resolve(str(path))


def _args(source) -> RunnerArgs:
    return RunnerArgs(source, device="cpu", dtype="float32", kv_cache_memory=4 * MiB,
                      torch_threads=1)  # fmt: skip


def _recording(engine: Engine) -> list[torch.Tensor]:
    """Every step's logits, as the engine's runner returns them."""
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def record(prepared, spans=()):
        logits, hidden = execute(prepared, spans)
        seen.append(logits.clone())
        return logits, hidden

    engine.runner.execute = record
    return seen


def _run(engine: Engine, prompts: dict[str, list[int]]):
    logits = _recording(engine)
    for uid, ids in prompts.items():
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True, prompt_logprobs=2))
    run = drain(engine)
    return run, logits


@pytest.fixture(scope="module")
def driver(source):
    deaths: list[str] = []
    d = start(_args(source), 2, timeout_s=60, on_death=deaths.append)
    yield d
    assert not deaths
    d.close()


def test_tp2_matches_tp1_tokens_and_logits(source, driver, encode, eos_ids):
    prompts = {f"p{i}": encode(text) for i, text in enumerate(PROMPTS)}
    single = Engine(ModelRunner(source, **_kw(source)), LIMITS, eos_ids, True)
    expected, expected_logits = _run(single, prompts)
    engine = Engine(driver.runner, LIMITS, eos_ids, True)
    runner = driver.runner
    assert runner.num_heads == 2 and runner.vocab_size == single.runner.vocab_size
    assert runner.num_kv_heads == 1  # kv2: one KV head each; kv1: the one head on both ranks
    got, logits = _run(engine, prompts)
    assert got.tokens == expected.tokens
    assert len(logits) == len(expected_logits)
    for mine, theirs in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert_idle(engine)


def _kw(source) -> dict:
    args = _args(source)
    return {"device": args.device, "dtype": args.dtype, "kv_cache_memory": 2 * MiB}


def test_concurrent_requests_with_aborts_leak_nothing(driver, encode, eos_ids):
    engine = Engine(driver.runner, LIMITS, eos_ids, True)
    uids = [f"c{i}" for i in range(8)]
    for i, uid in enumerate(uids):
        engine.add(uid, encode(PROMPTS[i % len(PROMPTS)]), greedy(MAX_TOKENS, ignore_eos=True))
    seen = collect(engine.step(), drain.__globals__["Drained"]())
    collect(engine.step(), seen)
    for uid in uids[::3]:  # mid-prefill or mid-decode
        engine.abort(uid)
    drain(engine, into=seen)
    assert set(seen.terminals) == set(uids)
    assert all(count == 1 for count in seen.terminals.values())
    assert {seen.reasons[u] for u in uids[::3]} == {"abort"}
    assert_idle(engine)
    driver.runner.release_decode_contexts()  # an idle engine's call, mirrored to the worker


_STAGE = textwrap.dedent(
    """
    import os, sys, time
    from tokenline import model_source
    from tokenline.scheduler.parallel.worker import RunnerArgs, start

    if __name__ == "__main__":
        source = model_source.resolve(sys.argv[1])
        args = RunnerArgs(source, device="cpu", dtype="float32", kv_cache_memory=2**21,
                          torch_threads=1)
        driver = start(args, 2, timeout_s=30)
        print("READY", driver.processes[0].pid, flush=True)
        time.sleep(120)
    """
)


def test_a_dead_worker_ends_the_stage_fast(tiny_source, tmp_path):
    script = tmp_path / "stage.py"
    script.write_text(_STAGE)
    env = {**os.environ, "PYTHONPATH": str(SERVICES)}
    stage = subprocess.Popen(
        [sys.executable, str(script), tiny_source.path], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        line = stage.stdout.readline()  # the model loads on both ranks first
        assert line.startswith("READY"), line
        worker = int(line.split()[1])
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        assert stage.wait(timeout=10) != 0
        assert time.monotonic() - killed < 5
    finally:
        stage.kill()
        stage.wait()


def test_a_dead_rank_0_ends_its_workers(tiny_source, tmp_path):
    script = tmp_path / "stage.py"
    script.write_text(_STAGE)
    env = {**os.environ, "PYTHONPATH": str(SERVICES)}
    stage = subprocess.Popen(
        [sys.executable, str(script), tiny_source.path], env=env, stdout=subprocess.PIPE, text=True
    )
    worker = None
    try:
        line = stage.stdout.readline()
        assert line.startswith("READY"), line
        worker = int(line.split()[1])
        stage.kill()  # SIGKILL: no exit handler stops the worker; its collective must fail
        stage.wait()
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        stage.kill()
        stage.wait()
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, reparented to init and not yet reaped, counts as
    gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False
