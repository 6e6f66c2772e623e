"""spec.router.kvEvents: the pure builders (issue 31).

The scheduler container publishes on the ports the pod opens and names, under the topic llm-d
parses (POD_IP from the downward API), with block names a router can compute (sha256_cbor
seeded by PYTHONHASHSEED); the NetworkPolicy admits the subscribers; the picker becomes llm-d's
with the precise-prefix-cache scorer, whose block size, seed, port and topic filter are the
pods' own.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml
from pod_security import restricted_violations

from tokenline.settings import BY_FLAG
from tokenline_operator import names
from tokenline_operator.controller import manifests
from tokenline_operator.crd import definition as crd
from tokenline_operator.crd import spec
from tokenline_operator.objects import Capabilities, Owner
from tokenline_operator.pods import config
from tokenline_operator.pods import deployment as pods
from tokenline_operator.routing import inference_pool, network
from tokenline_operator.routing.picker_config import PRECISE_SCORER

OWNER = Owner(name="chat", namespace="serving", uid="0b9c5a3e-3131-4c1b-9f44-2a4c1d6e7f80")
ROUTED = Capabilities(inference_pool=True)
MODEL = {"name": "Qwen/Qwen3-0.6B"}
ON: dict[str, Any] = {"model": MODEL, "router": {"kvEvents": {"enabled": True}}}
OFF: dict[str, Any] = {"model": MODEL}


def parse(raw: dict[str, Any]) -> spec.Spec:
    return spec.parse(OWNER.name, raw, default_image="tokenline:test")


def with_events(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "router": {"kvEvents": {"enabled": True, **fields}}}


def scheduler(raw: dict[str, Any]) -> dict[str, Any]:
    template = pods.deployment(OWNER, parse(raw))["spec"]["template"]
    return next(c for c in template["spec"]["containers"] if c["name"] == "scheduler")


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def picker_config(raw: dict[str, Any]) -> dict[str, Any]:
    children = {c["kind"]: c for c in inference_pool.children(OWNER, parse(raw))}
    return yaml.safe_load(children["ConfigMap"]["data"][inference_pool.PICKER_CONFIG_FILE])


def plugin(config_: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(p for p in config_["plugins"] if p["type"] == kind)


def picker_container(raw: dict[str, Any]) -> dict[str, Any]:
    children = {c["kind"]: c for c in inference_pool.children(OWNER, parse(raw))}
    return children["Deployment"]["spec"]["template"]["spec"]["containers"][0]


# --- the CRD --------------------------------------------------------------------------------


def test_the_crd_defaults_kv_events_off_with_a_seed_and_llm_ds_picker():
    parsed = parse(OFF)
    assert parsed["router"]["kvEvents"] == {
        "enabled": False,
        "hashSeed": "42",
        "pickerImage": names.LLMD_PICKER_IMAGE,
    }
    assert "prefixCachingHashAlgo" not in parsed["engine"]  # derived, see below
    field = crd.spec_schema()["properties"]["engine"]["properties"]["prefixCachingHashAlgo"]
    assert field["enum"] == ["blake2b", "sha256_cbor"] and "default" not in field


@pytest.mark.parametrize("seed", ["-1", "1e3", "x", "", "4294967296", "01"])
def test_a_hash_seed_that_is_not_a_pythonhashseed_is_refused(seed):
    with pytest.raises(spec.SpecError, match="hashSeed"):
        parse(with_events(hashSeed=seed))


def test_a_kv_events_peer_follows_the_network_peer_rules():
    raw = {**ON, "networkPolicy": {"kvEventsFrom": [{"cidr": "10.0.0.0/8", "namespace": "x"}]}}
    with pytest.raises(spec.SpecError, match="kvEventsFrom"):
        parse(raw)


def test_the_sample_spec_in_the_docs_is_valid_against_the_crd():
    body = {**with_events(tokenizer="Qwen/Qwen3-0.6B"), "replicas": 3}
    jsonschema.validate(body, crd.spec_schema())
    parse(body)


# --- the pod --------------------------------------------------------------------------------


def test_off_the_pod_has_no_events_port_env_or_label():
    container = scheduler(OFF)
    assert [p["containerPort"] for p in container["ports"]] == [names.METRICS_PORTS["scheduler"]]
    env = env_of(container)
    assert not {"POD_IP", "PYTHONHASHSEED"} & set(env)
    assert not any(k.startswith("TOKENLINE_KV_EVENTS") for k in env)
    template = pods.deployment(OWNER, parse(OFF))["spec"]["template"]
    assert names.LABEL_KV_EVENTS not in template["metadata"]["labels"]
    assert "TOKENLINE_PREFIX_CACHING_HASH_ALGO" not in config.config_map_data(parse(OFF))


def test_on_the_scheduler_publishes_on_named_ports_under_its_pod_ip():
    container = scheduler(ON)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["kv-events"] == names.KV_EVENTS_PORT == 5557
    assert ports["kv-replay"] == names.KV_REPLAY_PORT == 5558
    env = env_of(container)
    assert env[BY_FLAG["kv-events-endpoint"].env] == "tcp://*:5557"
    assert env[BY_FLAG["kv-events-replay-endpoint"].env] == "tcp://*:5558"
    # the scheduler's default topic kv@<POD_IP>@<served model> reads POD_IP
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["PYTHONHASHSEED"] == "42"
    # no other stage publishes, nor gets the seed
    template = pods.deployment(OWNER, parse(ON))["spec"]["template"]
    for other in template["spec"]["containers"]:
        if other["name"] != "scheduler":
            assert not {"POD_IP", "PYTHONHASHSEED"} & set(env_of(other))
            assert len(other["ports"]) == 1
    assert template["metadata"]["labels"][names.LABEL_KV_EVENTS] == "true"
    # the label is not part of the immutable selector
    selector = pods.deployment(OWNER, parse(ON))["spec"]["selector"]["matchLabels"]
    assert names.LABEL_KV_EVENTS not in selector


def test_on_block_names_default_to_sha256_cbor_through_the_config_map():
    data = config.config_map_data(parse(ON))
    key = BY_FLAG["prefix-caching-hash-algo"].env
    assert data[key] == "sha256_cbor"
    assert key in config.STAGE_SETTINGS["scheduler"]
    env = {e["name"]: e for e in scheduler(ON)["env"]}
    assert env[key]["valueFrom"]["configMapKeyRef"]["key"] == key
    # chosen explicitly, either way, it is kept; PYTHONHASHSEED only seeds sha256_cbor
    blake = {**ON, "engine": {"prefixCachingHashAlgo": "blake2b"}}
    assert config.config_map_data(parse(blake))[key] == "blake2b"
    assert "PYTHONHASHSEED" not in env_of(scheduler(blake))
    sha_off = {**OFF, "engine": {"prefixCachingHashAlgo": "sha256_cbor"}}
    assert config.config_map_data(parse(sha_off))[key] == "sha256_cbor"
    assert env_of(scheduler(sha_off))["PYTHONHASHSEED"] == "42"


def test_a_seed_of_ones_own_reaches_the_pod_and_the_picker():
    raw = with_events(hashSeed="1234567")
    assert env_of(scheduler(raw))["PYTHONHASHSEED"] == "1234567"
    scorer = plugin(picker_config(raw), PRECISE_SCORER)
    assert scorer["parameters"]["tokenProcessorConfig"]["hashSeed"] == "1234567"


def test_turning_events_on_rolls_the_pods():
    off, on = pods.deployment(OWNER, parse(OFF)), pods.deployment(OWNER, parse(ON))
    hash_key = names.ANNOTATION_CONFIG_HASH
    annotations = [d["spec"]["template"]["metadata"]["annotations"][hash_key] for d in (off, on)]
    assert annotations[0] != annotations[1]


@pytest.mark.parametrize("version", ["1.30", kv.latest_version()])
def test_the_pod_and_policy_pass_kubernetes_validate_strict_and_stay_restricted(version):
    children = manifests.children(OWNER, parse(ON), ROUTED)
    for kind in ("Deployment", "NetworkPolicy", "ConfigMap"):
        kv.validate(children[kind], version, strict=True)
    template = children["Deployment"]["spec"]["template"]
    assert restricted_violations(template["spec"], template["metadata"]) == []


# --- the NetworkPolicy ----------------------------------------------------------------------


def kv_rules(policy: dict[str, Any]) -> list[dict[str, Any]]:
    ports = [{"protocol": "TCP", "port": 5557}, {"protocol": "TCP", "port": 5558}]
    return [r for r in policy["spec"]["ingress"] if r["ports"] == ports]


def test_the_policy_admits_the_picker_to_the_events_ports_and_only_with_events():
    picker = {
        "podSelector": {
            "matchLabels": {names.LABEL_NAME: names.PICKER_APP, names.LABEL_OWNER: OWNER.name}
        }
    }
    (rule,) = kv_rules(network.network_policy(OWNER, parse(ON), routing=True))
    assert rule["from"] == [picker]
    assert kv_rules(network.network_policy(OWNER, parse(OFF), routing=True)) == []
    # no picker, no subscriber named: no rule (a rule without peers would admit everyone)
    assert kv_rules(network.network_policy(OWNER, parse(ON), routing=False)) == []
    # with blake2b the picker does not subscribe, so it is not let in
    blake = {**ON, "engine": {"prefixCachingHashAlgo": "blake2b"}}
    assert kv_rules(network.network_policy(OWNER, parse(blake), routing=True)) == []


def test_kv_events_from_admits_a_router_of_ones_own():
    raw = {**ON, "networkPolicy": {"kvEventsFrom": [{"namespace": "dynamo"}]}}
    dynamo = {"namespaceSelector": {"matchLabels": {names.LABEL_NAMESPACE_NAME: "dynamo"}}}
    (alone,) = kv_rules(network.network_policy(OWNER, parse(raw), routing=False))
    assert alone["from"] == [dynamo]
    (routed,) = kv_rules(network.network_policy(OWNER, parse(raw), routing=True))
    assert routed["from"][1:] == [dynamo] and "podSelector" in routed["from"][0]


# --- the picker -----------------------------------------------------------------------------


def test_the_picker_config_is_llm_ds_precise_prefix_cache_scorer_with_the_pods_parameters():
    config_ = picker_config(ON)
    assert config_["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config_["kind"] == "EndpointPickerConfig"
    scorer = plugin(config_, PRECISE_SCORER)["parameters"]
    assert scorer["tokenProcessorConfig"] == {
        "blockSize": BY_FLAG["block-size"].default,  # the scheduler's --block-size
        "hashSeed": env_of(scheduler(ON))["PYTHONHASHSEED"],
    }
    events = scorer["kvEventsConfig"]
    assert events["topicFilter"] == "kv@"
    assert events["discoverPods"] is True  # pods bind; the picker connects to each pod IP
    assert events["podDiscoveryConfig"] == {"socketPort": names.KV_EVENTS_PORT}
    assert env_of(scheduler(ON))[BY_FLAG["kv-events-endpoint"].env].endswith(":5557")
    pool = scorer["indexerConfig"]["tokenizersPoolConfig"]
    assert pool["modelName"] == "Qwen/Qwen3-0.6B"
    assert pool["hf"]["tokenizersCacheDir"].startswith("/tmp/")  # the picker's writable dir
    (profile,) = config_["schedulingProfiles"]
    weights = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    assert weights == {
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
        PRECISE_SCORER: 3,
    }
    kinds = {p["type"] for p in config_["plugins"]}
    assert "prefix-cache-scorer" not in kinds  # the approximate one is replaced, not added
    assert {"metrics-data-source", "core-metrics-extractor"} <= kinds  # queue and KV use


def test_the_picker_is_llm_ds_image_unless_told_otherwise():
    assert picker_container(ON)["image"] == names.LLMD_PICKER_IMAGE
    assert picker_container(OFF)["image"] == names.PICKER_IMAGE
    mirror = with_events(pickerImage="mirror.example/llm-d-inference-scheduler:v0.7.0")
    assert picker_container(mirror)["image"] == "mirror.example/llm-d-inference-scheduler:v0.7.0"
    # blake2b names: llm-d would find nothing, so the upstream picker and scorer stay
    blake = {**ON, "engine": {"prefixCachingHashAlgo": "blake2b"}}
    assert picker_container(blake)["image"] == names.PICKER_IMAGE
    assert plugin(picker_config(blake), "prefix-cache-scorer")["parameters"]["autoTune"]


@pytest.mark.parametrize(
    ("model", "tokenizer"),
    [
        ({"name": "Qwen/Qwen3-0.6B"}, "Qwen/Qwen3-0.6B"),
        ({"uri": "hf://Qwen/Qwen3-0.6B@main"}, "Qwen/Qwen3-0.6B"),
        ({"name": "tiny"}, "tiny"),
        ({"name": "/opt/models/x", "servedName": "x"}, "x"),
    ],
)
def test_the_picker_loads_the_models_tokenizer(model, tokenizer):
    raw = {"model": model, "router": {"kvEvents": {"enabled": True}}}
    scorer = plugin(picker_config(raw), PRECISE_SCORER)["parameters"]
    assert scorer["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == tokenizer
    raw["router"]["kvEvents"]["tokenizer"] = "org/tok"
    scorer = plugin(picker_config(raw), PRECISE_SCORER)["parameters"]
    assert scorer["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == "org/tok"


def test_a_gated_models_token_reaches_the_picker_by_reference_only():
    raw = {**ON, "model": {**MODEL, "hfTokenSecret": {"name": "hf"}}}
    env = {e["name"]: e for e in picker_container(raw)["env"]}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}},
    }
    off = {**OFF, "model": {**MODEL, "hfTokenSecret": {"name": "hf"}}}
    assert "HF_TOKEN" not in {e["name"] for e in picker_container(off)["env"]}


@pytest.mark.parametrize("version", ["1.30", kv.latest_version()])
def test_the_picker_children_pass_kubernetes_validate_strict(version):
    raw = {**ON, "model": {**MODEL, "hfTokenSecret": {"name": "hf"}}}
    for obj in inference_pool.children(OWNER, parse(raw)):
        if obj["kind"] != "InferencePool":
            kv.validate(obj, version, strict=True)
