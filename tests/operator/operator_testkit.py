"""Helpers shared by the operator tests (a plain module: tests/operator has no package)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml

from tokenline_operator import names

IS_RESOURCE = f"{names.GROUP}/{names.VERSION}/{names.PLURAL}"
NAMESPACE = "serving"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_kubeconfig(path: Path, server: str) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "kmock", "user": {"token": "test-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
                "current-context": "kmock",
            }
        )
    )


async def eventually(
    check: Callable[[], Awaitable[Any] | Any], within: float = 8.0, interval: float = 0.05
) -> Any:
    """Poll ``check`` until it returns something truthy without raising; return that."""
    deadline = asyncio.get_running_loop().time() + within
    last: BaseException | None = None
    while True:
        try:
            value = check()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
            last = None
        except (AssertionError, KeyError, ValueError, TypeError) as exc:
            last = exc
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met in {within}s") from last
        await asyncio.sleep(interval)


def inference_service(name: str = "chat", **spec: Any) -> dict[str, Any]:
    """An InferenceService of a small model in the test namespace; ``spec`` adds fields."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "generation": 1},
        "spec": {"model": {"name": "Qwen/Qwen2.5-0.5B-Instruct"}, **spec},
    }


def stored(cluster: Any, resource: str, name: str = "chat") -> dict:
    """The object as the emulator holds it now (KeyError while absent or deleted)."""
    obj = cluster.objects[resource, NAMESPACE, name]
    if obj.deleted:
        raise KeyError(name)
    return obj.raw


def absent(cluster: Any, resource: str, name: str) -> bool:
    try:
        stored(cluster, resource, name)
    except KeyError:
        return True
    return False
