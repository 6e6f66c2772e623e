"""The side channel with the service's CurveZMQ keys (``side_channel_keys``): pods holding them
read from each other as without; a decode pod reads nothing from a pod without them (an
impostor a forged ``kv_transfer_params`` names), and a prefill pod with them grants nothing to,
and hears nothing from, a reader without them. Real engines, real sockets, NIXL as
test_kv_transfer.py uses it.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
import zmq.auth
from kv_transfer_testkit import (
    LONG,
    MAX_TOKENS,
    TINY_LAYOUT,
    consumer_config,
    prefill,
    producer_config,
    run,
    settle,
    tokens,
)
from scheduler_testkit import assert_idle, greedy

from tokenline.ring_security import create_keys
from tokenline.scheduler.engine import Engine
from tokenline.scheduler.kv_transfer import pulls
from tokenline.scheduler.kv_transfer.config import config_of
from tokenline.scheduler.kv_transfer.ledger import prefix_digest
from tokenline.scheduler.kv_transfer.side_channel import (
    Release,
    SideChannelClient,
    SideChannelServer,
)
from tokenline.settings.scheduler import KVTransferConfigText

pytest.importorskip("nixl_cu12._api", reason="NIXL is installed by `make .venv/.test`")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("side-channel-keys")
    create_keys(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def other_keys(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("other-keys")
    create_keys(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def keyed_producer(make_engine, keys) -> Engine:
    engine = make_engine(kv_transfer=producer_config(side_channel_keys=keys))
    yield engine
    engine.transfers.close()


@pytest.fixture(scope="module")
def keyed_consumer(make_engine, keys) -> Engine:
    engine = make_engine(kv_transfer=consumer_config(side_channel_keys=keys))
    yield engine
    engine.transfers.close()


@pytest.fixture(scope="module")
def alone(make_engine) -> Engine:
    return make_engine()


def expected(alone: Engine, uid: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list:
    alone.add(uid, prompt, greedy(max_tokens))
    return tokens(run(alone, {uid})[uid])


def test_pods_with_the_same_keys_read_as_without(
    keyed_producer: Engine, keyed_consumer: Engine, alone: Engine, encode
) -> None:
    prompt = encode(LONG + " with keys")
    params = prefill(keyed_producer, "p-keyed", prompt)
    keyed_consumer.add("d-keyed", prompt, greedy(MAX_TOKENS, kv_transfer=params))
    got = tokens(run(keyed_consumer, {"d-keyed"})["d-keyed"])
    assert got == expected(alone, "a-keyed", prompt)
    pulled = keyed_consumer.transfers.pulls
    assert pulled.bytes_read > 0 and not pulled.failures
    settle(keyed_producer)
    assert keyed_producer.transfers.lending.held_blocks == 0
    assert_idle(keyed_producer)
    assert_idle(keyed_consumer)


@pytest.mark.parametrize("impostor", ["no keys", "other keys"])
def test_a_decode_pod_with_keys_reads_and_caches_nothing_of_a_pod_without_them(
    make_engine, alone: Engine, keys: str, other_keys: str, encode, impostor: str
) -> None:
    """A client names a side channel of its own (here a real prefill engine, without the
    service's keys, whose lent KV is scrambled): the decode pod fails the read on the
    handshake, long before the hello's timeout, reads nothing and caches nothing, so a later
    request of the prompt computes it here."""
    prompt = encode(LONG + f" poisoned by {impostor}")
    lender_keys = other_keys if impostor == "other keys" else None
    attacker = make_engine(kv_transfer=producer_config(side_channel_keys=lender_keys))
    reader = make_engine(kv_transfer=consumer_config(side_channel_keys=keys))
    try:
        params = prefill(attacker, "p-poison", prompt)
        bs = attacker.pool.block_size
        generator = torch.Generator().manual_seed(1)
        for block in params.remote_block_ids:
            rows = attacker.runner.kv_cache[:, block * bs : (block + 1) * bs]
            rows.copy_(torch.randn(rows.shape, generator=generator) * 10)
        started = time.monotonic()
        reader.add("d-poison", prompt, greedy(4, kv_transfer=params))
        (out,) = run(reader, {"d-poison"})["d-poison"]
        assert out.error_code == "kv_load_failed"
        assert time.monotonic() - started < pulls.HELLO_TIMEOUT_S / 2
        assert reader.transfers.pulls.failures == {"unauthenticated": 1}
        assert reader.transfers.pulls.bytes_read == 0
        assert_idle(reader)
        loan = attacker.transfers.lending.loans["p-poison"]
        assert loan.pins == {} and not loan.released  # it heard no claim and no release
        hits = reader.prefix_cache_hits
        reader.add("later", prompt, greedy(MAX_TOKENS))
        assert tokens(run(reader, {"later"})["later"]) == expected(alone, "a-poison", prompt)
        assert reader.prefix_cache_hits == hits  # nothing of the impostor's was cached
        assert_idle(reader)
    finally:
        attacker.transfers.close()
        reader.transfers.close()


@pytest.mark.parametrize("reader_keys", ["no keys", "other keys"])
def test_a_prefill_pod_with_keys_grants_nothing_to_a_reader_without_them(
    keyed_producer: Engine,
    keyed_consumer: Engine,
    make_engine,
    alone: Engine,
    keys: str,
    other_keys: str,
    encode,
    reader_keys: str,
) -> None:
    """The reader without the keys gets no welcome and no grant (it prefills the prompt
    itself); its release, though it proves the prompt, frees nothing; the loan stays whole
    for the reader with the keys."""
    prompt = encode(LONG + f" asked with {reader_keys}")
    uid = f"p-{reader_keys.split()[0]}-reader"
    params = prefill(keyed_producer, uid, prompt)
    answer = expected(alone, f"a-{uid}", prompt)
    stranger_keys = other_keys if reader_keys == "other keys" else None
    stranger = make_engine(
        kv_transfer=consumer_config(side_channel_keys=stranger_keys, failure_policy="recompute")
    )
    try:
        stranger.add("d-stranger", prompt, greedy(MAX_TOKENS, kv_transfer=params))
        assert tokens(run(stranger, {"d-stranger"})["d-stranger"]) == answer
        assert stranger.transfers.pulls.failures == {"unauthenticated": 1}
        assert stranger.transfers.pulls.bytes_read == 0
        assert_idle(stranger)
    finally:
        stranger.transfers.close()
    loan = keyed_producer.transfers.lending.loans[uid]
    assert loan.pins == {} and not loan.released  # no grant
    # a release that proves the prompt would free the loan, were it heard: from a plain
    # socket, and from one that knows the pod's public key but holds a key pair of its own
    server_key, _ = zmq.auth.load_certificate(Path(keys) / "ring.key")
    for curve in (False, True):
        socket = zmq.Context.instance().socket(zmq.DEALER)
        if curve:
            socket.curve_publickey, socket.curve_secretkey = zmq.curve_keypair()
            socket.curve_serverkey = server_key
        socket.connect(keyed_producer.transfers.server.address)
        socket.send(msgspec.msgpack.encode(Release(uid, digest=prefix_digest(loan.tokens))))
        socket.close(linger=1000)
    settle(keyed_producer, timeout_s=0.3)
    assert uid in keyed_producer.transfers.lending.loans
    keyed_consumer.pool.clear_cache()
    keyed_consumer.add(f"d-{uid}", prompt, greedy(MAX_TOKENS, kv_transfer=params))
    assert tokens(run(keyed_consumer, {f"d-{uid}"})[f"d-{uid}"]) == answer
    settle(keyed_producer)
    assert keyed_producer.transfers.lending.held_blocks == 0
    assert_idle(keyed_producer)
    assert_idle(keyed_consumer)


def flag(extra: str) -> str:
    return (
        '{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
        f'"kv_connector_extra_config": {{"side_channel_keys": {extra}}}}}'
    )


@pytest.mark.parametrize("directory", ["missing", "empty", "public key only", "secret only"])
def test_keys_that_cannot_authenticate_are_refused_at_start(tmp_path: Path, directory: str) -> None:
    made = tmp_path / "made"
    create_keys(str(made))
    path = tmp_path / directory.replace(" ", "-")
    if directory != "missing":
        path.mkdir()
    if directory == "public key only":
        (path / "ring.key").write_bytes((made / "ring.key").read_bytes())
    if directory == "secret only":
        (path / "ring.key_secret").write_bytes((made / "ring.key_secret").read_bytes())
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        KVTransferConfigText(flag(f'"{path}"'))
    message = str(caught.value)
    assert "side_channel_keys" in message and str(path) in message
    assert "tokenline ring-keys" in message


def test_keys_are_a_directory_name_and_reach_the_config(tmp_path: Path) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="must name a directory"):
        KVTransferConfigText(flag("7"))
    create_keys(str(tmp_path))
    assert config_of(flag(f'"{tmp_path}"'), {}).side_channel_keys == str(tmp_path)
    plain = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    assert config_of(plain, {}).side_channel_keys is None


def test_a_side_channel_beyond_loopback_without_keys_is_warned_of_once(
    keys: str, caplog: pytest.LogCaptureFixture
) -> None:
    layout = TINY_LAYOUT

    def warnings() -> list[str]:
        found = [r.getMessage() for r in caplog.records if "side_channel_keys" in r.getMessage()]
        caplog.clear()
        return found

    caplog.set_level(logging.WARNING)
    for host, with_keys, warned in [
        ("127.0.0.1", None, False),
        ("0.0.0.0", keys, False),
        ("0.0.0.0", None, True),
    ]:
        server = SideChannelServer(host, 0, b"", layout, "e", lambda claim: None, with_keys)
        server.close()
        assert bool(warnings()) == warned, (host, with_keys)
    client = SideChannelClient()
    client._peer("127.0.0.1", 9)
    assert warnings() == []
    client._peer("192.0.2.1", 9)  # connecting costs nothing: nothing is sent
    client._peer("192.0.2.2", 9)
    assert len(warnings()) == 1
    client.close()
    keyed = SideChannelClient(keys)
    keyed._peer("192.0.2.1", 9)
    assert warnings() == []
    keyed.close()
