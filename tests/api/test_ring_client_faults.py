"""The api's ring client when things go wrong: a send the outbox refuses, a stage lost during a
drain, a choice that ends in an error, a pooling request of many inputs, a client that stops
reading. A real `RingClient` and app over a ring that records what is sent; no stage runs."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import msgspec
import pytest
import uvicorn
import zmq

from tokenline import protocol
from tokenline.api.app import create_app, listening_socket
from tokenline.api.endpoints.completions import CompletionsAnswer
from tokenline.api.http.sse import EventStream
from tokenline.api.ring import client as ring_client_module
from tokenline.api.ring import liveness as liveness_module
from tokenline.api.ring.client import RingClient
from tokenline.api.ring.exchange import coalesce
from tokenline.metrics import ABORTS, REQUEST_ERRORS
from tokenline.settings import Settings

pytestmark = pytest.mark.timeout(60)


class RecordingRing:
    """Records what the api sends; refuses every send, as an outbox at its high-water mark
    does, while ``refuse`` is set."""

    def __init__(self) -> None:
        self.sent: list[msgspec.Struct] = []
        self.refuse = False

    def encode(self, message: msgspec.Struct) -> bytes:
        return msgspec.msgpack.encode(message)

    def send_frame(self, frame: bytes) -> None:
        if self.refuse:
            raise zmq.Again()
        self.sent.append(msgspec.msgpack.decode(frame, type=protocol.ToTokenizer))

    def send_nowait(self, message: msgspec.Struct) -> None:
        self.send_frame(self.encode(message))

    async def recv(self) -> msgspec.Struct:
        await asyncio.Event().wait()  # no stage answers

    async def watch_peers(self, on_change) -> None:
        await asyncio.Event().wait()

    def close(self) -> None:
        pass

    def of(self, kind: type) -> list:
        return [m for m in self.sent if isinstance(m, kind)]


def _ring_client() -> RingClient:
    ring_client = RingClient(Settings(), RecordingRing())
    ring_client.health.problem = lambda now: None  # as if every stage answered
    return ring_client


def _generate(n: int = 1, **sampling) -> list[protocol.Generate]:
    params = protocol.SamplingParams(**{"max_tokens": 10, **sampling})
    return [protocol.Generate(uid="", sampling=params, prompt="x", timeout_s=60) for _ in range(n)]


def _replies(*replies: protocol.Reply) -> protocol.ReplyBatch:
    return protocol.ReplyBatch(replies=list(replies))


def _piece(uid: str, text: str = "x", **fields) -> protocol.Reply:
    return protocol.Reply(uid=uid, text=text, num_tokens=1, **fields)


def _count(counter, **labels) -> float:
    return counter.labels(**labels)._value.get()


# ── 1. a refused send ──────────────────────────────────────────────────────────────────────────
async def test_a_refused_send_ends_neither_the_watchdog_nor_the_heartbeats(monkeypatch):
    monkeypatch.setattr(ring_client_module, "WATCHDOG_INTERVAL_S", 0.01)
    monkeypatch.setattr(liveness_module, "HEARTBEAT_INTERVAL_S", 0.01)
    monkeypatch.setattr(liveness_module, "RECOVERY_HEARTBEAT_INTERVAL_S", 0.01)
    ring_client = _ring_client()
    late = ring_client.open(_generate())
    late.deadline = 0  # its abort is the watchdog's first send
    ring_client.ring.refuse = True
    await ring_client.start()
    try:
        await asyncio.sleep(0.1)
        loops = {t.get_name(): t for t in ring_client._tasks}
        assert not loops["_watchdog"].done() and not loops["heartbeats"].done()
        assert late.error is not None and late.error.code == "request_timeout"
        ring_client.ring.refuse = False
        later = ring_client.open(_generate())
        later.deadline = 0
        await asyncio.sleep(0.1)
        assert later.error is not None, "the watchdog stopped enforcing deadlines"
        assert ring_client.ring.of(protocol.Heartbeat), "heartbeats stopped"
    finally:
        await ring_client.stop()


def test_close_frees_the_request_when_its_abort_cannot_be_sent():
    ring_client = _ring_client()
    ex = ring_client.open(_generate(2))
    ring_client.ring.refuse = True
    ring_client.close(ex)
    assert ring_client.exchanges == {} and len(ring_client.ledger) == 0
    assert ex.error is not None and ex.error.code == "client_disconnect"


def test_a_request_the_outbox_refuses_leaves_no_uid_live():
    ring_client = _ring_client()
    ring_client.ring.refuse = True
    with pytest.raises(Exception) as raised:
        ring_client.open(_generate(2))
    assert raised.value.status == 503
    assert ring_client.exchanges == {} and len(ring_client.ledger) == 0


# ── 2. a stage lost during a drain ─────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("observer", "stage"), [("detokenizer", "scheduler"), ("api", "detokenizer")]
)
def test_a_stage_lost_during_a_drain_fails_the_requests_in_flight(observer, stage):
    ring_client = _ring_client()
    ex = ring_client.open(_generate())
    ring_client.draining = True
    lost = time.monotonic()
    ring_client.liveness.on_link(observer, stage, False)
    ring_client.check_exchanges(lost + ring_client_module.DRAIN_STRAND_GRACE_S + 0.1)
    assert ex.error is not None and ex.error.code == "stage_failure"
    aborts = ring_client.ring.of(protocol.Abort)
    assert [(a.uid, a.reason) for a in aborts] == [(ex.uids[0], "stage_failure")]


def test_requests_that_end_within_the_grace_of_a_drained_stage_finish_normally():
    """A stage that ends its own drain held nothing: what it passed on still arrives."""
    ring_client = _ring_client()
    ex = ring_client.open(_generate())
    ring_client.draining = True
    lost = time.monotonic()
    ring_client.liveness.on_link("detokenizer", "scheduler", False)
    ring_client.route(_replies(_piece(ex.uids[0], finish_reason="stop")))
    ring_client.check_exchanges(lost + ring_client_module.DRAIN_STRAND_GRACE_S + 0.1)
    assert ex.error is None and ex.choices[0].finish_reason == "stop"


def test_the_tokenizer_leaving_a_drain_fails_nothing():
    """It leaves every drain at its start, holding nothing; streams go on past it."""
    ring_client = _ring_client()
    ex = ring_client.open(_generate())
    ring_client.draining = True
    lost = time.monotonic()
    ring_client.liveness.on_link("api", "tokenizer", False)
    ring_client.check_exchanges(lost + ring_client_module.DRAIN_STRAND_GRACE_S + 0.1)
    assert ex.error is None


# ── 3. and 4. a choice that ends in an error ───────────────────────────────────────────────────
def test_a_choice_error_ends_its_request_with_its_own_code_not_a_disconnect():
    ring_client = _ring_client()
    ex = ring_client.open(_generate(2))
    disconnects = _count(ABORTS, reason="client_disconnect")
    grammar_errors = _count(REQUEST_ERRORS, code="grammar_error")
    error = _piece(ex.uids[0], "", finish_reason="error", error_code="grammar_error")
    ring_client.route(_replies(error))
    assert ex.done and ex.error is not None and ex.error.code == "grammar_error"
    aborts = ring_client.ring.of(protocol.Abort)
    assert [(a.uid, a.reason) for a in aborts] == [(ex.uids[1], "stage_failure")]
    ring_client.close(ex)
    assert _count(ABORTS, reason="client_disconnect") == disconnects
    assert _count(REQUEST_ERRORS, code="grammar_error") == grammar_errors + 1
    assert ring_client.exchanges == {} and len(ring_client.ledger) == 0


def test_coalescing_keeps_the_terminal_replys_code_and_fields():
    kv = protocol.KVTransferParams(do_remote_prefill=True)
    pieces = [
        (0, _piece("u", "a", prompt_text="prompt", prompt_tokens=3)),
        (0, _piece("u", "b", finish_reason="error", error_code="grammar_error", kv_transfer=kv)),
        (1, _piece("v", "c")),
        (1, _piece("v", "d", finish_reason="stop", stop_string=True, cached_tokens=2)),
    ]
    (_, first), (_, second) = coalesce(pieces)
    assert (first.text, first.num_tokens, first.finish_reason) == ("ab", 2, "error")
    assert first.error_code == "grammar_error" and first.kv_transfer == kv
    assert first.prompt_text == "prompt" and first.prompt_tokens == 3
    assert (second.text, second.stop_string, second.cached_tokens) == ("cd", True, 2)


# ── the app over the recording ring ────────────────────────────────────────────────────────────
def _app():
    app = create_app(Settings())
    ring_client = _ring_client()
    app.state.ring_client = ring_client
    return app, ring_client


async def _request(app, body: dict) -> tuple[asyncio.Task, list[dict]]:
    """POST ``body`` to /v1/completions in-process; the task and what the app sends."""
    payload = json.dumps(body).encode()
    received = asyncio.Event()
    sent: list[dict] = []

    async def receive() -> dict:
        if not received.is_set():
            received.set()
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # the client never goes away

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    return asyncio.create_task(app(scope, receive, send)), sent


async def _opened(ring_client: RingClient, uids: int) -> list[str]:
    for _ in range(200):
        if len(ring_client.exchanges) >= uids:
            return list(ring_client.exchanges)
        await asyncio.sleep(0.005)
    raise AssertionError("the request never reached the ring")


def _body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _status(sent: list[dict]) -> int:
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


async def test_a_whole_answer_gets_the_choices_error_code():
    app, ring_client = _app()
    task, sent = await _request(app, {"model": "tiny", "prompt": "p", "max_tokens": 5})
    (uid,) = await _opened(ring_client, 1)
    ring_client.route(_replies(_piece(uid, "", finish_reason="error", error_code="grammar_error")))
    await asyncio.wait_for(task, 5)
    assert _status(sent) == 500
    assert json.loads(_body(sent))["error"]["code"] == "grammar_error"


async def test_a_stream_that_fell_behind_gets_the_choices_error_code():
    app, ring_client = _app()
    body = {"model": "tiny", "prompt": "p", "max_tokens": 5, "stream": True}
    task, sent = await _request(app, body)
    (uid,) = await _opened(ring_client, 1)
    ring_client.route(_replies(_piece(uid, "a")))  # the first batch: the stream starts
    await asyncio.sleep(0.01)
    # both before the handler reads again: coalesced into one
    ring_client.route(_replies(_piece(uid, "b")))
    ring_client.route(_replies(_piece(uid, "", finish_reason="error", error_code="grammar_error")))
    await asyncio.wait_for(task, 5)
    events = [e for e in _body(sent).split(b"\n\n") if e.startswith(b"data: {")]
    assert json.loads(events[-1].removeprefix(b"data: "))["error"]["code"] == "grammar_error"


async def test_a_failing_stream_aborts_its_choices_as_a_failure_not_a_disconnect(monkeypatch):
    app, ring_client = _app()

    def broken(self, ex, first, meta):
        async def events():
            yield b"data: {}\n\n"
            raise RuntimeError("a bug in the endpoint's stream")

        return events()

    monkeypatch.setattr(CompletionsAnswer, "stream", broken)
    disconnects = _count(ABORTS, reason="client_disconnect")
    body = {"model": "tiny", "prompt": "p", "max_tokens": 5, "stream": True, "n": 2}
    task, _ = await _request(app, body)
    uids = await _opened(ring_client, 2)
    ring_client.route(_replies(_piece(uids[0], "a")))
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(task, 5)
    aborts = ring_client.ring.of(protocol.Abort)
    assert sorted((a.uid, a.reason) for a in aborts) == [(u, "stage_failure") for u in uids]
    assert _count(ABORTS, reason="client_disconnect") == disconnects
    assert ring_client.exchanges == {} and len(ring_client.ledger) == 0


async def test_event_stream_tells_its_close_whether_its_events_failed():
    closed: list = []

    async def failing():
        yield b"x"
        raise ValueError("broken")

    async def send(message: dict) -> None:
        pass

    with pytest.raises(ValueError):
        await EventStream(failing(), closed.append)({}, None, send)
    assert isinstance(closed[0], ValueError)


# ── 5. a pooling request of many inputs ────────────────────────────────────────────────────────
async def test_pooling_many_inputs_sends_no_flood_of_pauses():
    ring_client = _ring_client()
    params = protocol.PoolingParams()
    messages = [
        protocol.Generate(
            uid="",
            sampling=protocol.SamplingParams(max_tokens=0),
            prompt="x",
            timeout_s=60,
            pooling=params,
        )
        for _ in range(2048)
    ]
    ex = ring_client.open(messages)
    vector = b"\0" * 16
    results = 0

    async def read() -> None:
        nonlocal results
        while True:
            batch = await ex.next_batch()
            results += len(batch)
            if not batch and ex.done:
                return

    reader = asyncio.create_task(read())
    for start in range(0, 2048, 128):  # whole batches, delivered before the reader runs
        uids = ex.uids[start : start + 128]
        ring_client.route(
            _replies(*(_piece(u, "", finish_reason="stop", pooled=vector) for u in uids))
        )
        await asyncio.sleep(0)
    await asyncio.wait_for(reader, 5)
    control = ring_client.ring.of(protocol.Pause) + ring_client.ring.of(protocol.Resume)
    assert len(control) <= 2 * 2048, f"{len(control)} Pause/Resume frames for 2048 inputs"
    assert results == 2048


def test_a_generation_that_fills_its_buffer_is_still_paused():
    ring_client = _ring_client()
    ex = ring_client.open(_generate())
    for _ in range(70):
        ring_client.route(_replies(_piece(ex.uids[0])))
    assert ex.paused and len(ring_client.ring.of(protocol.Pause)) == 1


# ── 6. a client that stops reading ─────────────────────────────────────────────────────────────
async def test_a_slow_client_abort_frees_the_request_and_ends_its_response():
    """Over real uvicorn: the handler waits on a write the client never takes; the abort frees
    the request at once and ends the response, so the connection closes."""
    app, ring_client = _app()
    sock = listening_socket("127.0.0.1", 0)
    config = uvicorn.Config(app, lifespan="off", http="httptools", log_level="critical")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    loop = asyncio.get_running_loop()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    client.setblocking(False)
    try:
        while not server.started:  # noqa: ASYNC110 (uvicorn offers no event)
            await asyncio.sleep(0.01)
        await loop.sock_connect(client, sock.getsockname())
        payload = json.dumps({"model": "tiny", "prompt": "p", "stream": True, "max_tokens": 10**5})
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        await loop.sock_sendall(
            client, f"{head}Content-Length: {len(payload)}\r\n\r\n{payload}".encode()
        )
        (uid,) = await _opened(ring_client, 1)
        ex = ring_client.exchanges[uid]
        for _ in range(20_000):
            if ex.paused:
                break
            ring_client.route(_replies(_piece(uid, "y" * 200)))
            await asyncio.sleep(0)
        assert ex.paused, "the unread stream was never paused"
        ring_client.check_exchanges(time.monotonic() + Settings().slow_client_timeout + 1)
        assert ex.error is not None and ex.error.code == "slow_client"
        assert ring_client.exchanges == {} and len(ring_client.ledger) == 0
        assert ex.depth == 0
        # The connection is closed: once the client reads what was already written, it ends.
        async with asyncio.timeout(3):
            while await loop.sock_recv(client, 1 << 16):
                pass
    finally:
        client.close()
        server.should_exit = True
        await serving
