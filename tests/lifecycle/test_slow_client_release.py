"""A client that stops reading and keeps its socket open: the slow-client abort frees the
request in the api at once (not at deadline plus grace) and the server closes the connection."""

from __future__ import annotations

import json
import socket
import time

import pytest

pytestmark = pytest.mark.timeout(120)


def _aborts(stack) -> float:
    return stack.metric("api", "tokenline_aborts_total", reason="slow_client")


def _api_live_uids(stack) -> float:
    return stack.metric("api", "tokenline_live_uids", stage="api")


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _unread_stream(stack) -> socket.socket:
    """A streamed completion over a socket with a tiny receive buffer, never read from."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", stack.port))
    body = {"model": "tiny", "prompt": "never read", "stream": True, "max_tokens": 1900}
    payload = json.dumps({**body, "ignore_eos": True}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_a_slow_client_abort_frees_the_api_and_closes_the_connection(stack, nothing_held):
    before = _aborts(stack)  # the session stack: a 4 s slow-client limit
    sock = _unread_stream(stack)
    try:
        assert _wait_for(lambda: _aborts(stack) > before, 30), "the stream was never aborted"
        assert _wait_for(lambda: _api_live_uids(stack) == 0, 2), "the api still holds the uid"
        # Closed by the server: what it had written comes out, then the end of the stream
        # (a response left open would keep the kept-alive connection waiting instead).
        sock.settimeout(5)
        while sock.recv(1 << 16):
            pass
    finally:
        sock.close()
    nothing_held(stack)
