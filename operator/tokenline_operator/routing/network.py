"""How clients reach the stage pods: the Service in front of the api, and the NetworkPolicy
that admits only the peers the spec names."""

from __future__ import annotations

from typing import Any

from .. import names
from ..crd import disaggregation
from ..crd.spec import Spec, tls_enabled
from ..objects import Manifest, Owner, metadata, picker_selector, selector_labels
from ..pods import parallel, router


def service_url(owner: Owner, spec: Spec) -> str:
    """The in-cluster base URL; OpenAI clients use it with ``/v1`` appended."""
    port = spec["service"]["port"]
    return f"http://{owner.name}.{owner.namespace}.svc.cluster.local:{port}"


def service(owner: Owner, spec: Spec) -> Manifest:
    svc = spec["service"]
    meta = metadata(owner, owner.name)
    if svc.get("annotations"):
        meta["annotations"] = dict(svc["annotations"])
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": svc["type"],
            "selector": _serving(owner, spec),
            "ports": [
                {
                    "name": "http",
                    "port": svc["port"],
                    "targetPort": names.PORT_NAMES["api"],
                    "protocol": "TCP",
                    "appProtocol": "https" if tls_enabled(spec) else "http",
                }
            ],
        },
    }


def _selector(labels: dict[str, str]) -> dict[str, Any]:
    # The API server drops an empty matchLabels: writing one would look like drift forever.
    return {"matchLabels": dict(labels)} if labels else {}


def network_peer(peer: dict[str, Any]) -> dict[str, Any]:
    """A spec peer as a NetworkPolicyPeer; without a namespace, the pods' own namespace."""
    if "cidr" in peer:
        return {"ipBlock": {"cidr": peer["cidr"]}}
    result: dict[str, Any] = {}
    if "namespace" in peer:
        result["namespaceSelector"] = _selector({names.LABEL_NAMESPACE_NAME: peer["namespace"]})
    elif "namespaceLabels" in peer:
        result["namespaceSelector"] = _selector(peer["namespaceLabels"])
    if "podLabels" in peer or not result:
        result["podSelector"] = _selector(peer.get("podLabels", {}))
    return result


def api_pods(owner: Owner, spec: Spec) -> dict[str, str]:
    """The pods that run the api: all of them, or a multi-node group's leaders (its workers
    run only a scheduler)."""
    selected = selector_labels(owner.name)
    if parallel.multi_node(spec):
        selected[parallel.LABEL_ROLE] = "leader"
    return selected


def _serving(owner: Owner, spec: Spec) -> dict[str, str]:
    """The pods the Service sends clients to: the api pods, or with spec.disaggregation the
    decode pods (a prefill pod answers only a decode pod's sidecar)."""
    selected = api_pods(owner, spec)
    if disaggregation.enabled(spec):
        selected[names.LABEL_LLMD_ROLE] = "decode"
    return selected


def _ports(*numbers: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": number} for number in numbers]


def network_policy(owner: Owner, spec: Spec, routing: bool = False) -> Manifest:
    """Ingress to the api port from ``apiFrom``, to every metrics port from ``metricsFrom``,
    with ``routing`` to the api port from the endpoint picker (it scrapes /metrics there), and
    with ``router.kvEvents`` to the events' ports from ``kvEventsFrom`` and from a picker that
    subscribes to them.

    The ring never crosses the pod (IPC), so no rule is needed for it; the kubelet's probes
    come from the node, which NetworkPolicy implementations let through.
    """
    policy = spec["networkPolicy"]
    api_peers = [network_peer(p) for p in policy.get("apiFrom") or [{}]]
    ingress = [{"from": api_peers, "ports": _ports(names.API_PORT)}]
    if routing:
        picker = {"podSelector": _selector(picker_selector(owner))}
        ingress.append({"from": [picker], "ports": _ports(names.API_PORT)})
    if router.kv_events_enabled(spec):
        # the KV-cache events and their replay: the picker that subscribes to every pod,
        # and whoever kvEventsFrom names (a router of one's own)
        subscribers = [network_peer(p) for p in policy.get("kvEventsFrom") or []]
        if routing and router.precise_routing(spec):
            subscribers.insert(0, {"podSelector": _selector(picker_selector(owner))})
        if subscribers:  # a rule without peers would admit everyone
            ports = _ports(*names.KV_EVENTS_PORT_NAMES)
            ingress.append({"from": subscribers, "ports": ports})
    if parallel.multi_node(spec) or disaggregation.enabled(spec):
        # the ranks of a group meet at the leader's rendezvous port, then talk over ports
        # NCCL picks; a decode pod's sidecar calls a prefill pod's api, and its scheduler the
        # NIXL side channel, then reads KV blocks over ports UCX picks: every port, between
        # this service's own pods only
        ingress.append({"from": [{"podSelector": _selector(selector_labels(owner.name))}]})
    metrics_peers = [network_peer(p) for p in policy["metricsFrom"]]
    # A rule without peers would admit everyone: an empty metricsFrom adds no rule.
    if metrics_peers:
        # The api's own /metrics is served on the api port (a decode pod's api: behind its
        # sidecar, on the sidecar's target port).
        api_ports = [names.API_PORT]
        if disaggregation.enabled(spec):
            api_ports.append(names.SIDECAR_TARGET_PORT)
        ports = _ports(*api_ports, *names.METRICS_PORTS.values())
        ingress.append({"from": metrics_peers, "ports": ports})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, owner.name),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(owner.name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
