"""examples/inference-gateway.yaml: it parses, its InferenceService is valid against our CRD,
and its HTTPRoute and Gateway point at what the operator creates from it.

No Gateway API schema is installed here, so the Gateway and HTTPRoute are checked for the
fields the Gateway API requires of them and for the references between the objects.
"""

from __future__ import annotations

from pathlib import Path

import inference_pool_schema
import kubernetes_validate.utils as kv
import yaml

from tokenline_operator import names
from tokenline_operator.controller import manifests
from tokenline_operator.crd import spec
from tokenline_operator.objects import Capabilities, Owner
from tokenline_operator.routing import inference_pool

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inference-gateway.yaml"


def documents() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs) == 3
    return by_kind


def operator_children(service: dict) -> tuple[Owner, dict[str, dict]]:
    meta = service["metadata"]
    owner = Owner(name=meta["name"], namespace=meta["namespace"], uid="uid-example")
    parsed = spec.parse(owner.name, service["spec"], default_image="tokenline:example")
    assert inference_pool.routing_enabled(parsed, Capabilities(inference_pool=True))
    routing = {obj["kind"]: obj for obj in inference_pool.children(owner, parsed)}
    stages = manifests.children(owner, parsed, Capabilities(inference_pool=True))
    return owner, {"routing": routing, "stages": stages}


def test_the_inference_service_is_valid_and_asks_for_routing():
    service = documents()["InferenceService"]
    assert service["apiVersion"] == names.API_VERSION
    parsed = spec.parse(service["metadata"]["name"], service["spec"], default_image="x")
    assert parsed["routing"]["inferencePool"]["enabled"] is True
    assert parsed["replicas"] > 1


def test_the_http_route_sends_the_gateways_traffic_to_the_operators_pool():
    docs = documents()
    gateway, route = docs["Gateway"], docs["HTTPRoute"]
    owner, children = operator_children(docs["InferenceService"])
    pool = children["routing"]["InferencePool"]
    assert inference_pool_schema.violations(pool) == []

    assert gateway["apiVersion"] == route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert gateway["spec"]["gatewayClassName"]
    (listener,) = gateway["spec"]["listeners"]
    assert {"name", "protocol", "port"} <= listener.keys()
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["kind"], parent["name"]) == ("Gateway", gateway["metadata"]["name"])
    assert route["metadata"]["namespace"] == gateway["metadata"]["namespace"]

    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    # Exactly the pool the operator creates, in its namespace (no ReferenceGrant needed).
    assert backend["group"] == pool["apiVersion"].split("/")[0]
    assert backend["kind"] == pool["kind"]
    assert backend["name"] == pool["metadata"]["name"]
    assert route["metadata"]["namespace"] == pool["metadata"]["namespace"] == owner.namespace
    assert "port" not in backend  # an InferencePool backend takes its ports from the pool


def test_the_gateway_may_reach_the_api_and_the_picker():
    """Its namespace is admitted by both NetworkPolicies (here: the default, its own)."""
    docs = documents()
    _, children = operator_children(docs["InferenceService"])
    gateway_ns = docs["Gateway"]["metadata"]["namespace"]
    for policy in (children["stages"]["NetworkPolicy"], children["routing"]["NetworkPolicy"]):
        kv.validate(policy, kv.latest_version(), strict=True)
        first = policy["spec"]["ingress"][0]["from"]
        assert gateway_ns == docs["InferenceService"]["metadata"]["namespace"]
        assert first == [{"podSelector": {}}], first  # every pod of the own namespace
