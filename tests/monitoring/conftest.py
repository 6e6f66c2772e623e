"""Fixtures for the monitoring tests: promtool, and a real Prometheus scraping the running stack.

Both come from Debian's ``prometheus`` package (``apt-get install -y prometheus``); the system
service is never used: the fixture starts its own server on loopback with temporary storage.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from monitoring_support import Prometheus, free_port, scrape_config

INSTALL_HINT = "install Debian's prometheus package: apt-get install -y prometheus"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found; {INSTALL_HINT}")
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    return _tool("promtool")


@pytest.fixture(scope="session")
def prometheus(stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = _tool("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(stack.metrics_urls, free_port())))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (workdir / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_ready(proc, url, workdir)
            yield Prometheus(url)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen, url: str, workdir: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited {proc.returncode}: {_tail(workdir)}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"prometheus not ready after 60 s: {_tail(workdir)}")
        time.sleep(0.2)


def _tail(workdir: Path) -> str:
    return (workdir / "prometheus.log").read_text()[-2000:]
