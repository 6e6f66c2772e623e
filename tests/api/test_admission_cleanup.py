"""A request the ring cannot carry leaves nothing behind: `RingClient.open` builds and encodes
every choice before any uid is live, and the route answers 400 in OpenAI's shape."""

from __future__ import annotations

import msgspec
import pytest
from api_testkit import app_with, client_for

from tokenline import protocol
from tokenline.api.ring.client import RingClient
from tokenline.settings import Settings


class EncodingRing:
    """Encodes as the real ring does (MessagePack), sends nowhere."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def encode(self, message: msgspec.Struct) -> bytes:
        return msgspec.msgpack.encode(message)

    def send_frame(self, frame: bytes) -> None:
        self.sent.append(frame)

    def send_nowait(self, message: msgspec.Struct) -> None:
        self.send_frame(self.encode(message))


@pytest.fixture
def ring_client(monkeypatch) -> RingClient:
    ring_client = RingClient(Settings(), EncodingRing())
    # admission's readiness check, which would need heartbeats from live stages
    monkeypatch.setattr(ring_client.health, "problem", lambda now: None)
    return ring_client


def _generate(n: int, **sampling) -> list[protocol.Generate]:
    def build(index: int) -> protocol.Generate:
        params = {k: (v(index) if callable(v) else v) for k, v in sampling.items()}
        return protocol.Generate(
            uid="", sampling=protocol.SamplingParams(**params), prompt="x", timeout_s=60
        )

    return [build(i) for i in range(n)]


@pytest.mark.parametrize(
    "sampling",
    [
        {"max_tokens": 2**64},
        {"seed": -(2**63) - 1},
        {"stop": ["\ud800"]},
        {"seed": lambda i: 2**64 - 2 + i},  # only the third choice overflows
    ],
)
def test_an_unencodable_request_leaves_no_uid_live(ring_client, sampling):
    with pytest.raises((OverflowError, UnicodeEncodeError)):
        ring_client.open(_generate(3, **sampling))
    assert ring_client.exchanges == {}
    assert len(ring_client.ledger) == 0
    assert ring_client.ring.sent == []  # no choice of it reached the tokenizer
    ex = ring_client.open(_generate(1, max_tokens=4))  # and admission goes on
    assert list(ring_client.exchanges) == ex.uids
    ring_client.close(ex)
    assert ring_client.exchanges == {} and len(ring_client.ledger) == 0


def test_the_route_answers_an_unencodable_request_with_a_400():
    app, stand_in = app_with()

    def unencodable(messages, tenant=""):
        raise OverflowError("can't serialize ints < -2**63 or > 2**64 - 1")

    stand_in.open = unencodable
    response = client_for(app).post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "cannot carry" in response.json()["error"]["message"]
