"""Routing through the Gateway API Inference Extension: the pure builders.

The InferencePool against the extension's CRD (a fixture written from its API reference),
every other routing child against Kubernetes' own schemas, and the picker's configuration
against what the pinned release reads.
"""

from __future__ import annotations

from typing import Any

import inference_pool_schema
import kubernetes_validate.utils as kv
import pytest
import yaml
from pod_security import hardening_violations, restricted_violations

from tokenline_operator import names, rbac
from tokenline_operator.controller import manifests
from tokenline_operator.crd import spec
from tokenline_operator.objects import Capabilities, Owner
from tokenline_operator.pods import deployment as pods
from tokenline_operator.routing import inference_pool, network

OWNER = Owner(name="chat", namespace="serving", uid="0b9c5a3e-1111-4c1b-9f44-2a4c1d6e7f80")
ROUTED = Capabilities(inference_pool=True)


def parse(raw: dict[str, Any]) -> spec.Spec:
    return spec.parse(OWNER.name, raw, default_image="tokenline:test")


BASE: dict[str, Any] = {"model": {"name": "tiny"}}
GATEWAY = {"networkPolicy": {"apiFrom": [{"namespace": "gateway"}]}}


def by_kind(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {obj["kind"]: obj for obj in inference_pool.children(OWNER, parse(raw))}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_routing_defaults_to_what_the_cluster_serves():
    assert inference_pool.routing_enabled(parse(BASE), ROUTED)
    assert not inference_pool.routing_enabled(parse(BASE), Capabilities())
    off = {**BASE, "routing": {"inferencePool": {"enabled": False}}}
    assert not inference_pool.routing_enabled(parse(off), ROUTED)
    on = {**BASE, "routing": {"inferencePool": {"enabled": True}}}
    assert inference_pool.routing_enabled(parse(on), Capabilities())


@pytest.mark.parametrize("raw", [BASE, {**BASE, **GATEWAY}], ids=["default", "gateway"])
def test_the_pool_is_valid_against_the_extensions_crd(raw):
    pool = by_kind(raw)["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert inference_pool_schema.violations(pool) == []
    # The fixture can fail: a pool the API server refuses is caught.
    broken = yaml.safe_load(yaml.safe_dump(pool))
    broken["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    del broken["spec"]["endpointPickerRef"]["port"]
    broken["spec"]["selector"]["matchLabels"] = {}
    broken["spec"]["extra"] = 1
    assert len(inference_pool_schema.violations(broken)) == 4


def test_the_pool_selects_the_stage_pods_on_the_api_port_and_points_at_the_picker():
    children = by_kind(BASE)
    pool, picker, svc = children["InferencePool"], children["Deployment"], children["Service"]
    stage_pods = pods.deployment(OWNER, parse(BASE))["spec"]["template"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert matches(selector, stage_pods["metadata"]["labels"])
    assert not matches(selector, picker["spec"]["template"]["metadata"]["labels"])
    # ... nor does the plain Service select the picker's pods.
    plain = network.service(OWNER, parse(BASE))["spec"]["selector"]
    assert not matches(plain, picker["spec"]["template"]["metadata"]["labels"])
    api = next(c for c in stage_pods["spec"]["containers"] if c["name"] == "api")
    assert pool["spec"]["targetPorts"] == [{"number": api["ports"][0]["containerPort"]}]
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"]) == ("Service", svc["metadata"]["name"])
    ext_proc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc-ext-proc")
    assert ref["port"]["number"] == ext_proc["port"]
    assert matches(svc["spec"]["selector"], picker["spec"]["template"]["metadata"]["labels"])
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(zip(args[::2], args[1::2], strict=False))
    assert flags["--pool-name"] == pool["metadata"]["name"]
    assert flags["--pool-namespace"] == OWNER.namespace


@pytest.mark.parametrize("version", ["1.30", kv.latest_version()])
def test_every_other_routing_child_passes_kubernetes_validate_strict(version):
    for kind, obj in by_kind({**BASE, **GATEWAY}).items():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == (names.KIND, OWNER.uid, True)
        assert obj["metadata"]["labels"][names.LABEL_OWNER] == OWNER.name  # child events
        if kind != "InferencePool":
            kv.validate(obj, version, strict=True)


def test_the_picker_pod_passes_the_restricted_pod_security_standard():
    template = by_kind(BASE)["Deployment"]["spec"]["template"]
    assert restricted_violations(template["spec"], template["metadata"]) == []
    assert hardening_violations(template["spec"]) == []


def picker_config(raw: dict[str, Any]) -> dict[str, Any]:
    data = by_kind(raw)["ConfigMap"]["data"]
    return yaml.safe_load(data[inference_pool.PICKER_CONFIG_FILE])


def test_the_picker_reads_our_metric_names_and_scores_prefix_queue_and_kv():
    config = picker_config(BASE)
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    extractor = plugins["core-metrics-extractor"]
    (engine,) = extractor["engineConfigs"]
    assert extractor["defaultEngine"] == engine["name"]  # unlabelled pods use our mapping
    assert engine["queuedRequestsSpec"] == "tokenline_endpoint_requests_waiting"
    assert engine["runningRequestsSpec"] == "tokenline_endpoint_requests_running"
    assert engine["kvUsageSpec"] == "tokenline_endpoint_kv_cache_usage_ratio"
    assert engine["cacheInfoSpec"] == "tokenline_endpoint_cache_config_info"
    assert engine["cacheBlockSizeLabelName"] == "block_size"
    assert engine["cacheNumBlocksLabelName"] == "num_gpu_blocks"
    assert engine["loraSpec"] == ""
    # Not the scheduler's names: dashboards and alerts sum those per pod.
    assert not {v for k, v in engine.items() if k.endswith("Spec")} & {
        "tokenline_num_requests_waiting",
        "tokenline_num_requests_running",
        "tokenline_kv_cache_usage_ratio",
    }
    assert plugins["prefix-cache-scorer"]["autoTune"] is True
    assert plugins["metrics-data-source"] == {
        "scheme": "http",
        "path": "/metrics",
        "insecureSkipVerify": True,
    }
    (profile,) = config["schedulingProfiles"]
    refs = {p["pluginRef"] for p in profile["plugins"]}
    assert refs == {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"}
    assert refs <= set(plugins)
    # From v1.4 the picker refuses to start with the metric-name flags.
    args = by_kind(BASE)["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    for flag in (
        "--total-queued-requests-metric",
        "--total-running-requests-metric",
        "--kv-cache-usage-percentage-metric",
        "--lora-info-metric",
        "--cache-info-metric",
    ):
        assert not any(a.startswith(flag) for a in args)


def test_a_tls_api_is_scraped_over_https():
    tls = {**BASE, "server": {"tlsSecret": {"name": "llm-tls"}}}
    plugins = {p["type"]: p.get("parameters", {}) for p in picker_config(tls)["plugins"]}
    assert plugins["metrics-data-source"]["scheme"] == "https"


def test_image_port_and_failure_mode_follow_the_spec():
    raw = {
        **BASE,
        "routing": {
            "inferencePool": {
                "image": "mirror.example/epp:v1.5.0",
                "extProcPort": 9102,
                "failureMode": "FailClose",
            }
        },
    }
    children = by_kind(raw)
    container = children["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "mirror.example/epp:v1.5.0"
    assert "9102" in container["args"]
    ref = children["InferencePool"]["spec"]["endpointPickerRef"]
    assert ref == {
        "kind": "Service",
        "name": "chat-epp",
        "port": {"number": 9102},
        "failureMode": "FailClose",
    }
    assert children["Service"]["spec"]["ports"][0]["port"] == 9102
    assert children["NetworkPolicy"]["spec"]["ingress"][0]["ports"] == [
        {"protocol": "TCP", "port": 9102}
    ]
    default = by_kind(BASE)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert (
        default["image"]
        == f"registry.k8s.io/gateway-api-inference-extension/epp:{names.PICKER_VERSION}"
    )


def test_network_policies_let_the_gateway_reach_the_picker_and_the_picker_the_api():
    parsed = parse({**BASE, **GATEWAY})
    gateway = [{"namespaceSelector": {"matchLabels": {names.LABEL_NAMESPACE_NAME: "gateway"}}}]
    picker_policy = by_kind({**BASE, **GATEWAY})["NetworkPolicy"]
    assert picker_policy["spec"]["ingress"][0]["from"] == gateway
    stage_policy = manifests.children(OWNER, parsed, ROUTED)["NetworkPolicy"]
    picker_pods = by_kind(BASE)["Deployment"]["spec"]["template"]["metadata"]["labels"]
    scrape = [
        rule
        for rule in stage_policy["spec"]["ingress"]
        if any(
            "podSelector" in peer
            and "namespaceSelector" not in peer
            and matches(peer["podSelector"]["matchLabels"], picker_pods)
            for peer in rule["from"]
        )
    ]
    assert scrape and scrape[0]["ports"] == [{"protocol": "TCP", "port": names.API_PORT}]
    unrouted = manifests.children(OWNER, parsed, Capabilities())["NetworkPolicy"]
    assert len(unrouted["spec"]["ingress"]) == len(stage_policy["spec"]["ingress"]) - 1
    off = {**BASE, "networkPolicy": {"enabled": False}}
    assert "NetworkPolicy" not in by_kind(off)


def test_the_prestop_hook_outlasts_the_pickers_view_and_the_grace_period_covers_the_drain():
    parsed = parse({**BASE, "server": {"drainTimeoutSeconds": 60}})
    routed = manifests.children(OWNER, parsed, ROUTED)["Deployment"]["spec"]["template"]["spec"]
    sleep = pods.prestop_sleep_seconds(True)
    picker_view = (
        pods.PICKER_WATCH_DELAY_S
        + pods.PICKER_REFRESH_METRICS_INTERVAL_S
        + pods.PICKER_METRICS_STALENESS_S
    )
    assert sleep >= picker_view and sleep >= pods.PRESTOP_SLEEP_SECONDS
    for container in routed["containers"]:
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(sleep)]
    assert routed["terminationGracePeriodSeconds"] > sleep + 60
    # The intervals the sizing assumes are the ones the picker is started with.
    args = by_kind(BASE)["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(zip(args[::2], args[1::2], strict=False))
    assert flags["--refresh-metrics-interval"] == "50ms"
    assert flags["--metrics-staleness-threshold"] == f"{pods.PICKER_METRICS_STALENESS_S}s"


def test_the_operator_holds_what_it_grants_the_picker_and_may_write_every_routing_child():
    from tokenline_operator.kube import KINDS

    granted: dict[tuple[str, str], set[str]] = {}
    for rule in rbac.rules():
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    for kind in inference_pool.KINDS:
        ref = KINDS[kind]
        assert {"get", "list", "watch", "create", "patch", "delete"} <= granted[
            (ref.group, ref.plural)
        ], kind
    # Kubernetes refuses a Role that grants more than its creator holds.
    for rule in inference_pool.PICKER_RULES:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= granted.get((group, resource), set()), resource
