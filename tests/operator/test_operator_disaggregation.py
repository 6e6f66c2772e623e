"""spec.disaggregation (issue 49): prefill and decode pods in llm-d's contract, the pure
builders. Two Deployments labelled by role, the routing sidecar on the decode pods, the
schedulers' KV role and side channel, one InferencePool over both, llm-d's P/D picker
profiles, the refusals, and nothing changed without the field."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate.utils as kv
import pytest
import yaml
from pod_security import hardening_violations, restricted_violations

from tokenline.cli import build_parser, settings_from
from tokenline_operator import names
from tokenline_operator.controller import manifests
from tokenline_operator.crd import definition, spec
from tokenline_operator.objects import Capabilities, Owner
from tokenline_operator.pods import config
from tokenline_operator.pods import disaggregation as pd
from tokenline_operator.routing import inference_pool

OWNER = Owner(name="chat", namespace="serving", uid="0b9c5a3e-1111-4c1b-9f44-2a4c1d6e7f80")
ROUTED = Capabilities(inference_pool=True)
ROLE = names.LABEL_LLMD_ROLE
PD = {
    "prefill": {"replicas": 3, "resources": {"requests": {"cpu": "6"}}},
    "decode": {"replicas": 2},
}


def parse(**fields: Any) -> spec.Spec:
    raw = {"model": {"name": "Qwen/Qwen3-0.6B"}, **fields}
    return spec.parse(OWNER.name, raw, default_image="tokenline:test")


def children(**fields: Any) -> dict[str, dict[str, Any]]:
    return manifests.children(OWNER, parse(**fields), ROUTED)


def pod(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod(deployment)["containers"] if c["name"] == name)


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def with_role_tp(prefill: int, decode: int) -> spec.Spec:
    """The service on one-GPU pods but for each role's own tensor parallelism."""
    sizes = {"prefill": prefill, "decode": decode}
    roles = {role: {**PD[role], "tensorParallelSize": size} for role, size in sizes.items()}
    return parse(engine={"gpus": 1}, disaggregation=roles)


def picker_config(**fields: Any) -> dict[str, Any]:
    return yaml.safe_load(inference_pool.picker_config_text(parse(**fields)))


def test_two_deployments_named_and_labelled_by_role_replace_the_one():
    built = children(disaggregation=PD)
    assert "Deployment" not in built
    prefill, decode = built["PrefillDeployment"], built["DecodeDeployment"]
    assert (prefill["metadata"]["name"], decode["metadata"]["name"]) == (
        "chat-prefill",
        "chat-decode",
    )
    for dep, role, replicas in ((prefill, "prefill", 3), (decode, "decode", 2)):
        assert dep["kind"] == "Deployment" and dep["spec"]["replicas"] == replicas
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels[ROLE] == role
        # each Deployment owns only its own role's pods
        assert dep["spec"]["selector"]["matchLabels"][ROLE] == role
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (ref,) = dep["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"]) == (names.KIND, OWNER.uid)
        assert dep["metadata"]["labels"][names.LABEL_OWNER] == "chat"  # child events reach us


def test_decode_pods_put_the_sidecar_on_the_serving_port_and_the_api_behind_it():
    built = children(disaggregation={**PD, "sidecar": {"args": ["--enable-prefiller-sampling"]}})
    decode, prefill = built["DecodeDeployment"], built["PrefillDeployment"]
    sidecar = container(decode, pd.SIDECAR_CONTAINER)
    assert sidecar["image"] == names.ROUTING_SIDECAR_IMAGE
    assert sidecar["args"] == [
        f"--port={names.API_PORT}",
        f"--vllm-port={names.SIDECAR_TARGET_PORT}",
        "--kv-connector=nixlv2",
        "--secure-proxy=false",
        "--enable-prefiller-sampling",
    ]
    assert sidecar["ports"] == [
        {"name": "http", "containerPort": names.API_PORT, "protocol": "TCP"}
    ]
    api = container(decode, "api")
    assert api["args"][api["args"].index("--port") + 1] == str(names.SIDECAR_TARGET_PORT)
    assert [p["containerPort"] for p in api["ports"]] == [names.SIDECAR_TARGET_PORT]
    assert {
        api[p]["httpGet"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
    } == {"api"}
    ports = [p["containerPort"] for c in pod(decode)["containers"] for p in c["ports"]]
    assert len(ports) == len(set(ports))  # no port taken twice in the pod
    # the sidecar outlives the api's drain
    stay = int(sidecar["lifecycle"]["preStop"]["exec"]["command"][1])
    assert stay > int(api["lifecycle"]["preStop"]["exec"]["command"][1])
    # prefill pods serve the api on the pod's port, without a sidecar
    assert pd.SIDECAR_CONTAINER not in [c["name"] for c in pod(prefill)["containers"]]
    assert container(prefill, "api")["ports"][0]["containerPort"] == names.API_PORT


def test_schedulers_get_their_kv_role_and_the_side_channel_on_the_pod_ip():
    built = children(disaggregation={**PD, "kvLoadFailurePolicy": "fail"})
    roles = {"PrefillDeployment": "kv_producer", "DecodeDeployment": "kv_consumer"}
    for key, kv_role in roles.items():
        scheduler = container(built[key], "scheduler")
        args = scheduler["args"]
        assert args.count("--kv-transfer-config") == 1
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "NixlConnector" and config["kv_role"] == kv_role
        variables = env(scheduler)
        assert variables["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {
            "fieldRef": {"fieldPath": "status.podIP"}
        }
        assert variables["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(names.KV_SIDE_CHANNEL_PORT)
        assert {"name": "kv-side", "containerPort": 5600, "protocol": "TCP"} in scheduler["ports"]
        others = [c for c in pod(built[key])["containers"] if c["name"] != "scheduler"]
        assert all("--kv-transfer-config" not in c.get("args", []) for c in others)
    decode_args = container(built["DecodeDeployment"], "scheduler")["args"]
    decode_config = json.loads(decode_args[decode_args.index("--kv-transfer-config") + 1])
    assert decode_config["kv_load_failure_policy"] == "fail"


def test_both_roles_schedulers_mount_the_services_own_side_channel_keys():
    """(The CLI test below reads the mounted files with the scheduler's own parser.)"""
    from tokenline_operator.pods import side_channel_keys as keys

    secret = keys.new_secret(OWNER)
    assert secret["metadata"]["name"] == "chat-kv-side-channel"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert keys.new_secret(OWNER)["data"] != secret["data"]  # each service its own
    built = children(disaggregation=PD)
    for key in ("PrefillDeployment", "DecodeDeployment"):
        scheduler = container(built[key], "scheduler")
        assert {"name": keys.VOLUME, "mountPath": keys.KEYS_DIR, "readOnly": True} in scheduler[
            "volumeMounts"
        ]
        others = [c for c in pod(built[key])["containers"] if c["name"] != "scheduler"]
        assert all(keys.KEYS_DIR not in str(c.get("volumeMounts")) for c in others)
        args = scheduler["args"]
        text = args[args.index("--kv-transfer-config") + 1]
        assert json.loads(text)["kv_connector_extra_config"] == {"side_channel_keys": keys.KEYS_DIR}


def test_each_role_has_its_own_tensor_parallelism_and_scheduler_resources():
    parsed = with_role_tp(prefill=2, decode=1)
    built = manifests.children(OWNER, parsed, ROUTED)
    prefill = container(built["PrefillDeployment"], "scheduler")
    decode = container(built["DecodeDeployment"], "scheduler")
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert prefill["resources"]["requests"]["cpu"] == "6"
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert decode["resources"]["requests"]["cpu"] == "2"  # spec.resources.scheduler's default
    # the shared ConfigMap holds the engine's value; the prefill pods' differs, set in place
    assert built["ConfigMap"]["data"]["TOKENLINE_TENSOR_PARALLEL_SIZE"] == "1"
    assert env(prefill)["TOKENLINE_TENSOR_PARALLEL_SIZE"] == "2"
    assert "configMapKeyRef" in env(decode)["TOKENLINE_TENSOR_PARALLEL_SIZE"]
    # decode pods too: each rank reads its own share of the KV heads
    built = manifests.children(OWNER, with_role_tp(prefill=1, decode=4), ROUTED)
    decode = container(built["DecodeDeployment"], "scheduler")
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert env(decode)["TOKENLINE_TENSOR_PARALLEL_SIZE"] == "4"
    prefill = container(built["PrefillDeployment"], "scheduler")
    assert "configMapKeyRef" in env(prefill)["TOKENLINE_TENSOR_PARALLEL_SIZE"]
    hashes = {
        key: built[key]["spec"]["template"]["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH]
        for key in pd.DEPLOYMENT_KEYS.values()
    }
    assert hashes["PrefillDeployment"] != hashes["DecodeDeployment"]  # a change rolls its pods


def test_one_pool_selects_both_roles_and_the_plain_service_only_decode_pods():
    built = children(disaggregation=PD)
    pool = next(
        o
        for o in inference_pool.children(OWNER, parse(disaggregation=PD))
        if o["kind"] == "InferencePool"
    )
    selector = pool["spec"]["selector"]["matchLabels"]
    for key in pd.DEPLOYMENT_KEYS.values():
        assert selector.items() <= built[key]["spec"]["template"]["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": names.API_PORT}]
    service = built["Service"]["spec"]["selector"]
    assert service[ROLE] == "decode"
    prefill_labels = built["PrefillDeployment"]["spec"]["template"]["metadata"]["labels"]
    assert not service.items() <= prefill_labels.items()
    # one disruption budget over both roles' five pods
    assert (
        built["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items()
        <= prefill_labels.items()
    )


def test_the_network_policy_lets_decode_pods_reach_prefill_pods_on_every_port():
    rules = children(disaggregation=PD)["NetworkPolicy"]["spec"]["ingress"]
    own = {
        "podSelector": {"matchLabels": {names.LABEL_NAME: "tokenline", names.LABEL_OWNER: "chat"}}
    }
    assert {"from": [own]} in rules  # the sidecar's call, the side channel and UCX's ports
    assert {"from": [own]} not in children()["NetworkPolicy"]["spec"]["ingress"]


def test_the_picker_runs_llm_ds_disaggregation_profiles():
    config = picker_config(disaggregation={**PD, "nonCachedTokens": 64})
    plugins = {p["type"]: p.get("parameters") for p in config["plugins"]}
    assert config["featureGates"] == ["prepareDataPlugins"]  # the decider reads the prefix match
    assert plugins["prefix-based-pd-decider"] == {"nonCachedTokens": 64}
    assert plugins["disagg-profile-handler"] == {"deciders": {"prefill": "prefix-based-pd-decider"}}
    assert {
        "disagg-headers-handler",
        "prefill-filter",
        "decode-filter",
        "max-score-picker",
    } <= plugins.keys()
    assert plugins["prefix-cache-scorer"]["autoTune"] is True
    profiles = {
        p["name"]: [r["pluginRef"] for r in p["plugins"]] for p in config["schedulingProfiles"]
    }
    assert profiles.keys() == {"prefill", "decode"}
    assert profiles["prefill"][0] == "prefill-filter" and profiles["decode"][0] == "decode-filter"
    for refs in profiles.values():
        assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= set(refs)
        assert set(refs) <= plugins.keys()  # every reference names a plugin
    assert "&id" not in inference_pool.picker_config_text(parse(disaggregation=PD))
    assert inference_pool.picker_image(parse(disaggregation=PD)) == names.LLMD_PD_PICKER_IMAGE
    other = parse(disaggregation={**PD, "pickerImage": "example.com/epp:1"})
    assert inference_pool.picker_image(other) == "example.com/epp:1"
    defaults = {p["type"]: p.get("parameters") for p in picker_config(disaggregation={})["plugins"]}
    assert defaults["prefix-based-pd-decider"] == {"nonCachedTokens": 16}


def test_without_disaggregation_nothing_changes():
    built = children()
    dep = built["Deployment"]
    assert dep["metadata"]["name"] == "chat" and not set(built) & set(pd.DEPLOYMENT_KEYS.values())
    assert ROLE not in dep["spec"]["template"]["metadata"]["labels"]
    assert ROLE not in built["Service"]["spec"]["selector"]
    assert [c["name"] for c in pod(dep)["containers"]] == list(names.STAGES)
    text = json.dumps(built)
    for word in ("kv-transfer-config", "VLLM_NIXL", "llm-d.ai", "routing-sidecar"):
        assert word not in text
    config = picker_config()
    assert "featureGates" not in config
    assert [p["name"] for p in config["schedulingProfiles"]] == ["default"]
    assert inference_pool.picker_image(parse()) == names.PICKER_IMAGE


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"engine": {"nodes": 2, "tensorParallelSize": 2}}, "set engine.nodes to 1"),
        ({"engine": {"prefixCaching": False}}, "set engine.prefixCaching to true"),
        (
            {"model": {"name": "BAAI/bge-small-en-v1.5", "runner": "pooling"}},
            "a pooling model has no decode",
        ),
        ({"autoscaling": {"enabled": True}}, "set autoscaling.enabled to false"),
        ({"server": {"tlsSecret": {"name": "tls"}}}, "unset server.tlsSecret"),
        (
            {"engine": {"extraArgs": ["--kv-transfer-config", '{"kv_connector":"NixlConnector"}']}},
            "--kv-transfer-config is set by the operator",
        ),
        ({"engine": {"extraArgs": ["--kv-transfer-config={}"]}}, "remove it from extraArgs"),
    ],
)
def test_combinations_it_cannot_serve_are_refused_with_the_reason(fields, problem):
    with pytest.raises(spec.SpecError, match=problem):
        parse(**{**fields, "disaggregation": PD})


def test_the_crd_carries_the_same_rules_and_its_defaults_are_llm_ds():
    rules = [
        r for r in definition.SPEC["x-kubernetes-validations"] if "self.disaggregation" in r["rule"]
    ]
    assert len(rules) == 5 and all(r["rule"].startswith("!has(self.disaggregation)") for r in rules)
    parsed = parse(disaggregation={})
    assert parsed["disaggregation"]["prefill"] == {"replicas": 1}
    assert parsed["disaggregation"]["nonCachedTokens"] == 16
    assert (
        parsed["disaggregation"]["sidecar"]["image"] == "ghcr.io/llm-d/llm-d-routing-sidecar:v0.8.0"
    )
    assert spec.desired_replicas(parse(disaggregation=PD)) == 5
    with pytest.raises(spec.SpecError, match="tensorParallelSize"):
        parse(disaggregation={"prefill": {"tensorParallelSize": 16}})
    # a tensor-parallel pod lends (prefill) or reads (decode) each rank's share of the heads
    both_tp = parse(engine={"tensorParallelSize": 2}, disaggregation=PD)
    assert both_tp["disaggregation"]["decode"] == PD["decode"]  # the engine's 2 for both
    tp = parse(
        disaggregation={"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 4}}
    )
    assert tp["disaggregation"]["prefill"]["tensorParallelSize"] == 2
    assert tp["disaggregation"]["decode"]["tensorParallelSize"] == 4


@pytest.mark.parametrize("version", ["1.30", kv.latest_version()])
def test_both_deployments_pass_kubernetes_validate_strict_and_the_restricted_standard(version):
    built = children(disaggregation=PD)
    for key in pd.DEPLOYMENT_KEYS.values():
        kv.validate(built[key], version, strict=True)
        template = built[key]["spec"]["template"]
        assert restricted_violations(template["spec"], template["metadata"]) == []
        assert hardening_violations(template["spec"]) == []


def _role_view(replicas: int, ready: int, generation: int = 2, observed: int = 2) -> dict:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "replicas": replicas,
            "updatedReplicas": replicas,
            "availableReplicas": ready,
            "readyReplicas": ready,
            "observedGeneration": observed,
            "conditions": [
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
            ],
        },
    }


def test_the_status_reads_both_roles_as_one_and_nothing_ready_without_a_decode_pod():
    both = pd.as_deployment(_role_view(3, 3), _role_view(2, 1))
    assert both["spec"]["replicas"] == 5 and both["status"]["readyReplicas"] == 4
    assert both["status"]["observedGeneration"] == both["metadata"]["generation"]
    no_decode = pd.as_deployment(_role_view(3, 3), _role_view(2, 0))
    assert no_decode["status"]["readyReplicas"] == 0
    stale = pd.as_deployment(_role_view(3, 3), _role_view(2, 2, observed=1))
    assert stale["status"]["observedGeneration"] < stale["metadata"]["generation"]
    assert pd.as_deployment(None, None) is None
    half = pd.as_deployment(_role_view(3, 3), None)
    assert half["status"]["observedGeneration"] < half["metadata"]["generation"]


def test_the_example_makes_both_roles_and_llm_ds_picker():
    example = Path(__file__).resolve().parents[2] / "examples" / "disaggregation.yaml"
    (service,) = [d for d in yaml.safe_load_all(example.read_text()) if d]
    assert service["kind"] == names.KIND and service["apiVersion"] == names.API_VERSION
    parsed = spec.parse(service["metadata"]["name"], service["spec"], default_image="x")
    built = manifests.children(OWNER, parsed, ROUTED)
    assert {"PrefillDeployment", "DecodeDeployment"} <= built.keys()
    decode = container(built["DecodeDeployment"], "scheduler")
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 1
    plugins = {p["type"]: p.get("parameters") for p in picker_config(**service["spec"])["plugins"]}
    assert plugins["prefix-based-pd-decider"] == {"nonCachedTokens": 256}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_roles_stage_containers_parse_with_the_real_cli(role, tmp_path):
    """The kubelet's view of each container (ConfigMap keys, literal values, the side
    channel's Secret as files) read by the stages' own parser: the KV role and its keys, the
    role's tensor parallelism, the api's moved port."""
    import base64

    from tokenline_operator.pods import side_channel_keys as keys

    for name, content in keys.new_secret(OWNER)["data"].items():  # the Secret, mounted
        (tmp_path / name).write_bytes(base64.b64decode(content))
    parsed = with_role_tp(prefill=2, decode=4)
    data = config.config_map(OWNER, parsed)["data"]
    stages = [c for c in pod(pd.role_deployment(OWNER, parsed, role))["containers"]]
    seen = set()
    for c in stages:
        if c["name"] == pd.SIDECAR_CONTAINER:
            continue
        variables = {}
        for item in c["env"]:
            source = item.get("valueFrom", {})
            if "configMapKeyRef" in source:
                variables[item["name"]] = data[source["configMapKeyRef"]["key"]]
            elif "value" in item:
                variables[item["name"]] = item["value"]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
        args = [a.replace(keys.KEYS_DIR, str(tmp_path)) for a in c["args"]]
        with mock.patch.dict(os.environ, {**clean, **variables}, clear=True):
            settings = settings_from(build_parser().parse_args(args))
        seen.add(c["args"][0])
        if c["args"][0] == "scheduler":
            kv_config = json.loads(settings.kv_transfer_config)
            assert kv_config["kv_role"] == pd.KV_ROLES[role]
            extra = kv_config["kv_connector_extra_config"]
            assert extra == {"side_channel_keys": str(tmp_path)}
            assert settings.tensor_parallel_size == (2 if role == "prefill" else 4)
        if c["args"][0] == "api":
            port = names.SIDECAR_TARGET_PORT if role == "decode" else names.API_PORT
            assert settings.port == port
    assert seen == set(names.STAGES)


def test_prometheus_scrapes_each_api_once_on_its_own_port():
    built = manifests.children(
        OWNER, parse(disaggregation=PD), Capabilities(prometheus_operator=True)
    )
    endpoints = built["PodMonitor"]["spec"]["podMetricsEndpoints"]
    by_port = {e["port"]: e for e in endpoints}
    # the serving port skips the decode pods' sidecar (it would pass the api's /metrics on
    # under its own container name, and count them twice): their api is scraped behind it
    drop = {
        "sourceLabels": ["__meta_kubernetes_pod_container_name"],
        "regex": pd.SIDECAR_CONTAINER,
        "action": "drop",
    }
    assert drop in by_port["http"]["relabelings"]
    assert drop not in by_port[pd.API_PORT_NAME]["relabelings"]
    ports = {p["name"] for c in pod(built["DecodeDeployment"])["containers"] for p in c["ports"]}
    assert set(by_port) <= ports
    metrics_rule = built["NetworkPolicy"]["spec"]["ingress"][-1]
    assert {"protocol": "TCP", "port": names.SIDECAR_TARGET_PORT} in metrics_rule["ports"]
    plain = manifests.children(OWNER, parse(), Capabilities(prometheus_operator=True))
    assert pd.API_PORT_NAME not in {
        e["port"] for e in plain["PodMonitor"]["spec"]["podMetricsEndpoints"]
    }
