"""The built image: `tools/image build` once per session, then podman runs it as a pod would.

The image is the CPU variant (a debootstrapped Debian base and the CPU torch wheel, both
cached between runs under /var/cache/tokenline-image). Containers run with runc as uid
10001, a read-only root, every capability dropped and only the pod's volumes writable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from image_testkit import IMAGE, RUNC, Containers

REPO = Path(__file__).resolve().parents[2]
#: A cold build (debootstrap, wheels, both stages) takes about 4 minutes on 2 cores.
BUILD_TIMEOUT_S = 1500


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "image: builds the container image and runs it (make image-test)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.image)


def _missing() -> list[str]:
    tools = {"buildah": "buildah", "podman": "podman", "debootstrap": "debootstrap"}
    gone = [pkg for pkg, tool in tools.items() if not shutil.which(tool)]
    if not os.path.exists(RUNC):
        gone.append("runc")
    return gone


@pytest.fixture(scope="session")
def image() -> str:
    """The image's name, built from this checkout (warm: seconds; cold: minutes)."""
    if os.geteuid() != 0:
        pytest.skip("the image test runs buildah and podman as root (CI does)")
    if missing := _missing():
        pytest.fail(f"missing {' '.join(missing)}: run `tools/image setup image` (make test does)")
    done = subprocess.run(
        [str(REPO / "tools" / "image"), "build"],
        env={**os.environ, "IMAGE": IMAGE, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=False,
        timeout=BUILD_TIMEOUT_S,
    )
    if done.returncode != 0:
        pytest.fail(f"tools/image build failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}")
    return IMAGE


@pytest.fixture
def containers() -> Iterator[Containers]:
    box = Containers()
    try:
        yield box
    finally:
        print(box.logs())
        box.remove()
