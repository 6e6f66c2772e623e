"""Prefill/decode disaggregation between two engines in one process, over NIXL itself (its UCX
backend moves host memory between agents): a prefill engine lends a prompt's KV, a decode
engine reads it and decodes exactly what one engine alone would, without computing the prompt.
Failures (an unreachable prefill pod, a refused handshake, an abort mid-read, a lease that runs
out) end in the configured policy, and no block is left behind on either side.
"""

from __future__ import annotations

import argparse
import resource
import threading
import time

import msgspec
import pytest
import torch
from kv_transfer_testkit import (
    LONG,
    MAX_TOKENS,
    closing,
    consumer_config,
    prefill,
    producer_config,
    run,
    settle,
    tokens,
)
from scheduler_testkit import assert_idle, greedy

from tokenline.protocol import KVTransferParams
from tokenline.scheduler.engine import Engine
from tokenline.scheduler.kv_transfer import pulls
from tokenline.scheduler.kv_transfer.config import KVTransferConfig, config_of
from tokenline.scheduler.kv_transfer.ledger import PIN_GRACE_S, Ledger, Loan, prefix_digest
from tokenline.scheduler.kv_transfer.link import NixlLink
from tokenline.scheduler.kv_transfer.side_channel import Claim, Release
from tokenline.scheduler.refusals import InvalidRequest
from tokenline.settings.scheduler import KVTransferConfigText

pytest.importorskip("nixl_cu12._api", reason="NIXL is installed by `make .venv/.test`")


@pytest.fixture(scope="module")
def producer(make_engine) -> Engine:
    yield from closing(make_engine(kv_transfer=producer_config()))


@pytest.fixture(scope="module")
def consumer(make_engine) -> Engine:
    yield from closing(make_engine(kv_transfer=consumer_config()))


def test_decode_reads_the_prompt_and_answers_as_one_engine(
    producer: Engine, consumer: Engine, make_engine, encode
) -> None:
    prompts = [encode(LONG), encode(LONG[:70]), encode("hello please " * 9)]
    alone = make_engine()
    for i, prompt in enumerate(prompts):
        alone.add(f"a{i}", prompt, greedy(MAX_TOKENS))
    expected = run(alone, {f"a{i}" for i in range(len(prompts))})
    read_before = consumer.transfers.pulls.bytes_read
    sent_before = producer.transfers.bytes_sent
    bs = consumer.pool.block_size
    for i, prompt in enumerate(prompts):
        params = prefill(producer, f"p{i}", prompt)
        full = (len(prompt) - 1) // bs
        assert len(params.remote_block_ids) == full >= 1
        assert producer.transfers.lending.held_blocks >= full
        assert f"p{i}" in producer.lent_uids()  # a drain waits for it
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
    assert producer.lent_uids() == [] and consumer.lent_uids() == []
    read = consumer.transfers.pulls.bytes_read - read_before
    assert producer.transfers.bytes_sent - sent_before == read  # as the reader said
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


def test_a_read_after_the_lease_ended_is_refused_whatever_the_params_say(
    make_engine, encode
) -> None:
    """The prefill pod's own clock decides: a lease that has ended is not read, though the
    loan is not yet freed and the params (forged, or a skewed clock) promise an hour more. The
    blocks may be another prompt's by then, so the read is refused (here: recomputed)."""
    prompt = encode(LONG + " too late")
    lender = make_engine(kv_transfer=producer_config(lease_s=0.3))
    reader = make_engine(kv_transfer=consumer_config(failure_policy="recompute"))
    try:
        params = prefill(lender, "p-late", prompt)
        params = msgspec.structs.replace(params, remote_blocks_expiry_time=time.time() + 3600)
        time.sleep(0.4)
        assert lender.transfers.lending.held_blocks > 0  # past its lease, not yet freed
        alone = make_engine()
        alone.add("a", prompt, greedy(4))
        reader.add("d-late", prompt, greedy(4, kv_transfer=params))
        assert tokens(run(reader, {"d-late"})["d-late"]) == tokens(run(alone, {"a"})["a"])
        assert reader.transfers.pulls.failures["expired"] == 1
        assert reader.transfers.pulls.bytes_read == 0
        lender.expire()
        assert lender.transfers.lending.expired == 1
        assert_idle(lender)
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


def two_loans(
    producer: Engine, encode, tag: str
) -> tuple[list[int], KVTransferParams, list[int], KVTransferParams]:
    """Two prompts of one length lent at once: (ours, our params, another's, its params)."""
    victim = encode(LONG + f" {tag}, the victim's")
    ours = (encode(f"{tag}: a different prompt altogether, hello there. ") * 8)[: len(victim)]
    their_params = prefill(producer, f"p-{tag}-victim", victim)
    our_params = prefill(producer, f"p-{tag}-ours", ours)
    assert len(our_params.remote_block_ids) == len(their_params.remote_block_ids) >= 2
    assert not set(our_params.remote_block_ids) & set(their_params.remote_block_ids)
    return ours, our_params, victim, their_params


def read_both_honestly(
    producer: Engine,
    consumer: Engine,
    alone: Engine,
    loans: list[tuple[str, list[int], KVTransferParams]],
) -> None:
    """Each loan is still whole after the forgery: its own reader gets one engine's answer."""
    for uid, prompt, params in loans:
        alone.add(f"a-{uid}", prompt, greedy(MAX_TOKENS))
        expected = tokens(run(alone, {f"a-{uid}"})[f"a-{uid}"])
        consumer.pool.clear_cache()
        consumer.add(f"d-{uid}", prompt, greedy(MAX_TOKENS, kv_transfer=params))
        assert tokens(run(consumer, {f"d-{uid}"})[f"d-{uid}"]) == expected
    settle(producer)
    assert producer.transfers.lending.held_blocks == 0
    assert_idle(producer)
    assert_idle(consumer)


@pytest.mark.parametrize("forgery", ["another loan's blocks", "ids out of range", "ids reordered"])
def test_a_claim_on_blocks_that_are_not_the_requests_is_refused_and_nothing_read(
    producer: Engine, consumer: Engine, make_engine, encode, forgery: str
) -> None:
    """A client that reaches the decode pod names its own request but blocks of another
    loan (or none at all): the prefill pod refuses the claim, so the decode pod reads nothing
    and prefills the prompt itself; neither loan is touched, and both still read whole."""
    tag = forgery.split()[0]
    ours, our_params, victim, their_params = two_loans(producer, encode, tag)
    lent = list(our_params.remote_block_ids)
    forged_ids = {
        "another loan's blocks": list(their_params.remote_block_ids),
        "ids out of range": [producer.pool.num_blocks + i for i in range(len(lent))],
        "ids reordered": lent[::-1],
    }[forgery]
    forged = msgspec.structs.replace(our_params, remote_block_ids=forged_ids)
    alone = make_engine()
    alone.add("a", ours, greedy(MAX_TOKENS))
    expected = tokens(run(alone, {"a"})["a"])
    reader = make_engine(kv_transfer=consumer_config(failure_policy="recompute"))
    try:
        reader.add("d-forged", ours, greedy(MAX_TOKENS, kv_transfer=forged))
        assert tokens(run(reader, {"d-forged"})["d-forged"]) == expected
        assert reader.transfers.pulls.bytes_read == 0
        assert reader.transfers.pulls.failures == {"claim_refused": 1}
        assert_idle(reader)
    finally:
        reader.transfers.close()
    loans = producer.transfers.lending.loans
    assert f"p-{tag}-victim" in loans and f"p-{tag}-ours" in loans  # the refusal freed neither
    read_both_honestly(
        producer,
        consumer,
        alone,
        [(f"{tag}-ours", ours, our_params), (f"{tag}-victim", victim, their_params)],
    )


def test_a_forged_claim_fails_the_request_under_the_fail_policy(
    producer: Engine, consumer: Engine, make_engine, encode
) -> None:
    ours, our_params, victim, their_params = two_loans(producer, encode, "failing")
    forged = msgspec.structs.replace(our_params, remote_block_ids=their_params.remote_block_ids)
    read_before = consumer.transfers.pulls.bytes_read
    refused_before = consumer.transfers.pulls.failures["claim_refused"]
    consumer.add("d-forged-fail", ours, greedy(4, kv_transfer=forged))
    (out,) = run(consumer, {"d-forged-fail"})["d-forged-fail"]
    assert out.error_code == "kv_load_failed"
    assert consumer.transfers.pulls.bytes_read == read_before
    assert consumer.transfers.pulls.failures["claim_refused"] == refused_before + 1
    assert_idle(consumer)
    read_both_honestly(
        producer,
        consumer,
        make_engine(),
        [("failing-ours", ours, our_params), ("failing-victim", victim, their_params)],
    )


def test_a_claim_for_a_request_the_prefill_pod_does_not_lend_is_refused(
    producer: Engine, consumer: Engine, make_engine, encode
) -> None:
    """Another loan's exact blocks and prompt, under a request id the prefill pod never lent
    (or lent and freed): refused; the loan those blocks belong to stays whole."""
    prompt = encode(LONG + " under another name")
    prefill(producer, "p-gone", prompt)
    assert producer.transfers.lending.give_back("p-gone")
    params = prefill(producer, "p-named", prompt)
    read_before = consumer.transfers.pulls.bytes_read
    expired_before = consumer.transfers.pulls.failures["expired"]
    for i, name in enumerate(["nobody", "p-gone"]):
        consumer.pool.clear_cache()
        forged = msgspec.structs.replace(params, remote_request_id=name)
        consumer.add(f"d-unknown{i}", prompt, greedy(4, kv_transfer=forged))
        (out,) = run(consumer, {f"d-unknown{i}"})[f"d-unknown{i}"]
        assert out.error_code == "kv_load_failed"
    assert consumer.transfers.pulls.bytes_read == read_before
    assert consumer.transfers.pulls.failures["expired"] == expired_before + 2
    assert "p-named" in producer.transfers.lending.loans
    read_both_honestly(producer, consumer, make_engine(), [("named", prompt, params)])


def test_a_claim_pins_the_loan_past_its_lease_until_the_reader_releases_it(
    make_engine, encode, monkeypatch
) -> None:
    """While a granted read runs, the lease ending does not free the loan (its blocks would
    go back to the pool under the reader); the reader's release frees it, as read, not as
    expired."""
    prompt = encode(LONG + " pinned")
    lender = make_engine(kv_transfer=producer_config(lease_s=5.0))
    reader = make_engine(kv_transfer=consumer_config())
    reading, may_read = threading.Event(), threading.Event()
    read = reader.transfers.link.read

    def held_read(*args, **kw):
        reading.set()
        assert may_read.wait(10)
        return read(*args, **kw)

    monkeypatch.setattr(reader.transfers.link, "read", held_read)
    try:
        params = prefill(lender, "p-pinned", prompt)
        reader.add("d-pinned", prompt, greedy(MAX_TOKENS, kv_transfer=params))
        assert reading.wait(10)  # granted: the read is about to start
        lending = lender.transfers.lending
        assert lending.expire(time.monotonic() + 10) == 0  # the lease is over, the pin is not
        assert lending.held_blocks == len(params.remote_block_ids)
        may_read.set()
        alone = make_engine()
        alone.add("a", prompt, greedy(MAX_TOKENS))
        got = tokens(run(reader, {"d-pinned"})["d-pinned"])
        assert got == tokens(run(alone, {"a"})["a"])
        settle(lender)
        assert lending.held_blocks == 0 and lending.expired == 0  # released, not expired
        assert_idle(lender)
        assert_idle(reader)
    finally:
        may_read.set()
        lender.transfers.close()
        reader.transfers.close()


def test_a_release_that_proves_nothing_frees_nothing(producer: Engine, encode) -> None:
    """Anyone who reaches the side channel could name a request: a release without the
    claim's token or the prompt's digest leaves the loan to its reader (or its lease)."""
    import zmq

    prompt = encode(LONG + " kept")
    prefill(producer, "p-kept", prompt)
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.connect(producer.transfers.server.address)
    sent = producer.transfers.bytes_sent
    forged = Release("p-kept", 10**9, token=b"guess" * 3, digest=b"x" * 16)
    for release in (Release("p-kept", 10**9), forged):
        stranger.send(msgspec.msgpack.encode(release))
    stranger.close(linger=1000)
    settle(producer, timeout_s=0.3)
    assert "p-kept" in producer.transfers.lending.loans
    assert producer.transfers.bytes_sent == sent  # nor does it count as bytes sent
    digest = prefix_digest(prompt[: len(producer.transfers.lending.loans["p-kept"].tokens)])
    assert producer.transfers.lending.release(Release("p-kept", digest=digest)) == (False, True)
    assert_idle(producer)


def ledger_with_loan(lease_s: float = 5.0) -> tuple[Ledger, list[int], float]:
    ledger = Ledger(block_size=2, pin_s=3.0)
    now = time.monotonic()
    ledger.add("r", Loan([7, 3, 9], [1, 2, 3, 4, 5, 6], now + lease_s, time.time() + lease_s))
    return ledger, [1, 2, 3, 4, 5, 6], now


@pytest.mark.parametrize(
    ("first", "ids", "prompt", "reason"),
    [
        (1, [3, 9], [1, 2, 3, 4, 5, 6], ""),
        (0, [7, 3, 9], [1, 2, 3, 4, 5, 6, 99], ""),  # the reader's prompt goes on
        (0, [3, 9], [1, 2, 3, 4, 5, 6], "claim_refused"),  # the right ids, the wrong place
        (2, [9, 10], [1, 2, 3, 4, 5, 6, 7, 8], "claim_refused"),  # beyond the loan
        (-1, [7], [1, 2], "claim_refused"),
        (0, [], [], "claim_refused"),
        (1, [3], [1, 2, 3, 5], "claim_refused"),  # another prompt
        (1, [3], [0, 2, 3, 4], "claim_refused"),  # another prefix: other KV
    ],
)
def test_the_ledger_grants_only_a_loans_own_blocks_for_its_own_prompt(
    first: int, ids: list[int], prompt: list[int], reason: str
) -> None:
    ledger, _, now = ledger_with_loan()
    end = (first + len(ids)) * ledger.block_size if first >= 0 else 0
    grant = ledger.claim(Claim("r", first, ids, prefix_digest(prompt[:end]), 1.0), now)
    assert grant.reason == reason and bool(grant.refusal) == bool(reason)
    assert bool(grant.token) == (not reason)
    if not reason:
        assert grant.pinned_s == 1.0


def test_the_ledger_refuses_claims_on_loans_gone_and_pins_no_longer_than_a_read() -> None:
    ledger, prompt, now = ledger_with_loan(lease_s=5.0)
    claim = Claim("r", 0, [7, 3, 9], prefix_digest(prompt), 600.0)
    assert ledger.claim(msgspec.structs.replace(claim, request_id="q"), now).reason == "expired"
    adapted = msgspec.structs.replace(claim, digest=prefix_digest(prompt, "an-adapter"))
    assert ledger.claim(adapted, now).reason == "claim_refused"  # the KV of another adapter
    assert ledger.claim(claim, now + 6).reason == "expired"  # its lease is over
    grant = ledger.claim(claim, now + 4)  # a second before its lease ends
    assert grant.pinned_s == 3.0  # the owner's pull timeout bounds a reader's ask
    assert ledger.take_done(now + 6) == ([], [])  # pinned past its lease
    released, late = ledger.take_done(now + 4 + 3.0 + PIN_GRACE_S + 0.1)  # a reader that died
    assert released == [] and [loan.blocks for loan in late] == [[7, 3, 9]]

    ledger, prompt, now = ledger_with_loan()
    token = ledger.claim(claim, now).token
    other = ledger.claim(claim, now).token  # a second reader of the same prompt
    assert ledger.release(Release("r", token=token), now) == (True, None)  # the other reads on
    assert ledger.claim(claim, now).reason == "expired"  # released: no new reader
    assert ledger.take_done(now + 1) == ([], [])
    assert ledger.release(Release("r", token=token), now) == (False, None)  # its pin is gone
    granted, loan = ledger.release(Release("r", token=other), now)
    assert granted and loan is not None and loan.blocks == [7, 3, 9] and ledger.snapshot() == {}


def test_an_idle_lending_pods_agent_leaves_the_cores_alone(producer: Engine) -> None:
    """NIXL's own progress thread polls without pause (its Python API sets no delay): a pod
    idle between reads would burn a core its steps need. Ours is progressed every 2 ms."""
    pool = torch.zeros(1, 64, 4, 64)
    link = NixlLink("idle-lender", pool, producer.transfers.link.layout, True)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(1.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        link.close()
    used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert used < 0.3, f"{used:.2f} s of CPU in 1 s idle"
