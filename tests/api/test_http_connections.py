"""HTTP connections: an idle keep-alive connection outlives the clients' own idle timeouts, so
a client reusing it never races the server closing it."""

from __future__ import annotations

import http.client
import json
import time

CLIENT_IDLE_TIMEOUT_S = 5.0  # httpx's (and so the OpenAI SDK's) keep-alive expiry


def _complete(conn: http.client.HTTPConnection, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "keep alive", "max_tokens": 2})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("Connection", "keep-alive").lower() != "close"
    return json.loads(response.read())


def test_an_idle_keep_alive_connection_is_still_open_after_the_clients_idle_timeout(stack):
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
    try:
        _complete(conn, stack.model)
        local_port = conn.sock.getsockname()[1]
        time.sleep(CLIENT_IDLE_TIMEOUT_S + 1.0)
        assert _complete(conn, stack.model)["choices"]
        # http.client reconnects silently when the server has closed: same socket, or fail
        assert conn.sock.getsockname()[1] == local_port, "the server closed the idle connection"
    finally:
        conn.close()
