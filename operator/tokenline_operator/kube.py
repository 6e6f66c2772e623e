"""A small async Kubernetes client for plain-dict objects, over kubernetes_asyncio.

Only what reconciliation needs: get, create, server-side apply, delete, status patch and API
discovery. Objects stay dicts end to end, so the builders' output is sent as it is.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from . import names


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    def path(self, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{root}/namespaces/{namespace}/{self.plural}"
        if name:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return path


KINDS: dict[str, Kind] = {
    k.kind: k
    for k in (
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Secret", "secrets"),
        Kind("v1", "Service", "services"),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
        Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
        Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind("v1", "ServiceAccount", "serviceaccounts"),
        Kind("v1", "Pod", "pods"),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind(names.INFERENCE_POOL_API_VERSION, "InferencePool", "inferencepools"),
        Kind(names.API_VERSION, names.KIND, names.PLURAL),
    )
}

_OBJECT = {200: "object", 201: "object", 202: "object"}


class KubeError(RuntimeError):
    """An API call failed; ``status`` is the HTTP status (0 when none came back)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def load_configuration() -> k8s_client.Configuration:
    """In-cluster service account first, then the developer's kubeconfig.

    ``$KUBECONFIG`` is read now, not when kubernetes_asyncio was imported (which freezes
    its own default), so a process can point it elsewhere at any time before connecting.
    """
    configuration = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException:
        await k8s_config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or None,
            client_configuration=configuration,
        )
    return configuration


class Kube:
    """Plain-dict CRUD on namespaced objects, with a cached view of optional APIs."""

    def __init__(self, api: k8s_client.ApiClient, *, discovery_ttl: float = 300.0) -> None:
        self._api = api
        self._discovery_ttl = discovery_ttl
        self._discovered: dict[str, tuple[float, set[str]]] = {}
        self._discovering: dict[str, asyncio.Lock] = {}
        self._version: tuple[float, tuple[int, int] | None] | None = None

    @classmethod
    async def connect(cls, **kwargs: Any) -> Kube:
        return cls(k8s_client.ApiClient(await load_configuration()), **kwargs)

    async def close(self) -> None:
        await self._api.close()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> Any:
        try:
            return await self._api.call_api(
                path,
                method,
                query_params=query or [],
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                response_types_map=_OBJECT,
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
            )
        except ApiException as exc:
            raise KubeError(
                exc.status or 0, f"{method} {path}: {exc.status} {exc.reason}: {_message(exc.body)}"
            ) from exc

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", KINDS[kind].path(namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict]:
        """The objects of ``kind`` in ``namespace`` whose labels match ``selector``."""
        labels = ",".join(f"{key}={value}" for key, value in selector.items())
        listing = await self._call(
            "GET", KINDS[kind].path(namespace), query=[("labelSelector", labels)]
        )
        return list(listing.get("items") or [])

    async def server_version(self, *, max_age: float | None = None) -> tuple[int, int] | None:
        """The API server's (major, minor) from ``/version``; None when it does not say
        (cached like discovery)."""
        max_age = self._discovery_ttl if max_age is None else max_age
        if self._version is not None and time.monotonic() - self._version[0] < max_age:
            return self._version[1]
        try:
            info = await self._call("GET", "/version")
            found = _version_of(info)
        except KubeError:
            found = None
        self._version = (time.monotonic(), found)
        return found

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind = KINDS[obj["kind"]]
        return await self._call("POST", kind.path(obj["metadata"]["namespace"]), body=obj)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply with force: the operator owns every field it sets."""
        kind = KINDS[obj["kind"]]
        meta = obj["metadata"]
        return await self._call(
            "PATCH",
            kind.path(meta["namespace"], meta["name"]),
            body=obj,
            content_type="application/apply-patch+yaml",
            query=[("fieldManager", names.FIELD_MANAGER), ("force", "true")],
        )

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete with foreground-free defaults; False when it was already gone."""
        try:
            await self._call("DELETE", KINDS[kind].path(namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def patch_status(
        self, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        return await self._call(
            "PATCH",
            KINDS[kind].path(namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def serves(self, kind: str, *, max_age: float | None = None) -> bool:
        """Whether the cluster serves ``kind`` (its CRD is installed).

        The answer comes from API discovery at most ``max_age`` seconds old (default: the
        client's discovery TTL); ``max_age=0`` asks the API server now.
        """
        ref = KINDS[kind]
        max_age = self._discovery_ttl if max_age is None else max_age
        return ref.plural in await self._plurals(ref.api_version, max_age)

    async def _plurals(self, api_version: str, max_age: float) -> set[str]:
        # One discovery request per group version at a time: callers that find the cache
        # expired together (every reconcile after the TTL) share the first one's answer.
        lock = self._discovering.setdefault(api_version, asyncio.Lock())
        async with lock:
            cached = self._discovered.get(api_version)
            if cached is not None and time.monotonic() - cached[0] < max_age:
                return cached[1]
            root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            try:
                listing = await self._call("GET", root)
                plurals = {r.get("name", "") for r in listing.get("resources", [])}
            except KubeError as exc:
                if exc.status != 404:
                    raise
                plurals = set()
            self._discovered[api_version] = (time.monotonic(), plurals)
            return plurals


def _version_of(info: Any) -> tuple[int, int] | None:
    """(1, 35) from ``{"major": "1", "minor": "35+"}`` (or its gitVersion ``v1.35.0-eks``)."""
    if not isinstance(info, dict):
        return None
    try:
        return int(info["major"]), int(str(info["minor"]).rstrip("+"))
    except (KeyError, ValueError):
        pass
    match = re.match(r"v?(\d+)\.(\d+)", str(info.get("gitVersion", "")))
    return (int(match[1]), int(match[2])) if match else None


def _message(body: Any) -> str:
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str):
        try:
            parsed = json.loads(body)
            if isinstance(parsed, dict) and parsed.get("message"):
                return str(parsed["message"])
        except ValueError:
            pass
        return body[:500]
    return str(body)
