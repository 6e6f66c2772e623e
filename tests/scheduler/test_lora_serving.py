"""Serving many adapters: a request whose adapter finds no free device slot waits and then
completes, adapters never share prefix-cache blocks, an unloaded adapter's requests in flight
finish, and the stage answers load/unload calls and unknown adapters as vLLM does."""

from __future__ import annotations

import time

import pytest
from lora_testkit import MAX_TOKENS, lora_engine, peft_model, reference_run, write_adapter
from scheduler_testkit import Drained, assert_idle, collect, drain, greedy

from tokenline import protocol
from tokenline.metrics import LORA_GENERATED_TOKENS, LORA_REQUESTS
from tokenline.scheduler.engine import UnknownModel
from tokenline.scheduler.kv_cache import STORED
from tokenline.scheduler.sequence import Status
from tokenline.scheduler.stage import SchedulerStage
from tokenline.stage_runtime import StageRuntime

# name → (rank, alpha, target modules, rslora)
SPECS = {
    "a": (4, 8, ["q_proj", "v_proj", "down_proj"], False),
    "b": (8, 8, ["k_proj", "o_proj", "gate_proj", "up_proj"], False),
    "big": (16, 16, ["q_proj"], False),  # rank above a max_rank of 8
}
PROMPT = (
    "The quick brown fox jumps over the lazy dog near the river in the morning light, "
    "and the dog jumps after it."
)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_source, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-loras")
    return {
        name: write_adapter(tiny_source.path, root / name, 10 + seed, *spec)
        for seed, (name, spec) in enumerate(SPECS.items())
    }


@pytest.fixture(scope="module")
def prompt(encode) -> list[int]:
    ids = encode(PROMPT)
    assert len(ids) > 32  # more than two full blocks of 16: something to share
    return ids


@pytest.fixture(scope="module")
def expected(tiny_source, adapter_dirs, prompt, eos_ids) -> dict[str, list[int]]:
    """PEFT's greedy tokens for the prompt, per adapter ("" is the base)."""
    tokens = {
        name: reference_run(peft_model(tiny_source, adapter_dirs.get(name)), prompt, eos_ids)[0]
        for name in ("", "a", "b")
    }
    assert len({tuple(t) for t in tokens.values()}) == 3  # each adapter changes the output
    return tokens


def two_adapters(adapter_dirs):
    return {name: adapter_dirs[name] for name in ("a", "b")}


def test_a_request_whose_adapter_has_no_free_slot_waits_then_completes(
    make_engine, adapter_dirs, prompt, expected
):
    engine = lora_engine(make_engine, two_adapters(adapter_dirs), max_loras=1)
    for name in ("a", "b", ""):
        for i in range(2):
            engine.add(f"{name or 'base'}{i}", prompt, greedy(MAX_TOKENS), lora=name)
    seen = collect(engine.step(), Drained())
    seqs = engine.policy.by_uid
    # a took the one slot; b waits without failing, and the base model needs no slot
    assert {seqs[u].status for u in ("a0", "a1", "base0", "base1")} == {Status.RUNNING}
    assert {seqs[u].status for u in ("b0", "b1")} == {Status.WAITING}
    assert engine.lora_usage() == (["a"], ["b"])
    run = drain(engine, into=seen)
    for name in ("a", "b", "base"):
        for i in range(2):
            assert run.tokens[f"{name}{i}"] == expected["" if name == "base" else name]
    assert engine.loras.slots == ["b"]  # stays resident for the next request
    assert_idle(engine)


def test_an_unknown_adapter_is_refused_as_model_not_found(make_engine, adapter_dirs, prompt):
    engine = lora_engine(make_engine, two_adapters(adapter_dirs))
    with pytest.raises(UnknownModel) as refused:
        engine.add("x", prompt, greedy(4), lora="nope")
    assert (refused.value.code, refused.value.http_status) == ("model_not_found", 404)
    plain = make_engine()  # LoRA off: any adapter name is unknown
    with pytest.raises(UnknownModel):
        plain.add("x", prompt, greedy(4), lora="a")


def test_adapters_never_share_prefix_cache_blocks(make_engine, adapter_dirs, prompt, expected):
    engine = lora_engine(make_engine, two_adapters(adapter_dirs))
    engine.pool.events = []
    cached = {}
    for uid, name in (("a0", "a"), ("a1", "a"), ("b0", "b"), ("base0", ""), ("base1", "")):
        engine.add(uid, prompt, greedy(MAX_TOKENS), lora=name)
        run = drain(engine)
        assert run.tokens[uid] == expected[name]
        cached[uid] = engine.pool.num_cached
    hits = engine.prefix_cache_hits
    full = (len(prompt) - 1) // engine.pool.block_size * engine.pool.block_size
    assert hits == 2 * full  # a1 reused a0's blocks, base1 base0's; b and base0 found none
    stored = [e for e in engine.pool.events if e[0] == STORED]
    assert {e[4] for e in stored} == {"a", "b", None}  # KV events name the adapter
    names = {name for e in stored for name in e[1]}
    assert len(names) == sum(len(e[1]) for e in stored)  # no block named twice


def test_unloading_an_adapter_lets_its_requests_in_flight_finish(
    make_engine, adapter_dirs, prompt, expected
):
    engine = lora_engine(make_engine, two_adapters(adapter_dirs), max_loras=1)
    engine.add("a0", prompt, greedy(MAX_TOKENS), lora="a")
    engine.add("b0", prompt, greedy(MAX_TOKENS), lora="b")  # waits for a's slot
    seen = collect(engine.step(), Drained())
    engine.loras.unload("a")
    assert engine.loras.names == ["b"]
    with pytest.raises(UnknownModel):
        engine.add("a1", prompt, greedy(4), lora="a")
    engine.loras.unload("b")  # b's request has not started: it finishes too
    run = drain(engine, into=seen)
    assert run.tokens == {"a0": expected["a"], "b0": expected["b"]}
    assert run.reasons["a0"] in ("stop", "length") and run.reasons["b0"] in ("stop", "length")
    assert engine.loras.uris == {} and engine.loras.slots == [None]  # gone with the last one
    assert_idle(engine)


def test_an_adapter_above_max_lora_rank_is_refused_clearly(make_engine, adapter_dirs):
    from tokenline.scheduler.lora.adapters import LoraError

    engine = lora_engine(make_engine, {}, max_rank=8)
    with pytest.raises(LoraError, match="greater than max_lora_rank 8"):
        engine.loras.add("big", str(adapter_dirs["big"]))
    assert engine.loras.names == []


def _stage(engine) -> tuple[SchedulerStage, StageRuntime, list]:
    sent: list = []
    handler = SchedulerStage(engine, "tiny")
    return handler, StageRuntime(handler, sent.append), sent


def test_the_stage_loads_and_unloads_adapters_and_reports_them(
    make_engine, adapter_dirs, prompt, tmp_path
):
    engine = lora_engine(make_engine, {}, max_loras=2, max_rank=8)
    handler, runtime, sent = _stage(engine)

    def call(action, name, uri=""):
        sent.clear()
        runtime.process([(time.monotonic(), protocol.LoraCall("c", action, name, uri))])
        (answer,) = sent
        return answer

    answer = call("load", "a", str(adapter_dirs["a"]))
    assert answer == protocol.LoraAnswer(uid="c", adapters=["a"])
    again = call("load", "a", str(adapter_dirs["a"]))
    assert isinstance(again, protocol.Failed) and again.http_status == 400
    assert "already been loaded" in again.message
    too_big = call("load", "big", str(adapter_dirs["big"]))
    assert too_big.http_status == 400 and "max_lora_rank" in too_big.message
    missing = call("load", "c", str(tmp_path / "nothing-here"))
    assert (missing.code, missing.http_status) == ("model_not_found", 404)
    unknown = call("unload", "zzz")
    assert (unknown.code, unknown.http_status) == ("model_not_found", 404)

    sent.clear()
    before = LORA_REQUESTS.labels(adapter="a")._value.get()
    tokens_before = LORA_GENERATED_TOKENS.labels(adapter="a")._value.get()
    request = protocol.Tokenized(
        uid="r1", prompt_ids=prompt, sampling=greedy(3, ignore_eos=True), timeout_s=30, lora="a"
    )
    runtime.process([(time.monotonic(), request)])
    status = handler.status()
    assert (status.max_loras, status.lora_adapters, status.lora_waiting) == (2, ["a"], ["a"])
    bad = protocol.Tokenized(
        uid="r2", prompt_ids=prompt, sampling=greedy(3), timeout_s=30, lora="nope"
    )
    runtime.process([(time.monotonic(), bad)])
    (failed,) = [m for m in sent if isinstance(m, protocol.Failed)]
    assert (failed.uid, failed.code, failed.http_status) == ("r2", "model_not_found", 404)
    while engine.has_work():
        runtime.step()
    assert LORA_REQUESTS.labels(adapter="a")._value.get() == before + 1
    assert LORA_GENERATED_TOKENS.labels(adapter="a")._value.get() == tokens_before + 3
    assert call("unload", "a") == protocol.LoraAnswer(uid="c", adapters=[])
    runtime.tick(force=True)  # gone: its series go too, or names loaded at runtime pile up
    series = {
        sample.labels.get("adapter")
        for metric in (LORA_REQUESTS, LORA_GENERATED_TOKENS)
        for family in metric.collect()
        for sample in family.samples
    }
    assert "a" not in series


def test_the_stage_without_lora_refuses_load_calls(make_engine):
    handler, runtime, sent = _stage(make_engine())
    runtime.process([(time.monotonic(), protocol.LoraCall("c", "load", "a", "/x"))])
    (answer,) = sent
    assert isinstance(answer, protocol.Failed) and "--enable-lora" in answer.message
    assert handler.status().max_loras == 0


def test_lora_modules_load_at_start(make_engine, adapter_dirs):
    from tokenline.scheduler.start import start_loras
    from tokenline.settings import Settings

    engine = lora_engine(make_engine, {})
    modules = [f"a={adapter_dirs['a']}", f"b={adapter_dirs['b']}"]
    assert start_loras(Settings(enable_lora=True, lora_modules=modules), engine) is None
    assert engine.loras.names == ["a", "b"]
    with pytest.raises(SystemExit, match="NAME=PATH_OR_URI"):
        start_loras(Settings(enable_lora=True, lora_modules=["no-uri"]), engine)


class Change:
    def __init__(self, action: str, name: str, uri: str) -> None:
        self.action, self.name, self.uri = action, name, uri


class ScriptedWatcher:
    """--lora-config's watcher as the stage uses it: each poll returns the next changes."""

    def __init__(self, *polls: list[Change]) -> None:
        self.polls = list(polls)

    def poll(self) -> list[Change]:
        return self.polls.pop(0) if self.polls else []


def test_lora_config_changes_apply_between_steps(make_engine, adapter_dirs, prompt, expected):
    engine = lora_engine(make_engine, {})
    a, b = str(adapter_dirs["a"]), str(adapter_dirs["b"])
    watcher = ScriptedWatcher(
        [Change("load", "x", a)],
        # the file now points x at b's files: unloaded, then loaded again once drained
        [Change("unload", "x", a), Change("load", "x", b), Change("load", "bad", "/nope")],
    )
    handler = SchedulerStage(engine, "tiny", lora_changes=watcher)
    handler.housekeeping(time.monotonic())
    assert engine.loras.names == ["x"]
    engine.add("r", prompt, greedy(MAX_TOKENS), lora="x")
    seen = collect(engine.step(), Drained())
    handler.housekeeping(time.monotonic())  # x drains behind r; "bad" is logged, not loaded
    assert engine.loras.names == [] and engine.loras.draining == {"x"}
    drain(engine, into=seen)
    assert seen.tokens["r"] == expected["a"]
    handler.housekeeping(time.monotonic())
    assert engine.loras.names == ["x"] and engine.loras.uris["x"] == b


def test_the_lora_config_file_drives_loads_and_unloads(make_engine, adapter_dirs, tmp_path):
    """--lora-config end to end in the stage: the operator's ConfigMap file, watched for real."""
    import json
    import os

    from tokenline.scheduler.start import start_loras
    from tokenline.settings import Settings

    config = tmp_path / "adapters.json"

    def write(adapters: dict[str, str], stamp: int) -> None:
        body = {"adapters": [{"name": n, "uri": str(u)} for n, u in adapters.items()]}
        config.write_text(json.dumps(body))
        os.utime(config, (stamp, stamp))  # a new mtime even within the clock's resolution

    write({"a": adapter_dirs["a"]}, 1_000)
    engine = lora_engine(make_engine, {})
    watcher = start_loras(Settings(enable_lora=True, lora_config=str(config)), engine)
    handler = SchedulerStage(engine, "tiny", lora_changes=watcher)
    handler.housekeeping(time.monotonic())
    assert engine.loras.names == ["a"]
    write({"b": adapter_dirs["b"]}, 2_000)
    handler.housekeeping(time.monotonic())
    assert engine.loras.names == ["b"]
    config.write_text("{not json")  # a bad file changes nothing
    os.utime(config, (3_000, 3_000))
    handler.housekeeping(time.monotonic())
    assert engine.loras.names == ["b"]
