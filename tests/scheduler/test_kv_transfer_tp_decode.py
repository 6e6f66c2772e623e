"""A tensor-parallel decode pod (TP=2 on gloo, one KV head a rank) reads a TP=1 prefill pod's
KV over real NIXL: each rank reads its own head into its own pool, rank 1 in its own process on
a thread of its own, and the pod answers as one TP=1 engine alone. The lent head a rank reads
is the one it decodes with: scrambled on the prefill side, the answer changes.

Rank 1's pool lives in its own process: its share is proven through what the pod decodes and
the bytes rank 1 says it read. How a read that fails on some ranks ends is driven with
stand-ins in test_kv_transfer_tp.py.
"""

from __future__ import annotations

import pytest
import torch
from kv_transfer_testkit import (
    LIMITS,
    LONG,
    MAX_TOKENS,
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

from tokenline.scheduler.engine import Engine

pytest.importorskip("nixl_cu12._api", reason="NIXL is installed by `make .venv/.test`")
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def driver(tiny_source):
    yield from tp2_group(tiny_source)


@pytest.fixture(scope="module")
def consumer(driver, eos_ids) -> Engine:
    yield from closing(Engine(driver.runner, LIMITS, eos_ids, True, kv_transfer=consumer_config()))


@pytest.fixture(scope="module")
def producer(make_engine) -> Engine:
    yield from closing(make_engine(kv_transfer=producer_config()))


def test_each_decode_rank_reads_its_own_head_and_the_pod_answers_as_one_engine(
    producer: Engine, consumer: Engine, make_engine, encode, monkeypatch
) -> None:
    assert consumer.runner.num_kv_heads == 1 == producer.runner.num_kv_heads // 2
    prompts = [encode(LONG), encode("hello please " * 9), encode("one two three " * 8)]
    alone = make_engine()
    for i, prompt in enumerate(prompts):
        alone.add(f"a{i}", prompt, greedy(MAX_TOKENS))
    expected = run(alone, {f"a{i}" for i in range(len(prompts))})
    read_before = consumer.transfers.pulls.bytes_read
    sent_before = producer.transfers.bytes_sent
    steps: list[int] = []  # the tokens each of the decode pod's steps computed
    execute = consumer.runner.execute

    def counted(inputs, *args):
        steps.append(sum(chunk.num_tokens for chunk in inputs.chunks))
        return execute(inputs, *args)

    monkeypatch.setattr(consumer.runner, "execute", counted)
    bs, blocks_read = consumer.pool.block_size, 0
    for i, prompt in enumerate(prompts):
        params = prefill(producer, f"p{i}", prompt)
        full = (len(prompt) - 1) // bs
        assert params.tp_size == 1 and len(params.remote_block_ids) == full >= 1
        steps.clear()
        seq = consumer.add(f"d{i}", prompt, greedy(MAX_TOKENS, kv_transfer=params))
        got = run(consumer, {f"d{i}"})
        assert tokens(got[f"d{i}"]) == tokens(expected[f"a{i}"]), prompts[i]
        # the prompt was read, not computed: only its last, partial block was
        assert steps[0] == len(prompt) - full * bs
        blocks_read += full
        # rank 0 holds K head 0 and V head 0 of the two the prefill pod lent, byte for byte
        local = consumer.pool.lookup(seq)[:full]
        for theirs, ours in zip(params.remote_block_ids, local, strict=True):
            lent = producer.runner.kv_cache[:, theirs * bs : (theirs + 1) * bs]
            read = consumer.runner.kv_cache[:, ours * bs : (ours + 1) * bs]
            assert torch.equal(read[:, :, 0], lent[:, :, 0])  # K head 0
            assert torch.equal(read[:, :, 1], lent[:, :, 2])  # V head 0
    # both ranks' halves, rank 1's as it said: every byte of every lent block
    read = consumer.transfers.pulls.bytes_read - read_before
    assert read == blocks_read * bs * producer.runner.bytes_per_token
    settle(producer)
    assert producer.transfers.lending.held_blocks == 0
    assert producer.transfers.bytes_sent - sent_before == read
    assert_idle(producer)
    assert_idle(consumer)
    assert_idle(alone)


def test_rank_1_decodes_with_the_head_it_read(
    producer: Engine, consumer: Engine, make_engine, encode
) -> None:
    """Scramble the lent KV head 1 (rank 1's) before the decode pod reads it: were rank 1 not
    reading, or reading another head, its answer would not change."""
    prompt = encode("a lighthouse keeper counts the ships " * 3)
    alone = make_engine()
    alone.add("a", prompt, greedy(MAX_TOKENS))
    expected = tokens(run(alone, {"a"})["a"])
    params = prefill(producer, "scrambled", prompt)
    heads = producer.runner.num_kv_heads
    generator = torch.Generator().manual_seed(0)
    for block in params.remote_block_ids:
        rows = producer.runner.kv_cache[:, block * 16 : (block + 1) * 16]
        assert producer.pool.block_size == 16
        for half in (1, heads + 1):  # K head 1, V head 1
            noise = torch.randn(rows[:, :, half].shape, generator=generator) * 50
            rows[:, :, half] = noise
    consumer.add("scrambled", prompt, greedy(MAX_TOKENS, kv_transfer=params))
    got = tokens(run(consumer, {"scrambled"})["scrambled"])
    assert got != expected
    settle(producer)
    # those blocks are cached on both sides under the prompt's names: leave neither behind
    assert producer.pool.clear_cache() and consumer.pool.clear_cache()
    assert_idle(producer)
    assert_idle(consumer)
    assert_idle(alone)
