"""Session fixtures: the tiny model, built once, and one running four-process stack."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tokenline import tiny_model

MODEL = "tiny"


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("model-cache")
    tiny_model.ensure_cached(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_tokenizer(model_cache):
    from tokenline.model_source import resolve

    return resolve("tiny", cache_dir=str(model_cache)).load_tokenizer()


def free_port_block(count: int = 4) -> int:
    """A port P such that P..P+count-1 are free on loopback right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65535:
            continue
        try:
            socks = []
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free block of ports")


@pytest.fixture(scope="session")
def port_block():
    """`free_port_block`, for test modules that cannot import this conftest by name."""
    return free_port_block


def children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == current]
        found += kids
        frontier += kids
    return found


@dataclass
class Stack:
    process: subprocess.Popen
    port: int
    ipc_dir: str
    model: str = MODEL
    log_path: str = ""
    stage_pids: dict[str, int] = field(default_factory=dict)
    ca_file: str | None = None  # the api serves HTTPS with this (self-signed) certificate

    @property
    def api_url(self) -> str:
        scheme = "https" if self.ca_file else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        """What trusts the api's certificate (None over plain HTTP)."""
        return ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None

    @property
    def metrics_urls(self) -> dict[str, str]:
        urls = {"api": f"{self.api_url}/metrics"}
        for offset, stage in enumerate(("tokenizer", "scheduler", "detokenizer"), start=1):
            urls[stage] = f"http://127.0.0.1:{self.port + offset}/metrics"
        return urls

    def descendants(self) -> list[int]:
        return children_of(self.process.pid)

    def pid_of(self, stage: str) -> int:
        for pid in children_of(self.process.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"tokenline.cli" in cmdline and stage.encode() in cmdline[3:4]:
                return pid
        raise LookupError(f"no {stage} process")

    def ready(self) -> bool:
        try:
            ready = f"{self.api_url}/ready"
            with urllib.request.urlopen(ready, timeout=2, context=self.ssl_context()) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tokenline serve exited: see {self.log_path}")
            if self.ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"stack not ready in {timeout}s: see {self.log_path}")

    def metric(self, of: str, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` with ``labels`` on stage ``of``'s /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        context = self.ssl_context() if of == "api" else None
        with urllib.request.urlopen(self.metrics_urls[of], timeout=5, context=context) as r:
            text = r.read().decode()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    total += sample.value
        return total

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def start_stack(model_cache: Path, log_dir: Path, *extra: str, ca_file: str | None = None) -> Stack:
    """A running stack; started again on other ports when one it probed free was taken before
    a stage bound it (another process's ephemeral port: the probe cannot reserve them)."""
    for _ in range(2):
        try:
            return _start_stack(model_cache, log_dir, *extra, ca_file=ca_file)
        except PortTaken:
            pass
    return _start_stack(model_cache, log_dir, *extra, ca_file=ca_file)


class PortTaken(RuntimeError):
    """A stage of the stack could not bind its port."""


def _start_stack(model_cache: Path, log_dir: Path, *extra: str, ca_file: str | None) -> Stack:
    port = free_port_block()
    ipc_dir = tempfile.mkdtemp(prefix="tl-ring-")
    os.rmdir(ipc_dir)  # serve creates it; the test checks that it is gone afterwards
    os.makedirs(ipc_dir)
    log_path = str(log_dir / f"serve-{port}.log")
    argv = [
        sys.executable,
        "-m",
        "tokenline.cli",
        "serve",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--model-cache-dir",
        str(model_cache),
        "--ipc-dir",
        ipc_dir,
        *extra,
    ]
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    stack = Stack(process=process, port=port, ipc_dir=ipc_dir, log_path=log_path, ca_file=ca_file)
    try:
        stack.wait_ready()
    except BaseException as exc:
        stack.stop()
        if "Address already in use" in Path(log_path).read_text(errors="replace"):
            raise PortTaken(f"a port of {port}..{port + 3} was taken: {log_path}") from exc
        raise
    return stack


# Short limits so lifecycle behaviour shows within a test's time; generous enough for 2 cores.
STACK_FLAGS = ("--request-timeout", "60", "--slow-client-timeout", "4", "--drain-timeout", "5")


@pytest.fixture(scope="session")
def stack(model_cache, tmp_path_factory):
    running = start_stack(model_cache, tmp_path_factory.mktemp("logs"), *STACK_FLAGS)
    yield running
    running.stop()


@pytest.fixture
def api_base(stack) -> str:
    return f"{stack.api_url}/v1"


@pytest.fixture(scope="session")
def launch_stack(model_cache, tmp_path_factory):
    """Start an extra stack with other flags (the caller stops it)."""

    def launch(*flags: str, ca_file: str | None = None) -> Stack:
        return start_stack(model_cache, tmp_path_factory.mktemp("logs"), *flags, ca_file=ca_file)

    return launch
