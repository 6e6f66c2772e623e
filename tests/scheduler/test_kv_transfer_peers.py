"""What a decode pod keeps of the prefill pods requests name: ``remote_host`` and
``remote_port`` are clients' input, so the side channel's sockets (one an owner, each with a
monitor) and the memory of unreachable owners stay bounded however many addresses clients
invent, and an owner in use keeps serving while the others come and go.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
from kv_transfer_testkit import (
    LONG,
    MAX_TOKENS,
    TINY_LAYOUT,
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
from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.kv_transfer import pulls, side_channel
from tokenline.scheduler.kv_transfer.pulls import Pulls
from tokenline.scheduler.kv_transfer.side_channel import (
    Grant,
    Release,
    SideChannelClient,
    SideChannelServer,
)
from tokenline.scheduler.sequence import Sequence

CAP = 8
NOWHERE = "192.0.2.1"  # TEST-NET-1: never routed, so no owner ever answers there


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def nowhere(port: int, blocks: int = 0) -> KVTransferParams:
    """What a client may send: a prefill pod at an address of its choosing."""
    return KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="invented",
        remote_request_id=f"r{port}",
        remote_host=NOWHERE,
        remote_port=port,
        remote_block_ids=list(range(blocks)),
    )


def arrival(uid: str, params: KVTransferParams, prompt_len: int = 3) -> Sequence:
    sampling = greedy(4, kv_transfer=params)
    return Sequence(
        uid=uid, prompt_ids=list(range(1, prompt_len + 1)), sampling=sampling, max_tokens=4
    )


def address(bound: str) -> tuple[str, int]:
    """A bound side channel's host and port, as kv_transfer_params name them."""
    host, port = bound.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.fixture(scope="module")
def producer(make_engine) -> Engine:
    pytest.importorskip("nixl_cu12._api", reason="NIXL is installed by `make .venv/.test`")
    yield from closing(make_engine(kv_transfer=producer_config()))


@pytest.fixture
def small_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(side_channel, "MAX_PEERS", CAP)


def test_releases_to_invented_addresses_keep_at_most_the_cap_of_sockets(small_cap) -> None:
    """The audit's reproduction: a release (nothing to read) to each of 300 addresses."""
    before = open_fds()
    reader = Pulls(BlockPool(64, 16, caching=True), consumer_config(), link=None)
    for i in range(300):
        params = nowhere(20000 + i)
        assert reader.arrive(arrival(f"u{i}", params), params) is False  # joins at once
    reader._worker.shutdown(wait=True)  # every release sent
    kept = reader._client._sockets
    assert len(kept) == CAP
    assert list(kept)[-1] == (NOWHERE, 20299)  # the most recent stay
    # a socket, its monitor and a connecting TCP socket are a few descriptors an owner; 300
    # owners kept were some 950 (ZeroMQ closes the others' on its own thread, soon after)
    assert until(lambda: open_fds() - before <= 5 * CAP + 16), (before, open_fds())
    reader._client.close()
    assert until(lambda: open_fds() - before <= 16), (before, open_fds())


def test_the_least_recently_used_owner_makes_room_and_comes_back_when_asked() -> None:
    granted = lambda claim: Grant(claim.request_id)  # noqa: E731
    servers = [
        SideChannelServer("127.0.0.1", 0, b"", TINY_LAYOUT, f"e{i}", granted) for i in (0, 1)
    ]
    a, b = (address(server.address) for server in servers)
    client = SideChannelClient(max_peers=2)
    try:
        assert client.hello(*a, TINY_LAYOUT, 5.0).engine_id == "e0"
        assert client.hello(*b, TINY_LAYOUT, 5.0).engine_id == "e1"
        assert client.hello(*a, TINY_LAYOUT, 5.0).engine_id == "e0"  # a is the more recent now
        client.release(NOWHERE, 9, Release("r"))  # a third owner: b, the idle longest, goes
        assert list(client._sockets) == [a, (NOWHERE, 9)]
        client.release(*b, Release("to-b"))  # b comes back on its own: a new socket
        client.release(*a, Release("to-a"))
        assert list(client._sockets) == [b, a]
        assert client.hello(*b, TINY_LAYOUT, 5.0).engine_id == "e1"
        for server, uid in zip(servers, ("to-a", "to-b"), strict=True):
            assert until(lambda s=server: s._releases)
            assert [r.request_id for r in server.take_releases()] == [uid]
    finally:
        client.close()
        for server in servers:
            server.close()
    with pytest.raises(ValueError, match="max_peers is 0: give the side channel 1 or more"):
        SideChannelClient(max_peers=0)


def test_unreachable_owners_are_forgotten_after_their_memory_time_and_capped(
    small_cap, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pulls, "HELLO_TIMEOUT_S", 0.02)  # each handshake waits this out
    monkeypatch.setattr(pulls, "UNREACHABLE_PEERS", CAP)
    link = SimpleNamespace(layout=TINY_LAYOUT, forget=lambda metadata: None)
    reader = Pulls(BlockPool(64, 4, caching=True), consumer_config(), link=link)

    def read(ports: range) -> list[str]:
        """Each port's read, to its end; the failures' messages."""
        for port in ports:
            params = nowhere(port, blocks=2)
            assert reader.arrive(arrival(f"u{port}", params, prompt_len=12), params)
        failed: list[str] = []
        deadline = time.monotonic() + 10
        while reader.busy() and time.monotonic() < deadline:
            ready, failures = reader.poll()
            assert ready == []
            failed += [str(failure) for _, failure in failures]
            time.sleep(0.005)
        assert not reader.busy()
        return failed

    try:
        assert len(read(range(30000, 30040))) == 40
        assert reader.failures["unreachable"] == 40
        assert len(reader._unreachable) == CAP
        assert len(reader._client._sockets) == 0  # a silent owner's socket goes with its timeout
        # the latest are remembered: a read from one fails at once, without a handshake
        (again,) = read(range(30039, 30040))
        assert again == f"the prefill pod at {NOWHERE}:30039 was unreachable"
        monkeypatch.setattr(pulls, "UNREACHABLE_MEMORY_S", 0.05)
        time.sleep(0.1)
        assert len(reader._unreachable) == 0  # nothing stays past its memory time
        (asked,) = read(range(30039, 30040))
        assert "is silent after" in asked  # asked again, not remembered
    finally:
        reader.close()


def test_an_owner_in_use_keeps_serving_across_the_eviction_of_others(
    small_cap, producer: Engine, make_engine, encode
) -> None:
    reader = make_engine(kv_transfer=consumer_config())
    alone = make_engine()
    owner = address(producer.transfers.server.address)
    try:
        for uid in ("before", "after"):
            prompt = encode(LONG + f" {uid} the flood")
            alone.add(f"a-{uid}", prompt, greedy(MAX_TOKENS))
            expected = tokens(run(alone, {f"a-{uid}"})[f"a-{uid}"])
            params = prefill(producer, f"p-{uid}", prompt)
            reader.add(f"d-{uid}", prompt, greedy(MAX_TOKENS, kv_transfer=params))
            assert tokens(run(reader, {f"d-{uid}"})[f"d-{uid}"]) == expected
            settle(producer)
            assert producer.transfers.lending.held_blocks == 0
            # clients naming addresses of their own, each with nothing to read
            flood = {f"flood-{uid}-{i}" for i in range(3 * CAP)}
            for i, fuid in enumerate(sorted(flood)):
                reader.add(fuid, encode("hello"), greedy(1, kv_transfer=nowhere(40000 + i)))
            run(reader, flood)
            read = reader.transfers.pulls
            assert until(lambda r=read: (NOWHERE, 40000 + 3 * CAP - 1) in r._client._sockets)
            assert len(read._client._sockets) == CAP
            assert owner not in read._client._sockets  # the next read connects anew
        assert read.bytes_read > 0 and not read.failures
        assert_idle(reader)
        assert_idle(producer)
    finally:
        reader.transfers.close()
