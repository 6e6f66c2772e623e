"""Fixtures for the fetch tests: the servers of fetch_servers.py, started and stopped, moto's
S3 server, and the environment each source reads."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from fetch_servers import FakeHub, FileServer


@pytest.fixture
def file_server() -> Iterator[FileServer]:
    server = FileServer()
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


@pytest.fixture
def hub(file_server: FileServer, monkeypatch: pytest.MonkeyPatch, tmp_path) -> FakeHub:
    monkeypatch.setenv("HF_ENDPOINT", file_server.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file of the user's
    return FakeHub(file_server)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Credentials the way a Secret provides them: environment variables."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTESTFETCH")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-never-logged")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return moto_server
