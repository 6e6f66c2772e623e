"""The api's FastAPI app in-process, without the ring: a stand-in ring client that records what
reaches admission, so tests of auth, limits and validation need no running stack."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tokenline.api.app import create_app
from tokenline.api.http.errors import ApiError
from tokenline.api.ring.health import RingHealth
from tokenline.settings import Settings

ADMITTED = 299  # the stand-in's answer once a request reaches admission: nothing refused it


@dataclass
class StandInRingClient:
    settings: Settings
    model: str = "tiny"
    ready: bool = True
    draining: bool = False
    opened: list = field(default_factory=list)
    # no stage has reported: every stage status unknown, grammars not refused
    health: RingHealth = field(default_factory=RingHealth)

    def problem(self) -> str | None:
        return None if self.ready else "stand-in not ready"

    def open(self, messages, tenant=""):
        # encoded as the ring would: what reaches here must be carriable
        for i, message in enumerate(messages):
            message.uid = f"uid-{i}"
            msgspec.msgpack.encode(message)
        self.opened.append(messages)
        raise ApiError(ADMITTED, "admitted (stand-in ring client)", "admitted")


def app_with(**settings) -> tuple[FastAPI, StandInRingClient]:
    app = create_app(Settings(**settings))
    ring_client = StandInRingClient(app.state.settings)
    app.state.ring_client = ring_client  # the lifespan, which would start the ring, never runs
    return app, ring_client


def client_for(app: FastAPI) -> TestClient:
    return TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1")


def self_signed_certificate(where: Path, name: str = "127.0.0.1") -> tuple[str, str]:
    """A self-signed certificate for ``name`` (an IP address or a DNS name) and its key, made
    by the `openssl` binary (the caller skips where there is none)."""
    cert, key = str(where / f"{name}.pem"), str(where / f"{name}.key.pem")
    alt = f"IP:{name}" if name.replace(".", "").isdigit() else f"DNS:{name}"
    argv = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    argv += ["-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", f"/CN={name}"]
    argv += ["-addext", f"subjectAltName={alt}"]
    subprocess.run(argv, check=True, capture_output=True)
    return cert, key


@dataclass
class ApiProcess:
    """`tokenline api` alone: its ring points at sockets no stage serves, so /health, auth,
    limits and /v1/models answer, and nothing reaches a stage."""

    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def api_process(workdir: Path, *flags: str, ca_file: str | None = None) -> Iterator[ApiProcess]:
    port = _free_port()
    scheme = "https" if ca_file else "http"
    endpoints = []
    for stage in ("api", "tokenizer", "scheduler", "detokenizer"):
        endpoints += [f"--{stage}-endpoint", f"ipc://{workdir}/{stage}.sock"]
    argv = [sys.executable, "-m", "tokenline.cli", "api", "--host", "127.0.0.1"]
    argv += ["--port", str(port), *endpoints, *flags]
    log_path = workdir / f"api-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    api = ApiProcess(process, f"{scheme}://127.0.0.1:{port}", log_path)
    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"tokenline api exited:\n{api.log()}")
            try:
                with urllib.request.urlopen(f"{api.url}/health", timeout=2, context=context):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tokenline api did not serve:\n{api.log()}") from None
                time.sleep(0.1)
        yield api
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ── bad inputs, shared by the in-process tests and the fuzz run against the stack ──────────────
# (field, value): beyond what the field's range, the wire format or the stages can carry
OUT_OF_RANGE = [
    ("max_tokens", 2**64),
    ("max_tokens", -1),  # 0 is in range on completions: it scores the prompt with echo
    ("max_tokens", -(2**63) - 1),
    ("top_k", 2**64),
    ("top_k", -2),
    ("seed", 2**64),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("min_tokens", 2**64),
    ("min_tokens", -1),
    ("n", 0),
    ("n", 2**64),
    ("temperature", 1e308 * 10),
    ("repetition_penalty", 1e300),
    ("stop_token_ids", [2**64]),
    ("stop_token_ids", [-(2**63) - 1]),
    ("stop_token_ids", [-1]),
    ("logprobs", 10**30),
]


# (path, body, param): a lone surrogate in each kind of string
SURROGATES = [
    ("completions", {"prompt": "\ud800"}, "prompt"),
    ("completions", {"prompt": ["ok \udfff"]}, "prompt.0"),
    ("completions", {"prompt": "x", "stop": "\ud800"}, "stop"),
    ("completions", {"prompt": "x", "stop": ["fine", "\ud83d"]}, "stop.1"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, None),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]},
        None,
    ),
    ("chat/completions", {"messages": [{"role": "\ud800", "content": "x"}]}, None),
]

# (raw body, Content-Type, param or None): bodies that are not what they claim to be
BAD_BODIES = [
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "application/json", "temperature"),
    (b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', "application/json", "top_p"),
    (b'{"model":"tiny","prompt":"x","repetition_penalty":-Infinity}', "application/json", None),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "application/json", None),
    (b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', "application/json", "prompt"),  # CESU
    (b'{"model": "tiny", "prompt": "tru', "application/json", None),
    (b'{"model": "tiny", "prompt": [', "application/json", None),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", None),
    (b'{"model": "tiny", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None, None),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None, None),
    (b'{"model": "tiny", "prompt": "x"}', "text/plain", None),
    (b"model=tiny&prompt=x", "application/x-www-form-urlencoded", None),
    (b'{"model": "tiny", "prompt": "x"}', None, None),
    (b"", "application/json", None),
    (b"null", "application/json", None),
    (b'"a string"', "application/json", None),
    (b'{"model": "tiny", "prompt": 5}', "application/json", "prompt"),
    (b'{"model": "tiny", "prompt": {"nested": {"deep": []}}}', "application/json", "prompt"),
    (b'{"model": 7, "prompt": "x"}', "application/json", "model"),
    (b'{"model": "tiny", "prompt": "x", "n": "many"}', "application/json", "n"),
    (b'{"model": "tiny", "prompt": "x", "stream": "maybe"}', "application/json", "stream"),
    (b'{"model": "tiny", "messages": []}', "application/json", "messages"),
    (b'{"model": "tiny", "messages": [{"role": "robot"}]}', "application/json", None),
    # logit_bias is checked before pydantic's own type checks: every raw shape must be a 400
    (
        b'{"model": "tiny", "prompt": "x", "logit_bias": {"1": {"a": 1}}}',
        "application/json",
        "logit_bias",
    ),
    (
        b'{"model": "tiny", "prompt": "x", "logit_bias": {"1": true}}',
        "application/json",
        "logit_bias",
    ),
    (b'{"model": "tiny", "prompt": "x", "logit_bias": [1, 2]}', "application/json", "logit_bias"),
    (
        b'{"model": "tiny", "prompt": "x", "logit_bias": {"-1": 1}}',
        "application/json",
        "logit_bias",
    ),
]
