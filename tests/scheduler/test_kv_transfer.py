"""Prefill/decode disaggregation between two engines in one process, over NIXL itself (its UCX
backend moves host memory between agents): a prefill engine lends a prompt's KV, a decode
engine reads it and decodes exactly what one engine alone would, without computing the prompt.
Failures (an unreachable prefill pod, a refused handshake, an abort mid-read, a lease that runs
out) end in the configured policy, and no block is left behind on either side.
"""

from __future__ import annotations

import argparse
import time

import pytest
import torch
from scheduler_testkit import assert_idle, greedy

from tokenline.protocol import KVTransferParams, TokenOutput
from tokenline.scheduler.engine import Engine
from tokenline.scheduler.kv_transfer import pulls
from tokenline.scheduler.kv_transfer.config import KVTransferConfig, config_of
from tokenline.scheduler.refusals import InvalidRequest
from tokenline.settings.scheduler import KVTransferConfigText

pytest.importorskip("nixl_cu12._api", reason="NIXL is installed by `make .venv/.test`")

MAX_TOKENS = 12
LONG = (
    "The quick brown fox jumps over the lazy dog near the river in the morning light, and "
    "then it runs across the field, past the old mill and into the dark forest beyond."
)


def producer_config(**kw) -> KVTransferConfig:
    return KVTransferConfig(role="kv_producer", engine_id="prefill", side_channel_port=0, **kw)


def consumer_config(**kw) -> KVTransferConfig:
    return KVTransferConfig(role="kv_consumer", engine_id="decode", **kw)


def run(engine: Engine, uids: set[str], timeout_s: float = 20.0) -> dict[str, list[TokenOutput]]:
    """Step ``engine`` until each of ``uids`` has its terminal output (or a refusal)."""
    outputs: dict[str, list[TokenOutput]] = {uid: [] for uid in uids}
    ended: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while ended != uids:
        assert time.monotonic() < deadline, f"still waiting for {uids - ended}"
        for uid, error in engine.take_rejected():
            outputs[uid].append(TokenOutput(uid=uid, token_ids=[], error_code=error.code))
            ended.add(uid)
        if not engine.has_work():
            time.sleep(0.002)
            continue
        for out in engine.step():
            outputs[out.uid].append(out)
            if out.finish_reason is not None:
                ended.add(out.uid)
    return outputs


def tokens(outputs: list[TokenOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


@pytest.fixture(scope="module")
def producer(make_engine) -> Engine:
    engine = make_engine(kv_transfer=producer_config())
    yield engine
    engine.transfers.close()


@pytest.fixture(scope="module")
def consumer(make_engine) -> Engine:
    engine = make_engine(kv_transfer=consumer_config())
    yield engine
    engine.transfers.close()


def prefill(producer: Engine, uid: str, prompt: list[int]) -> KVTransferParams:
    """What the routing sidecar does first: the prompt on the prefill pod, max_tokens 1."""
    asked = KVTransferParams(do_remote_decode=True)
    producer.add(uid, prompt, greedy(1, kv_transfer=asked))
    (last,) = [o for o in run(producer, {uid})[uid] if o.finish_reason]
    assert last.kv_transfer is not None and last.kv_transfer.do_remote_prefill
    return last.kv_transfer


def settle(producer: Engine, timeout_s: float = 5.0) -> None:
    """Until the decode side's releases have reached the prefill engine."""
    deadline = time.monotonic() + timeout_s
    while producer.transfers.lending.loans and time.monotonic() < deadline:
        producer.expire()
        time.sleep(0.01)


def test_decode_reads_the_prompt_and_answers_as_one_engine(
    producer: Engine, consumer: Engine, make_engine, encode
) -> None:
    prompts = [encode(LONG), encode(LONG[:70]), encode("hello please " * 9)]
    alone = make_engine()
    for i, prompt in enumerate(prompts):
        alone.add(f"a{i}", prompt, greedy(MAX_TOKENS))
    expected = run(alone, {f"a{i}" for i in range(len(prompts))})
    read_before = consumer.transfers.pulls.bytes_read
    bs = consumer.pool.block_size
    for i, prompt in enumerate(prompts):
        params = prefill(producer, f"p{i}", prompt)
        full = (len(prompt) - 1) // bs
        assert len(params.remote_block_ids) == full >= 1
        assert producer.transfers.lending.held_blocks >= full
        lent = list(params.remote_block_ids)
        seq = consumer.add(f"d{i}", prompt, greedy(MAX_TOKENS, kv_transfer=params))
        got = run(consumer, {f"d{i}"})
        assert tokens(got[f"d{i}"]) == tokens(expected[f"a{i}"]), prompts[i]
        # the blocks came over byte for byte: those the decode engine cached under the
        # prompt's names hold the prefill engine's K/V
        local = consumer.pool.lookup(seq)[:full]  # its output's blocks are cached too
        assert len(local) == full
        for theirs, ours in zip(lent, local, strict=True):
            p = producer.runner.kv_cache[:, theirs * bs : (theirs + 1) * bs]
            c = consumer.runner.kv_cache[:, ours * bs : (ours + 1) * bs]
            assert torch.equal(p, c)
    assert consumer.transfers.pulls.bytes_read > read_before
    settle(producer)
    assert producer.transfers.lending.held_blocks == 0  # released once read
    assert_idle(producer)
    assert_idle(consumer)


def test_a_prefix_the_decode_engine_holds_is_not_read_again(
    producer: Engine, consumer: Engine, encode
) -> None:
    prompt = encode(LONG + " once more")
    consumer.add("warm", prompt, greedy(2))  # computed here: every full block cached
    run(consumer, {"warm"})
    read_before = consumer.transfers.pulls.bytes_read
    params = prefill(producer, "p-cached", prompt)
    consumer.add("d-cached", prompt, greedy(4, kv_transfer=params))
    run(consumer, {"d-cached"})
    assert consumer.transfers.pulls.bytes_read == read_before
    settle(producer)  # told at once that nothing will be read
    assert producer.transfers.lending.held_blocks == 0
    assert_idle(consumer)


def unreachable(prompt_len: int) -> KVTransferParams:
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="gone",
        remote_request_id="x",
        remote_block_ids=list(range(1, prompt_len)),
        remote_host="127.0.0.1",
        remote_port=1,  # nothing listens there
    )


def test_an_unreachable_prefill_pod_fails_or_recomputes(make_engine, encode, monkeypatch) -> None:
    monkeypatch.setattr(pulls, "HELLO_TIMEOUT_S", 1.0)  # the wait is the same, only shorter
    prompt = encode(LONG)
    failing = make_engine(kv_transfer=consumer_config())
    started = time.monotonic()
    failing.add("f", prompt, greedy(4, kv_transfer=unreachable(len(prompt))))
    (out,) = run(failing, {"f"})["f"]
    assert out.error_code == "kv_load_failed"
    assert time.monotonic() - started < 5
    assert failing.transfers.pulls.failures["unreachable"] == 1
    assert_idle(failing)
    failing.transfers.close()

    alone = make_engine()
    alone.add("a", prompt, greedy(4))
    expected = tokens(run(alone, {"a"})["a"])
    recomputing = make_engine(kv_transfer=consumer_config(failure_policy="recompute"))
    recomputing.add("r", prompt, greedy(4, kv_transfer=unreachable(len(prompt))))
    assert tokens(run(recomputing, {"r"})["r"]) == expected
    assert_idle(recomputing)
    recomputing.transfers.close()


def test_a_pod_of_another_layout_is_refused(producer: Engine, make_engine, encode) -> None:
    prompt = encode(LONG)
    params = prefill(producer, "p-bf16", prompt)
    other = make_engine(kv_transfer=consumer_config(), dtype="bfloat16")
    other.add("d-bf16", prompt, greedy(4, kv_transfer=params))
    (out,) = run(other, {"d-bf16"})["d-bf16"]
    assert out.error_code == "kv_load_failed"
    assert other.transfers.pulls.failures["refused"] == 1
    settle(producer)  # the refused reader still lets the prefill pod's blocks go
    assert producer.transfers.lending.held_blocks == 0
    assert_idle(other)
    other.transfers.close()


def test_an_abort_mid_read_frees_both_sides(producer: Engine, consumer: Engine, encode) -> None:
    prompt = encode(LONG + " and back")
    params = prefill(producer, "p-abort", prompt)
    consumer.add("d-abort", prompt, greedy(8, kv_transfer=params))
    assert consumer.abort("d-abort") is not None
    deadline = time.monotonic() + 5
    while consumer.transfers.pulls.busy() and time.monotonic() < deadline:
        consumer.step()
        time.sleep(0.005)
    consumer.step()
    settle(producer)
    assert producer.transfers.lending.held_blocks == 0
    assert_idle(consumer)


def test_an_unread_loan_ends_with_its_lease(make_engine, encode) -> None:
    lender = make_engine(kv_transfer=producer_config(lease_s=0.2))
    prefill(lender, "p-lease", encode(LONG))
    assert lender.transfers.lending.held_blocks > 0
    time.sleep(0.3)
    lender.expire()
    assert lender.transfers.lending.held_blocks == 0 and lender.transfers.lending.expired == 1
    assert_idle(lender)
    lender.transfers.close()


def test_requests_a_role_cannot_serve_are_refused(make_engine, producer: Engine, encode) -> None:
    plain = make_engine()
    asked = KVTransferParams(do_remote_decode=True)
    with pytest.raises(InvalidRequest, match="without --kv-transfer-config"):
        plain.add("x", encode("hi"), greedy(1, kv_transfer=asked))
    with pytest.raises(InvalidRequest, match="kv_consumer"):
        producer.add("y", encode("hi"), greedy(1, kv_transfer=unreachable(3)))
    with pytest.raises(InvalidRequest, match="remote_host"):
        decode = make_engine(kv_transfer=consumer_config())
        try:
            decode.add(
                "z", encode("hi"), greedy(1, kv_transfer=KVTransferParams(do_remote_prefill=True))
            )
        finally:
            decode.transfers.close()


def test_the_decode_engine_computes_only_the_last_block(
    producer: Engine, consumer: Engine, encode, monkeypatch
) -> None:
    """The read KV is what the decode engine attends to: its first chunk starts after the
    blocks it read, and K/V scrambled on the prefill side before the read changes the answer."""
    prompt = encode(LONG + " a third time")
    bs = consumer.pool.block_size
    starts: list[int] = []
    schedule = consumer.policy.schedule

    def recorded():
        chunks = schedule()
        starts.extend(c.start for c in chunks if c.seq.uid == "d-first" and not c.seq.output_ids)
        return chunks

    monkeypatch.setattr(consumer.policy, "schedule", recorded)
    params = prefill(producer, "p-first", prompt)
    consumer.add("d-first", prompt, greedy(MAX_TOKENS, kv_transfer=params))
    honest = tokens(run(consumer, {"d-first"})["d-first"])
    assert starts == [len(params.remote_block_ids) * bs]
    settle(producer)

    consumer.pool.clear_cache()  # so the next read is not served from this pod's cache
    params = prefill(producer, "p-scrambled", prompt)
    generator = torch.Generator().manual_seed(0)
    for block in params.remote_block_ids:
        rows = producer.runner.kv_cache[:, block * bs : (block + 1) * bs]
        rows.copy_(torch.randn(rows.shape, generator=generator) * 10)
    consumer.add("d-scrambled", prompt, greedy(MAX_TOKENS, kv_transfer=params))
    assert tokens(run(consumer, {"d-scrambled"})["d-scrambled"]) != honest
    settle(producer)
    producer.pool.clear_cache()  # its scrambled blocks must serve no later test
    assert_idle(consumer)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{", "not JSON"),
        ('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}', "NixlConnector"),
        ('{"kv_connector": "NixlConnector", "kv_role": "prefill"}', "kv_role"),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_rank": 1}', "kv_rank"),
        (
            '{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
            '"kv_load_failure_policy": "retry"}',
            "fail or recompute",
        ),
    ],
)
def test_the_flag_refuses_what_it_cannot_serve(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=None) as caught:
        KVTransferConfigText(text)
    assert says in str(caught.value)


def test_the_flag_reads_vllms_keys_and_environment() -> None:
    text = (
        '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", '
        '"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"lease_s": 9}}'
    )
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.7", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
    config = config_of(text, env)
    assert (config.role, config.failure_policy, config.lease_s) == ("kv_consumer", "recompute", 9)
    assert (config.side_channel_host, config.side_channel_port) == ("10.0.0.7", 5601)
    assert config.consumes and not config.produces
    assert config_of(None) is None
    default = config_of('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', {})
    assert default.failure_policy == "fail" and default.side_channel_port == 5600


def test_a_prefix_cached_on_the_prefill_side_is_lent_too(
    producer: Engine, consumer: Engine, make_engine, encode
) -> None:
    """The prefill engine's second request for a prompt is served from its prefix cache; the
    blocks it lends are those cached ones, shared, and read as well as fresh ones."""
    prompt = encode(LONG + " for the second time")
    prefill(producer, "p-once", prompt)
    settle(producer, timeout_s=0.2)  # nobody reads the first loan: it stays until its lease
    producer.transfers.lending.give_back("p-once")
    hits = producer.prefix_cache_hits
    params = prefill(producer, "p-twice", prompt)
    assert (
        producer.prefix_cache_hits - hits == len(params.remote_block_ids) * producer.pool.block_size
    )
    alone = make_engine()
    alone.add("a", prompt, greedy(MAX_TOKENS))
    consumer.pool.clear_cache()
    consumer.add("d-twice", prompt, greedy(MAX_TOKENS, kv_transfer=params))
    assert tokens(run(consumer, {"d-twice"})["d-twice"]) == tokens(run(alone, {"a"})["a"])
    settle(producer)
    assert producer.transfers.lending.held_blocks == 0
    assert_idle(producer)
    assert_idle(consumer)


def test_a_request_that_ends_where_it_is_admitted_leaves_no_block_held(
    producer: Engine, consumer: Engine, encode
) -> None:
    prompt = encode(LONG + " in one token")
    params = prefill(producer, "p-one", prompt)
    consumer.pool.clear_cache()
    consumer.add("d-one", prompt, greedy(1, kv_transfer=params))
    run(consumer, {"d-one"})
    consumer.expire()  # housekeeping, with no step to run
    settle(producer)
    assert_idle(consumer)


def test_a_read_the_lease_would_not_cover_is_not_started(make_engine, encode) -> None:
    """A lease that ends before a read could finish: the blocks may be another prompt's by
    then, so the read is refused (here: recomputed) rather than attempted."""
    prompt = encode(LONG + " too late")
    lender = make_engine(kv_transfer=producer_config(lease_s=0.5))
    reader = make_engine(kv_transfer=consumer_config(failure_policy="recompute"))
    try:
        params = prefill(lender, "p-late", prompt)
        assert params.remote_blocks_expiry_time is not None
        alone = make_engine()
        alone.add("a", prompt, greedy(4))
        reader.add("d-late", prompt, greedy(4, kv_transfer=params))
        assert tokens(run(reader, {"d-late"})["d-late"]) == tokens(run(alone, {"a"})["a"])
        assert reader.transfers.pulls.failures["expired"] == 1
        assert_idle(reader)
    finally:
        lender.transfers.close()
        reader.transfers.close()


def test_the_side_channel_outlives_messages_that_are_not_its_own(
    producer: Engine, consumer: Engine, encode
) -> None:
    import zmq

    address = producer.transfers.server.address
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.connect(address)
    stranger.send_multipart([b"one", b"two"])  # three frames at the ROUTER
    stranger.send(b"not msgpack of ours")
    stranger.close(linger=1000)
    time.sleep(0.3)
    assert producer.transfers.server._thread.is_alive()
    prompt = encode(LONG + " after the noise")
    params = prefill(producer, "p-noise", prompt)
    consumer.pool.clear_cache()
    consumer.add("d-noise", prompt, greedy(4, kv_transfer=params))
    assert tokens(run(consumer, {"d-noise"})["d-noise"])
    settle(producer)
    assert producer.transfers.lending.held_blocks == 0


def test_a_prefill_pod_restarted_at_the_same_address_is_asked_again(
    make_engine, consumer: Engine, encode
) -> None:
    """The decode side caches a pod's agent by address; another engine id there (a restart)
    makes it shake hands again instead of reading the old agent's memory."""
    prompt = encode(LONG + " restarted")
    first = make_engine(kv_transfer=producer_config())
    port = int(first.transfers.server.address.rsplit(":", 1)[1])
    params = prefill(first, "p-first-life", prompt)
    consumer.pool.clear_cache()
    consumer.add("d-first-life", prompt, greedy(4, kv_transfer=params))
    run(consumer, {"d-first-life"})
    first.transfers.close()
    generator = torch.Generator().manual_seed(3)  # the old pool now holds other K/V
    first.runner.kv_cache.copy_(torch.randn(first.runner.kv_cache.shape, generator=generator))
    second = make_engine(
        kv_transfer=KVTransferConfig(
            role="kv_producer", engine_id="prefill-2", side_channel_port=port
        )
    )
    try:
        alone = make_engine()
        alone.add("a", prompt, greedy(8))
        params = prefill(second, "p-second-life", prompt)
        consumer.pool.clear_cache()
        consumer.add("d-second-life", prompt, greedy(8, kv_transfer=params))
        got = tokens(run(consumer, {"d-second-life"})["d-second-life"])
        assert got == tokens(run(alone, {"a"})["a"])
    finally:
        second.transfers.close()
