"""A tensor-parallel prefill pod (TP=2 on gloo, one KV head a rank) lends its prompts' KV to a
TP=1 decode pod over real NIXL: the decode pod reads each rank's heads into their places and
answers as one TP=1 engine alone (a TP=2 decode pod: test_kv_transfer_tp_decode.py); what
cannot be served (KV heads replicated across ranks, a multi-node group) is refused at start,
naming why.

The tests share a process group: the one that builds a group of its own runs first, before
the module's group is started (two groups cannot live in one process at once).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from kv_transfer_testkit import (
    LIMITS,
    LONG,
    MAX_TOKENS,
    RANKS,
    closing,
    consumer_config,
    prefill,
    producer_config,
    run,
    settle,
    tokens,
    tp2_group,
)
from scheduler_testkit import assert_idle, greedy

from tokenline import model_source, tiny_model
from tokenline.scheduler.engine import Engine
from tokenline.scheduler.kv_transfer import pulls
from tokenline.scheduler.kv_transfer.link import KVLayout, ReadPlan
from tokenline.scheduler.parallel.worker import start
from tokenline.scheduler.start import kv_transfer_config
from tokenline.settings import Settings

pytest.importorskip("nixl_cu12._api", reason="NIXL is installed by `make .venv/.test`")
pytestmark = pytest.mark.timeout(240)


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
    yield from tp2_group(tiny_source)


@pytest.fixture(scope="module")
def producer(driver, eos_ids) -> Engine:
    yield from closing(Engine(driver.runner, LIMITS, eos_ids, True, kv_transfer=producer_config()))


@pytest.fixture(scope="module")
def consumer(make_engine) -> Engine:
    yield from closing(make_engine(kv_transfer=consumer_config()))


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
    # a decode pod's ranks each read their own heads, from any even split of the same heads
    tp_reader = _layout(num_kv_heads=2, tp_size=2, kv_head_start=2, total_kv_heads=4)
    assert tp_reader.mismatch(_layout(num_kv_heads=2, tp_size=2, total_kv_heads=4)) == ""
    assert tp_reader.mismatch(reader) == ""
    assert tp_reader.mismatch(_layout(num_kv_heads=1, tp_size=4, total_kv_heads=4)) == ""
    replicated_reader = _layout(num_kv_heads=4, tp_size=2, total_kv_heads=4)
    assert "decode pod's 2 ranks do not split its 4 KV heads" in replicated_reader.mismatch(reader)


def test_a_reads_heads_are_those_both_ranks_hold() -> None:
    """A rank's slot rows are [K heads | V heads]: a decode rank holding heads 2-3 of 4 reads
    them from a TP=1 peer's rows at their offset, and nothing from a peer rank holding 0-1."""
    rows = _layout(num_kv_heads=4, tp_size=1, num_slots=64, base=1 << 20)
    rank1 = _layout(
        num_kv_heads=2, tp_size=2, kv_head_start=2, total_kv_heads=4, num_slots=32, base=1 << 30
    )
    assert rank1.heads == range(2, 4) and rows.heads == range(0, 4)
    head_bytes = 8 * 4  # head_dim 8 in float32
    runs = [(3, 5, 1)]  # our block 3 holds their block 5
    ours = rank1.head_descriptors(runs, 0, 0, 2)
    theirs = rows.head_descriptors(runs, 1, 2, 2)
    assert ours.shape == theirs.shape == (2 * 16 * 2, 3)  # layers x slots x (K, V)
    assert set(ours[:, 1]) == set(theirs[:, 1]) == {2 * head_bytes}
    # their first slot of block 5, layer 0: K heads 2-3 at 2 heads in, V heads 2-3 at 6 in
    slot = (1 << 20) + 5 * 16 * rows.row_bytes
    assert list(theirs[:2, 0]) == [slot + 2 * head_bytes, slot + 6 * head_bytes]
    mine = (1 << 30) + 3 * 16 * rank1.row_bytes
    assert list(ours[:2, 0]) == [mine, mine + 2 * head_bytes]


class _Link:
    """Rank 0's reads, as the worker thread calls them."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def read_all(self, plan: ReadPlan) -> int:
        if self.error is not None:
            raise self.error
        return 100


class _Ranks:
    """The other ranks of a tensor-parallel decode pod, their results given."""

    def __init__(self, results: list[tuple[int, str, str]]) -> None:
        self.results = results
        self.started: list[int] = []
        self.waited: list[int] = []

    def start_kv_reads(self, token: int, plan: ReadPlan) -> None:
        self.started.append(token)

    def wait_kv_reads(self, token: int, until: float) -> list[tuple[int, str, str]]:
        self.waited.append(token)
        return self.results


@pytest.mark.parametrize(
    ("rank0", "others", "outcome"),
    [
        (None, [(50, "", ""), (25, "", "")], 175),
        (None, [(50, "", ""), (0, "timeout", "slow")], "timeout"),
        (RuntimeError("peer gone"), [(0, "stuck", "no end")], "stuck"),
        (TimeoutError("late"), [(0, "transfer", "x"), (0, "stuck", "no end")], "stuck"),
        (RuntimeError("peer gone"), [(50, "", "")], "transfer"),
    ],
)
def test_a_read_ends_when_every_rank_has_and_says_the_worst_failure(
    rank0: Exception | None, others: list[tuple[int, str, str]], outcome: int | str
) -> None:
    ranks = _Ranks(others)
    reader = pulls.Pulls(None, consumer_config(), _Link(rank0), ranks)
    try:
        if isinstance(outcome, int):
            assert (
                reader._read_every_rank(ReadPlan([], [1], [2], time.monotonic() + 1.0)) == outcome
            )
        else:
            with pytest.raises(pulls.PullFailed) as failed:
                reader._read_every_rank(ReadPlan([], [1], [2], time.monotonic() + 1.0))
            assert failed.value.reason == outcome
        # the workers were asked, and waited for even when rank 0 failed: they write too
        assert ranks.started == ranks.waited == [0]
    finally:
        reader.close()


def _flag(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role})


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_the_flag_takes_every_role_at_tp2_on_one_node_only(role: str) -> None:
    settings = Settings(kv_transfer_config=_flag(role), tensor_parallel_size=2)
    config = kv_transfer_config(settings)
    assert config is not None and config.role == role
    settings = Settings(kv_transfer_config=_flag(role), tensor_parallel_size=2, nnodes=2)
    with pytest.raises(SystemExit, match="--nnodes above 1 is not served yet"):
        kv_transfer_config(settings)
