"""A tensor-parallel prefill pod (TP=2 on gloo, one KV head a rank) lends its prompts' KV to a
TP=1 decode pod over real NIXL: the decode pod reads each rank's heads into their places and
answers as one TP=1 engine alone; what cannot be served (a decode pod at TP > 1, KV heads
replicated across ranks, a multi-node group) is refused at start, naming why.

The tests share a process group: the one that builds a group of its own runs first, before
the module's group is started (two groups cannot live in one process at once).
"""

from __future__ import annotations

import json

import pytest
import torch
from scheduler_testkit import assert_idle, greedy
from test_kv_transfer import LONG, consumer_config, prefill, producer_config, run, settle, tokens

from tokenline import model_source, tiny_model
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.kv_transfer.link import KVLayout
from tokenline.scheduler.parallel.worker import start
from tokenline.scheduler.runner import RunnerOptions
from tokenline.scheduler.start import kv_transfer_config
from tokenline.settings import Settings

pytest.importorskip("nixl_cu12._api", reason="NIXL is installed by `make .venv/.test`")
pytestmark = pytest.mark.timeout(240)

MiB = 2**20
MAX_TOKENS = 12
RANKS = RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=4 * MiB, torch_threads=1)
LIMITS = EngineLimits(tiny_model.MAX_POSITIONS, 256, 2048)


def test_a_model_whose_kv_heads_the_ranks_replicate_lends_nothing(tmp_path, eos_ids) -> None:
    one_head = model_source.resolve(str(tiny_model.build(tmp_path, num_key_value_heads=1)))
    deaths: list[str] = []
    driver = start(one_head, RANKS, 2, timeout_s=60, on_death=deaths.append)
    try:
        with pytest.raises(SystemExit, match="replicated") as caught:
            Engine(driver.runner, LIMITS, eos_ids, True, kv_transfer=producer_config())
        assert "divides 1" in str(caught.value)
    finally:
        driver.close()
    assert not deaths  # the workers were never asked for their pools: still in step


@pytest.fixture(scope="module")
def driver(tiny_source):
    deaths: list[str] = []
    d = start(tiny_source, RANKS, 2, timeout_s=60, on_death=deaths.append)
    yield d
    assert not deaths
    d.close()


@pytest.fixture(scope="module")
def producer(driver, eos_ids) -> Engine:
    engine = Engine(driver.runner, LIMITS, eos_ids, True, kv_transfer=producer_config())
    yield engine
    engine.transfers.close()


@pytest.fixture(scope="module")
def consumer(make_engine) -> Engine:
    engine = make_engine(kv_transfer=consumer_config())
    yield engine
    engine.transfers.close()


def test_a_tp1_decode_pod_reads_every_ranks_heads_and_answers_as_one_engine(
    producer: Engine, consumer: Engine, make_engine, encode
) -> None:
    assert producer.runner.num_kv_heads == 1 == consumer.runner.num_kv_heads // 2
    # no two share a first block: each reads every full block of its prompt
    prompts = [encode(LONG), encode("hello please " * 9), encode("one two three " * 8)]
    alone = make_engine()
    alone_seqs = [alone.add(f"a{i}", p, greedy(MAX_TOKENS)) for i, p in enumerate(prompts)]
    expected = run(alone, {f"a{i}" for i in range(len(prompts))})
    read_before = consumer.transfers.pulls.bytes_read
    sent_before = producer.transfers.bytes_sent
    bs, heads = consumer.pool.block_size, consumer.runner.num_kv_heads
    blocks_read = 0
    for i, prompt in enumerate(prompts):
        params = prefill(producer, f"p{i}", prompt)
        assert params.tp_size == 2  # the answer says so, as vLLM's does
        full = (len(prompt) - 1) // bs
        assert len(params.remote_block_ids) == full >= 1
        seq = consumer.add(f"d{i}", prompt, greedy(MAX_TOKENS, kv_transfer=params))
        got = run(consumer, {f"d{i}"})
        assert tokens(got[f"d{i}"]) == tokens(expected[f"a{i}"]), prompts[i]
        blocks_read += full
        local = consumer.pool.lookup(seq)[:full]
        own = alone.pool.lookup(alone_seqs[i])[:full]
        assert len(local) == len(own) == full
        for theirs, ours, mine in zip(params.remote_block_ids, local, own, strict=True):
            read = consumer.runner.kv_cache[:, ours * bs : (ours + 1) * bs]
            # rank 0's one head, byte for byte: its K at K head 0, its V at V head 0
            rank0 = producer.runner.kv_cache[:, theirs * bs : (theirs + 1) * bs]
            assert torch.equal(read[:, :, 0], rank0[:, :, 0])
            assert torch.equal(read[:, :, heads], rank0[:, :, 1])
            # rank 1's pool lives in its own process: every head, K and V, is the one a
            # TP=1 engine computes for the same prompt (float32, a sum split in two)
            computed = alone.runner.kv_cache[:, mine * bs : (mine + 1) * bs]
            torch.testing.assert_close(read, computed, rtol=1e-5, atol=1e-5)
            assert not torch.equal(read[:, :, 1], read[:, :, 0])  # two heads, not one twice
    read = consumer.transfers.pulls.bytes_read - read_before
    assert read == blocks_read * bs * consumer.runner.bytes_per_token  # both ranks' halves
    settle(producer)
    assert producer.transfers.lending.held_blocks == 0  # released once every rank was read
    assert producer.transfers.bytes_sent - sent_before == read
    assert producer.lent_uids() == [] and consumer.lent_uids() == []
    assert_idle(producer)
    assert_idle(consumer)
    assert_idle(alone)


def test_a_tensor_parallel_pod_does_not_read(driver, eos_ids) -> None:
    with pytest.raises(SystemExit, match="each decode rank would have to read"):
        Engine(driver.runner, LIMITS, eos_ids, True, kv_transfer=consumer_config())


def _layout(**kw) -> KVLayout:
    fields = dict(model="m", dtype="torch.float32", block_size=16, num_layers=2, head_dim=8)
    return KVLayout(**{**fields, **kw})


def test_the_handshake_takes_an_even_split_into_tp1_and_refuses_the_rest() -> None:
    reader = _layout(num_kv_heads=4, tp_size=1)
    for rank in range(2):
        share = _layout(num_kv_heads=2, tp_size=2, kv_head_start=2 * rank, total_kv_heads=4)
        assert reader.mismatch(share) == ""
    assert reader.mismatch(_layout(num_kv_heads=4, tp_size=1)) == ""
    replicated = _layout(num_kv_heads=4, tp_size=2, total_kv_heads=4)
    assert "do not split its 4 KV heads evenly" in reader.mismatch(replicated)
    other_model = _layout(num_kv_heads=4, tp_size=2, total_kv_heads=8)
    assert "num_kv_heads differs: 8 there, 4 here" in reader.mismatch(other_model)
    tp_reader = _layout(num_kv_heads=2, tp_size=2, total_kv_heads=4)
    share = _layout(num_kv_heads=2, tp_size=2, total_kv_heads=4)
    assert "reads KV only at TP 1" in tp_reader.mismatch(share)
    assert "reads KV only at TP 1" in tp_reader.mismatch(reader)


def _flag(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role})


@pytest.mark.parametrize(
    ("role", "nnodes", "says"),
    [
        ("kv_consumer", 1, "each decode rank would have to read its own share"),
        ("kv_both", 1, "each decode rank would have to read its own share"),
        ("kv_producer", 2, "--nnodes above 1 is not served yet"),
    ],
)
def test_the_flag_refuses_at_tp2_what_is_not_served(role: str, nnodes: int, says: str) -> None:
    settings = Settings(kv_transfer_config=_flag(role), tensor_parallel_size=2, nnodes=nnodes)
    with pytest.raises(SystemExit, match=says):
        kv_transfer_config(settings)


def test_the_flag_takes_a_tp2_prefill_pod() -> None:
    settings = Settings(kv_transfer_config=_flag("kv_producer"), tensor_parallel_size=2)
    config = kv_transfer_config(settings)
    assert config is not None and config.produces and not config.consumes
