"""Tensor parallelism on gloo: two ranks give TP=1's greedy tokens and logits (within float32
rounding of a sum split in two), on the tiny model (2 KV heads, one per rank) and on a GQA
variant with 1 KV head (replicated on both ranks); under load with aborts nothing leaks; a
dead rank ends the stage fast."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from scheduler_testkit import (
    COMMON,
    GEMMA,
    MOE,
    PROMPTS,
    Drained,
    assert_idle,
    collect,
    drain,
    greedy,
)

from tokenline import model_source, tiny_model
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.parallel.worker import start
from tokenline.scheduler.runner import ModelRunner, RunnerOptions
from tokenline.scheduler.speculative.config import SpeculativeConfig

MiB = 2**20
MAX_TOKENS = 12
LIMITS = EngineLimits(tiny_model.MAX_POSITIONS, 256, 7)  # 7-token steps: prefill is chunked
SERVICES = Path(__file__).resolve().parents[2] / "services"

pytestmark = pytest.mark.timeout(240)


# Qwen2: q/k/v biases, and a vocabulary (301) that two ranks split unevenly (one pad row);
# Qwen3: per-head q and k norms, head_dim apart from hidden / heads; Qwen3-MoE and Mixtral: every
# expert's intermediate dimension split across the ranks; Gemma 3: scaled embeddings, four norms
# per layer, sliding and full layers, soft-capped logits gathered from two vocabulary halves.
FAMILIES = {
    "qwen2-odd-vocab": ("Qwen2Config", "Qwen2ForCausalLM", {"vocab_size": 301}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3-moe": MOE["qwen3-moe"],
    "mixtral": MOE["mixtral"],
    "gemma3": GEMMA["gemma3"],
}


@pytest.fixture(scope="module", params=["kv2", "kv1", *FAMILIES])
def source(request, tiny_source, tmp_path_factory):
    if request.param == "kv2":
        return tiny_source
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "kv1":
        return model_source.resolve(str(tiny_model.build(path, num_key_value_heads=1)))
    import transformers

    config_name, model_name, extra = FAMILIES[request.param]
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # larger weights, so that a wrong shard changes greedy tokens
        for param in model.parameters():
            param.mul_(3.0)
    model.save_pretrained(path)
    return model_source.resolve(str(path))


# every rank's runner, and the one-device runner they are compared with
RANKS = RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=4 * MiB, torch_threads=1)
SINGLE = RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=2 * MiB)


def _recording(engine: Engine) -> list[torch.Tensor]:
    """Every step's logits, as the engine's runner returns them."""
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def record(inputs, spans=()):
        logits, hidden = execute(inputs, spans)
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
    d = start(source, RANKS, 2, timeout_s=60, on_death=deaths.append)
    yield d
    assert not deaths
    d.close()


def test_tp2_matches_tp1_tokens_and_logits(source, driver, encode, eos_ids):
    single = Engine(ModelRunner(source, SINGLE), LIMITS, eos_ids, True)
    vocab = single.runner.vocab_size
    prompts = {f"p{i}": [t % vocab for t in encode(text)] for i, text in enumerate(PROMPTS)}
    expected, expected_logits = _run(single, prompts)
    engine = Engine(driver.runner, LIMITS, eos_ids, True)
    runner = driver.runner
    assert runner.num_heads == single.runner.num_heads // 2
    assert runner.vocab_size == vocab  # the logits are whole again
    # 2 KV heads: one each; 1 KV head: the one head on both ranks
    assert runner.num_kv_heads == max(1, single.runner.num_kv_heads // 2)
    # the shard was loaded as a shard: half the rows of q and of the MLP, half the vocabulary
    mine, whole = runner.model.model.layers[0], single.runner.model.model.layers[0]
    assert mine.self_attn.o_proj.weight.numel() * 2 == whole.self_attn.o_proj.weight.numel()
    down = "experts.w2" if hasattr(mine.mlp, "experts") else "down_proj.weight"
    assert mine.mlp.get_parameter(down).numel() * 2 == whole.mlp.get_parameter(down).numel()
    assert runner.model.model.embed_tokens.weight.shape[0] == -(-vocab // 2)
    got, logits = _run(engine, prompts)
    assert got.tokens == expected.tokens
    assert len(logits) == len(expected_logits)
    for mine, theirs in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert_idle(engine)


@pytest.mark.parametrize("source", ["kv2"], indirect=True)  # above the forward: one family
def test_tp2_with_speculation_matches_tp1(source, driver, encode, eos_ids):
    """Verified chunks (several rows a sequence, right and wrong guesses) run on both ranks:
    TP=2 with speculation gives TP=1's tokens."""
    single = Engine(ModelRunner(source, SINGLE), LIMITS, eos_ids, True)
    prompts = {f"s{i}": encode(text) for i, text in enumerate(PROMPTS)}
    sampling = greedy(MAX_TOKENS, ignore_eos=True)
    for uid, ids in prompts.items():
        single.add(uid, ids, sampling)
    expected = drain(single).tokens

    class Alternating:  # the right continuation on even steps, a wrong one on odd steps
        calls = 0

        def propose(self, seq, limit):
            Alternating.calls += 1
            done = len(seq.output_ids)
            guess = expected[seq.uid][done : done + min(limit, 3)]
            return guess if Alternating.calls % 2 else [(t + 1) % 256 for t in guess]

    engine = Engine(
        driver.runner, LIMITS, eos_ids, True, speculative=SpeculativeConfig("ngram", 3, 1, 3)
    )
    engine.policy.proposer = Alternating()
    for uid, ids in prompts.items():
        engine.add(uid, ids, sampling)
    assert drain(engine).tokens == expected
    taken = engine.acceptance
    assert 0 < taken.accepted_tokens < taken.draft_tokens
    assert_idle(engine)


def _proposals(engine: Engine) -> list[tuple[str, int, list[int]]]:
    """Each proposal the engine's proposer makes: the sequence, its length then, the guesses."""
    seen: list[tuple[str, int, list[int]]] = []
    proposer = engine.policy.proposer
    propose = proposer.propose

    def record(seq, limit):
        guesses = propose(seq, limit)
        seen.append((seq.uid, seq.num_tokens, list(guesses)))
        return guesses

    proposer.propose = record
    return seen


def _speculating(runner, prompts, eos_ids, config: SpeculativeConfig, biased: set[str]):
    engine = Engine(runner, LIMITS, eos_ids, True, speculative=config)
    proposals = _proposals(engine)
    bias = {t: 50.0 for t in FAVOURITES}
    for uid, ids in prompts.items():
        extra = {"logit_bias": bias} if uid in biased else {}
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True, **extra))
    run = drain(engine)
    assert_idle(engine)
    return engine, run.tokens, proposals


FAVOURITES = (100, 200)  # biased requests emit one of these at every step


@pytest.mark.parametrize("source", ["kv2", "qwen2-odd-vocab"], indirect=True)
@pytest.mark.parametrize("borrows", ["embedding", "embedding-and-lm-head"])
def test_tp2_with_an_eagle3_head_matches_tp1(
    source, tiny_source, driver, encode, eos_ids, tmp_path, borrows
):
    """Only rank 0 runs the head, over its own copy of the residual stream (whole on every
    rank) and whole copies of the vocabulary rows the head borrows from the target (each rank
    holds a slice): TP=2 makes TP=1's guesses and gives TP=1's tokens."""
    from eagle3_oracle import write_head
    from safetensors.torch import load_file, save_file

    config = json.loads((Path(source.path) / "config.json").read_text())
    vocab = config["vocab_size"]
    layers = config["num_hidden_layers"]
    aux = (1, 2, 3) if layers > 4 else tuple(range(layers))  # 2-layer families: both
    if borrows == "embedding":  # two draft tokens, the favourites: right about half the time
        d2t = torch.tensor(FAVOURITES) - torch.arange(2)
        head = write_head(
            tmp_path / "head", config, draft_vocab=2, d2t=d2t, seed=3, aux=aux, fc_inputs=len(aux)
        )
    else:  # the target's vocabulary, and no lm_head of its own: it borrows the target's
        head = write_head(
            tmp_path / "head", config, draft_vocab=vocab, seed=3, aux=aux, fc_inputs=len(aux)
        )
        weights = load_file(head / "model.safetensors")
        del weights["lm_head.weight"]
        save_file(weights, str(head / "model.safetensors"))
    spec = SpeculativeConfig("eagle3", 3, 1, 3, model=str(head))
    prompts = {f"e{i}": [t % vocab for t in encode(text)] for i, text in enumerate(PROMPTS)}
    biased = {"e1", "e4"}
    single = ModelRunner(source, SINGLE)
    _, expected, expected_proposals = _speculating(single, prompts, eos_ids, spec, biased)
    runner = driver.runner
    try:
        engine, got, proposals = _speculating(runner, prompts, eos_ids, spec, biased)
    finally:  # the driver serves the module's other tests: nothing kept past this one
        runner.aux_sink, runner.model.aux_layers = None, ()
    assert got == expected
    assert proposals == expected_proposals
    assert sum(len(guesses) for _, _, guesses in proposals) > 0
    if borrows == "embedding" and source.path == tiny_source.path:  # guesses right and wrong
        assert 0 < engine.acceptance.accepted_tokens < engine.acceptance.draft_tokens


@pytest.mark.parametrize("source", ["kv2"], indirect=True)
def test_tp2_with_a_draft_model_matches_tp1(source, driver, encode, eos_ids):
    """The draft model runs whole beside rank 0's shard: the target as its own draft guesses
    right, and TP=2 gives TP=1's tokens."""
    prompts = {f"d{i}": encode(text) for i, text in enumerate(PROMPTS)}
    spec = SpeculativeConfig("draft_model", 3, 1, 3, model=source.path)
    single = ModelRunner(source, SINGLE)
    _, expected, expected_proposals = _speculating(single, prompts, eos_ids, spec, set())
    engine, got, proposals = _speculating(driver.runner, prompts, eos_ids, spec, set())
    assert got == expected
    assert proposals == expected_proposals
    taken = engine.acceptance
    assert taken.drafts > 0
    assert taken.accepted_tokens >= 0.9 * taken.draft_tokens
    engine.policy.proposer.prune()
    assert engine.policy.proposer.pool.num_referenced == 0


_FLEX = textwrap.dedent(
    """
    import sys
    from dataclasses import replace
    import torch
    from tokenline import model_source
    from tokenline.protocol import SamplingParams
    from tokenline.scheduler.engine import Engine, EngineLimits
    from tokenline.scheduler.parallel.worker import start
    from tokenline.scheduler.runner import ModelRunner, RunnerOptions

    def run(runner):
        engine = Engine(runner, EngineLimits(256, 256, 7), [])
        logits, execute = [], runner.execute
        def record(inputs, spans=()):
            out = execute(inputs, spans)
            logits.append(out[0].clone())
            return out
        runner.execute = record
        for i in range(4):
            ids = [(7 * i + 3 * j) % 250 + 5 for j in range(6 + 5 * i)]
            engine.add(f"p{i}", ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        tokens = {}
        while engine.has_work():
            for out in engine.step():
                tokens.setdefault(out.uid, []).extend(out.token_ids)
        return tokens, logits

    if __name__ == "__main__":
        source = model_source.resolve(sys.argv[1])
        options = RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=2**21)
        single = ModelRunner(source, replace(options, attention_backend="sdpa"))
        expected, expected_logits = run(single)
        ranks = replace(options, torch_threads=1, attention_backend="flex")
        driver = start(source, ranks, 2, timeout_s=60)
        assert driver.runner.attention.name == "flex"
        got, logits = run(driver.runner)
        driver.close()
        assert got == expected, (got, expected)
        for mine, theirs in zip(logits, expected_logits, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
        print("MATCH", flush=True)
    """
)


def test_tp2_with_flex_attention_matches_tp1(tiny_source, tmp_path):
    """Each rank reads its own KV heads of the pool in place: the flex backend at TP=2 gives
    TP=1's tokens and logits (in a process of its own: this one holds the fixture's group)."""
    script = tmp_path / "flex.py"
    script.write_text(_FLEX)
    env = {**os.environ, "PYTHONPATH": str(SERVICES)}
    done = subprocess.run(
        [sys.executable, str(script), tiny_source.path],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0 and "MATCH" in done.stdout, done.stderr[-3000:]


def test_concurrent_requests_with_aborts_leak_nothing(driver, encode, eos_ids):
    engine = Engine(driver.runner, LIMITS, eos_ids, True)
    vocab = driver.runner.vocab_size
    uids = [f"c{i}" for i in range(8)]
    for i, uid in enumerate(uids):
        ids = [t % vocab for t in encode(PROMPTS[i % len(PROMPTS)])]
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True))
    seen = collect(engine.step(), Drained())
    collect(engine.step(), seen)
    for uid in uids[::3]:  # mid-prefill or mid-decode
        engine.abort(uid)
    drain(engine, into=seen)
    assert set(seen.terminals) == set(uids)
    assert all(count == 1 for count in seen.terminals.values())
    assert {seen.reasons[u] for u in uids[::3]} == {"abort"}
    assert_idle(engine)
    driver.runner.release_decode_contexts()  # an idle engine's call, mirrored to the worker


def test_rank_0_exports_every_rank_s_step_and_collective_time(driver):
    from prometheus_client import REGISTRY

    for rank in ("0", "1"):
        for name in ("tokenline_collective_seconds", "tokenline_tp_rank_step_seconds"):
            count = REGISTRY.get_sample_value(f"{name}_count", {"rank": rank})
            assert count and count > 0, (name, rank)


_STAGE = textwrap.dedent(
    """
    import os, sys, time
    from tokenline import model_source
    from tokenline.scheduler.parallel.worker import start
    from tokenline.scheduler.runner import RunnerOptions

    if __name__ == "__main__":
        source = model_source.resolve(sys.argv[1])
        options = RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=2**21,
                                torch_threads=1)
        driver = start(source, options, 2, timeout_s=30)
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


def _place(rank: int, world: int):
    from types import SimpleNamespace

    from tokenline.scheduler.layers.placement import Placement

    rank_of = SimpleNamespace(rank=rank, world_size=world, is_driver=rank == 0)
    return Placement(torch.device("cpu"), torch.float32, rank_of)


@pytest.mark.parametrize(
    ("world", "kv_heads", "starts"),
    [(2, 2, [0, 1]), (4, 2, [0, 0, 1, 1]), (2, 1, [0, 0]), (4, 8, [0, 2, 4, 6])],
)
def test_each_rank_reads_the_kv_heads_its_query_heads_need(world, kv_heads, starts):
    """With fewer KV heads than ranks, rank r's query heads (r * H/N ...) belong to KV head
    r // (N / KV) in GQA's grouping, and that is the head it holds."""
    from tokenline.scheduler.layers.embedding import VocabEmbedding
    from tokenline.scheduler.layers.linear import QKVLinear

    ranks = [QKVLinear(64, 8, kv_heads, 16, False, _place(r, world)) for r in range(world)]
    assert [qkv.kv_start for qkv in ranks] == starts
    for rank, qkv in enumerate(ranks):  # query head q reads KV head q // (8 / kv_heads)
        first_query = rank * qkv.num_heads
        assert first_query // (8 // kv_heads) in range(
            qkv.kv_start, qkv.kv_start + qkv.num_kv_heads
        )
    embeddings = [VocabEmbedding(301, 8, _place(r, world)) for r in range(world)]
    assert sum(min(e.local, 301 - e.start) for e in embeddings) == 301


def test_sizes_the_ranks_cannot_split_are_refused():
    from tokenline.scheduler.layers.linear import QKVLinear
    from tokenline.scheduler.layers.mlp import GatedMLP
    from tokenline.scheduler.layers.moe import Experts
    from tokenline.scheduler.layers.placement import ModelRefused

    with pytest.raises(ModelRefused, match=r"attention heads \(3\)"):
        QKVLinear(64, 3, 3, 16, False, _place(0, 2))
    with pytest.raises(ModelRefused, match="3 KV heads"):
        QKVLinear(64, 12, 3, 16, False, _place(0, 4))
    with pytest.raises(ModelRefused, match=r"MLP width \(66\)"):
        GatedMLP(64, 66, "silu", _place(0, 4))
    with pytest.raises(ModelRefused, match=r"experts' intermediate size \(30\)"):
        Experts(8, 64, 30, "silu", _place(0, 4))
