"""TLS at the pod: `tokenline api --ssl-certfile/--ssl-keyfile` serves HTTPS with a certificate
made at test time (by the `openssl` binary), and nothing in plain HTTP."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.request

import httpx
import openai
import pytest
from api_testkit import api_process

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    where = tmp_path_factory.mktemp("tls")
    cert, key = str(where / "cert.pem"), str(where / "key.pem")
    argv = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    argv += ["-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1"]
    argv += ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(argv, check=True, capture_output=True)
    return cert, key


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
