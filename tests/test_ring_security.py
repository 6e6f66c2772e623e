"""The ring's sockets: local by default, refused beyond the machine unless CurveZMQ protects
them, and then only peers holding an allowed key get a frame through."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth

from tokenline import protocol
from tokenline.ring_security import InsecureRing, RingSecurity, create_keys, is_local
from tokenline.transport import RingEndpoints, SyncRing


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("ipc:///run/tokenline/api.sock", True),
        ("inproc://ring", True),
        ("tcp://127.0.0.1:5601", True),
        ("tcp://127.0.0.9:5601", True),
        ("tcp://localhost:5601", True),
        ("tcp://[::1]:5601", True),
        ("tcp://0.0.0.0:5601", False),
        ("tcp://*:5601", False),
        ("tcp://10.0.0.7:5601", False),
        ("tcp://[::]:5601", False),
        ("tcp://scheduler.svc:5601", False),
        ("tcp://eth0:5601", False),
    ],
)
def test_only_loopback_and_ipc_count_as_local(endpoint, local):
    assert is_local(endpoint) is local


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exposed_endpoints(tmp_path: Path) -> tuple[RingEndpoints, int]:
    """The tokenizer binds every interface; its next stage is local."""
    port = _free_port()
    endpoints = RingEndpoints.in_directory(str(tmp_path))
    endpoints = RingEndpoints(
        api=endpoints.api,
        tokenizer=f"tcp://0.0.0.0:{port}",
        scheduler=endpoints.scheduler,
        detokenizer=endpoints.detokenizer,
    )
    return endpoints, port


def test_a_stage_refuses_an_exposed_endpoint_without_curve(tmp_path):
    endpoints, _ = _exposed_endpoints(tmp_path)
    with pytest.raises(InsecureRing, match="--ring-curve-keys"):
        SyncRing("tokenizer", endpoints)


def test_allow_insecure_ring_starts_and_says_so(tmp_path, caplog):
    endpoints, _ = _exposed_endpoints(tmp_path)
    with caplog.at_level(logging.WARNING):
        ring = SyncRing("tokenizer", endpoints, RingSecurity(allow_insecure=True))
    ring.close()
    assert "plaintext" in caplog.text and "0.0.0.0" in caplog.text


def _received(ring: SyncRing, timeout: float = 1.5) -> list:
    deadline = time.monotonic() + timeout
    got: list = []
    while time.monotonic() < deadline and not got:
        ring.poll(100)
        got = [m for _, m in ring.recv_timed() if isinstance(m, protocol.Heartbeat)]
    return got


def _sender(port: int, keys: tuple[bytes, bytes] | None, server_key: bytes | None):
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        push.curve_publickey, push.curve_secretkey = keys
        push.curve_serverkey = server_key
    push.connect(f"tcp://127.0.0.1:{port}")
    return ctx, push


def test_with_curve_only_peers_with_an_allowed_key_get_through(tmp_path):
    keys_dir = tmp_path / "keys"
    secret_file = create_keys(str(keys_dir))
    assert oct(os.stat(secret_file).st_mode & 0o777) == "0o600"
    ring_public, ring_secret = zmq.auth.load_certificate(secret_file)
    stranger_dir = tmp_path / "stranger"
    stranger = zmq.auth.load_certificate(create_keys(str(stranger_dir)))
    endpoints, port = _exposed_endpoints(tmp_path)
    ring = SyncRing("tokenizer", endpoints, RingSecurity(curve_keys=str(keys_dir)))
    heartbeat = msgspec.msgpack.encode(protocol.Heartbeat(seq=1, origin="test"))
    attempts = {
        "plaintext": (None, None),
        "unknown key": (stranger, ring_public),
        "ring key": ((ring_public, ring_secret), ring_public),
    }
    received = {}
    try:
        for name, (keys, server_key) in attempts.items():
            ctx, push = _sender(port, keys, server_key)
            try:
                push.send(heartbeat)
                received[name] = len(_received(ring))
            finally:
                push.close()
                ctx.term()
    finally:
        ring.close()
    assert received == {"plaintext": 0, "unknown key": 0, "ring key": 1}


def test_ring_keys_writes_a_certificate_the_stages_load(tmp_path):
    out = tmp_path / "keys"
    done = subprocess.run(
        [sys.executable, "-m", "tokenline.cli", "ring-keys", "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(done.stdout.strip()) == out / "ring.key_secret"
    assert (out / "ring.key").exists()
    public, secret = zmq.auth.load_certificate(out / "ring.key_secret")
    assert public and secret


def _listening_tcp_ports(pid: int) -> set[int]:
    """TCP ports the process listens on (from /proc: its socket inodes in LISTEN state)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_nothing_of_the_ring_listens_on_a_network_port(stack):
    """The stages of `tokenline serve` listen on TCP only for HTTP and metrics; the ring is IPC."""
    allowed = {
        "api": {stack.port},
        "tokenizer": {stack.port + 1},
        "scheduler": {stack.port + 2},
        "detokenizer": {stack.port + 3},
    }
    for stage, ports in allowed.items():
        assert _listening_tcp_ports(stack.pid_of(stage)) == ports, stage


def test_four_stages_serve_over_a_curve_ring_on_tcp(tmp_path, model_cache):
    """Every stage binds all interfaces, so the ring must be, and is, encrypted and
    authenticated end to end: the api's asyncio sockets included."""
    import httpx

    keys = tmp_path / "keys"
    create_keys(str(keys))
    ports = [_free_port() for _ in range(5)]
    ring = [
        f"--{stage}-endpoint=tcp://0.0.0.0:{port}"
        for stage, port in zip(protocol.STAGES, ports[:4], strict=True)
    ]
    common = [*ring, f"--ring-curve-keys={keys}", f"--model-cache-dir={model_cache}"]
    cli = [sys.executable, "-m", "tokenline.cli"]
    api_port = ports[4]
    commands = [
        [*cli, stage, *common, "--metrics-port=0"]
        for stage in ("scheduler", "tokenizer", "detokenizer")
    ]
    commands.append([*cli, "api", *common, "--host=127.0.0.1", f"--port={api_port}"])
    log = open(tmp_path / "stages.log", "w")
    processes = [subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT) for c in commands]
    try:
        url = f"http://127.0.0.1:{api_port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert all(p.poll() is None for p in processes), (tmp_path / "stages.log").read_text()
            time.sleep(0.3)
        else:
            pytest.fail(
                "the curve ring never became ready: " + (tmp_path / "stages.log").read_text()
            )
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "over curve", "max_tokens": 3},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(30)
        log.close()
