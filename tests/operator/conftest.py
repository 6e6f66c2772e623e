"""Fixtures: kmock's Kubernetes emulator, and the operator running against it in-process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
from operator_testkit import IS_RESOURCE, free_port, write_kubeconfig

from tokenline_operator import handlers, names
from tokenline_operator.metrics import OperatorMetrics


@pytest.fixture
def optional_apis() -> set[str]:
    """Optional APIs the emulated cluster serves; tests override it (keda, monitoring,
    inferencepool, lws)."""
    return set()


@pytest.fixture
async def cluster(
    kmock: kmock.KubernetesEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    optional_apis: set[str],
) -> kmock.KubernetesEmulator:
    """The emulated API server: built-in resources, our CRD, and KUBECONFIG pointing at it."""
    kmock.resources.load_bundled()
    kmock.resources[IS_RESOURCE] = kmock.ResourceInfo(
        kind=names.KIND,
        singular=names.SINGULAR,
        namespaced=True,
        shortnames=set(names.SHORT_NAMES),
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
        subresources={"status", "scale"},
    )
    verbs = {"get", "list", "watch", "create", "patch", "delete"}
    if "keda" in optional_apis:
        kmock.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
            kind="ScaledObject", namespaced=True, verbs=verbs
        )
    if "monitoring" in optional_apis:
        kmock.resources["monitoring.coreos.com/v1/podmonitors"] = kmock.ResourceInfo(
            kind="PodMonitor", namespaced=True, verbs=verbs
        )
    if "inferencepool" in optional_apis:
        kmock.resources["inference.networking.k8s.io/v1/inferencepools"] = kmock.ResourceInfo(
            kind="InferencePool", namespaced=True, verbs=verbs, subresources={"status"}
        )
    if "lws" in optional_apis:
        kmock.resources["leaderworkerset.x-k8s.io/v1/leaderworkersets"] = kmock.ResourceInfo(
            kind="LeaderWorkerSet", namespaced=True, verbs=verbs, subresources={"status"}
        )
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, str(kmock.servers[0].url).rstrip("/"))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return kmock


@pytest.fixture
def discovery_interval() -> float:
    """Seconds between the operator's looks at API discovery: short, so tests that install
    or remove a CRD see the effect quickly, and every other test runs with the loop busy."""
    return 0.2


@pytest.fixture
def operator(
    cluster: kmock.KubernetesEmulator, discovery_interval: float
) -> Iterator[dict[str, Any]]:
    """The operator's kopf loop, in a thread with its own event loop (as kopf's KopfRunner).

    Its own loop matters: on exit kopf waits for, then cancels, every task of its loop,
    which in the test's loop would include the emulator's open watch streams.
    """
    metrics = OperatorMetrics()
    memo = kopf.Memo(
        metrics=metrics, default_image="tokenline:test", discovery_interval=discovery_interval
    )
    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0.05
    settings.persistence.consistency_timeout = 0.2
    settings.queueing.exit_timeout = 0.2  # handlers still queued when a test ends
    ready, stop = threading.Event(), threading.Event()
    failure: list[BaseException] = []
    health = f"http://127.0.0.1:{free_port()}/healthz"

    def run() -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=handlers.registry,
                    settings=settings,
                    standalone=True,
                    clusterwide=True,
                    memo=memo,
                    liveness_endpoint=health,
                    ready_flag=ready,
                    stop_flag=stop,
                )
            )
        except BaseException as exc:
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name="operator", daemon=True)
    thread.start()
    assert ready.wait(timeout=10), "the operator did not start"
    assert not failure, failure
    yield {"memo": memo, "metrics": metrics, "health": health}
    stop.set()
    # A test that ends while kopf scans the API's groups leaves those requests to give up
    # first: 5 s on an idle machine, over 15 once in a loaded full run. A hung operator
    # still fails here.
    thread.join(timeout=60)
    assert not thread.is_alive(), "the operator did not stop"
    assert not failure, failure
