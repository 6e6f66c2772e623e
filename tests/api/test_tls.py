"""TLS at the pod: `tokenline api --ssl-certfile/--ssl-keyfile` serves HTTPS with a certificate
made at test time (by the `openssl` binary), and nothing in plain HTTP; `tokenline serve`'s probe
of its api trusts that certificate. (`tokenline serve` with TLS, end to end:
tests/api/test_vllm_command_lines.py.)"""

from __future__ import annotations

import contextlib
import http.server
import shutil
import ssl
import threading
import urllib.request
from collections.abc import Iterator

import httpx
import openai
import pytest
from api_testkit import api_process, self_signed_certificate

from tokenline.serve import probe_context, wait_ready
from tokenline.settings import Settings

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


def test_the_api_serves_https_with_the_given_certificate(tmp_path, certificate):
    cert, key = certificate
    flags = ("--ssl-certfile", cert, "--ssl-keyfile", key, "--api-key", "sk-tls")
    with api_process(tmp_path, *flags, ca_file=cert) as api:
        assert api.url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=cert)) as http:
            assert http.get(f"{api.url}/health").json() == {"status": "ok"}
            client = openai.OpenAI(
                base_url=f"{api.url}/v1", api_key="sk-tls", http_client=http, max_retries=0
            )
            assert [m.id for m in client.models.list().data] == ["tiny"]
            assert http.get(f"{api.url}/v1/models").status_code == 401
        # a client that does not trust the certificate refuses it
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{api.url}/health")
        # and plain HTTP on the same port gets no answer
        plain = api.url.replace("https://", "http://")
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{plain}/health", timeout=5).read()


@contextlib.contextmanager
def https_server(cert: str, key: str) -> Iterator[str]:
    """A one-thread HTTPS server on loopback that answers 200 to anything."""

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Ok)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/ready"
    finally:
        server.shutdown()
        server.server_close()


def test_serve_probes_its_api_with_the_api_s_own_certificate(tmp_path):
    """`tokenline serve --ssl-certfile` probes /ready at 127.0.0.1, which a deployment's
    certificate does not name: the probe trusts that certificate alone, without the hostname
    check, and still refuses a server that holds another one."""
    cert, key = self_signed_certificate(tmp_path, "llm.example.com")
    other_cert, other_key = self_signed_certificate(tmp_path, "127.0.0.1")
    settings = Settings(ssl_certfile=cert, ssl_keyfile=key)
    with https_server(cert, key) as url:
        assert wait_ready(url, [], 5, probe_context(settings))
    with https_server(other_cert, other_key) as url:
        assert not wait_ready(url, [], 1, probe_context(settings))
    assert probe_context(Settings()) is None  # plain HTTP without a certificate
