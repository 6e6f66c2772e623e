"""A stand-in SSE server in a subprocess, shared by the load generator's measurement tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

SERVER = Path(__file__).with_name("stand_in_sse_server.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def stand_in_server() -> Iterator[str]:
    """Base URL of the stand-in server; profiles live under ``{base}/<profile>``."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(SERVER), str(port)])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                httpx.get(f"{base}/fast/v1/models", timeout=1, trust_env=False)
                break
            except httpx.HTTPError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("stand-in SSE server did not start") from None
                time.sleep(0.05)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
