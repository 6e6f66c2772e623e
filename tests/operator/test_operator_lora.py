"""spec.model.lora (issue 27): the CRD's schema and rules, the pods' flags and volumes, the
adapters' ConfigMap, the picker's LoRA affinity. Pure builders, no cluster; the kmock end to
end test is test_operator_lora_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml

from tokenline.scheduler.lora_config import parse_adapters
from tokenline.settings import BY_FLAG
from tokenline_operator.controller import manifests
from tokenline_operator.crd import definition as crd
from tokenline_operator.crd import lora as crd_lora
from tokenline_operator.crd import model_uri, spec
from tokenline_operator.objects import Capabilities, Owner
from tokenline_operator.pods import lora
from tokenline_operator.routing import inference_pool
from tokenline_operator.routing.picker_config import (
    LORA_METRIC,
    LORA_SCORER,
    endpoint_picker_config,
)

OWNER = Owner(name="chat", namespace="serving", uid="0b9c5a3e-2222-4c1b-9f44-2a4c1d6e7f80")
ADAPTERS = [
    {"name": "sql", "uri": "hf://acme/sql-lora@v1"},
    {"name": "support.v2", "uri": "s3://adapters/support?endpoint=http://minio.storage:9000"},
    {"name": "local_1", "uri": "/opt/adapters/local"},
]
CRD = crd.custom_resource_definition()
ROOT = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def parse(lora_spec: dict[str, Any] | None, **model_extra: Any) -> spec.Spec:
    model_spec: dict[str, Any] = {"name": "Qwen/Qwen3-0.6B", **model_extra}
    if lora_spec is not None:
        model_spec["lora"] = lora_spec
    return spec.parse("chat", {"model": model_spec}, default_image="tokenline:1")


def children(parsed: spec.Spec, image_volumes: bool = False) -> dict[str, dict]:
    return manifests.children(OWNER, parsed, Capabilities(image_volume=image_volumes))


def containers(parsed: spec.Spec, image_volumes: bool = False) -> dict[str, dict]:
    pod = children(parsed, image_volumes)["Deployment"]["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def env(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def template(parsed: spec.Spec, image_volumes: bool = False) -> dict:
    return children(parsed, image_volumes)["Deployment"]["spec"]["template"]


# --- the CRD --------------------------------------------------------------------------------


def test_the_crd_declares_spec_model_lora():
    schema = crd.MODEL["properties"]["lora"]
    assert set(schema["properties"]) == {"adapters", "maxAdapters", "maxRank"}
    adapters = schema["properties"]["adapters"]
    assert adapters["x-kubernetes-list-type"] == "map"
    assert adapters["x-kubernetes-list-map-keys"] == ["name"]
    assert adapters["items"]["required"] == ["name", "uri"]
    # the same rules as spec.model.uri
    uri_rules = adapters["items"]["properties"]["uri"]["x-kubernetes-validations"]
    assert [r["rule"] for r in uri_rules] == [rule for rule, _ in model_uri.URI_RULES]
    assert schema["properties"]["maxAdapters"]["default"] == BY_FLAG["max-loras"].default
    assert schema["properties"]["maxRank"]["default"] == BY_FLAG["max-lora-rank"].default
    assert crd_lora.SERVED_NAME_RULE in crd.MODEL["x-kubernetes-validations"]


def test_the_chart_crd_is_a_valid_crd_with_lora():
    # the generated file is the one built here (test_operator_settings_declared checks it)
    kv.validate(CRD, "1.33.0", strict=True)


@pytest.mark.parametrize(
    ("lora_spec", "where"),
    [
        ({"adapters": [{"name": "bad name", "uri": "/x"}]}, "adapters[0].name"),
        ({"adapters": [{"name": "", "uri": "/x"}]}, "adapters[0].name"),
        ({"adapters": [{"name": "a/b", "uri": "/x"}]}, "adapters[0].name"),
        ({"adapters": [{"name": "a"}]}, "adapters[0]"),
        ({"adapters": [{"name": "a", "uri": "/x", "extra": 1}]}, None),  # pruned, not refused
        ({"adapters": [{"name": "a", "uri": "/" + "x" * crd_lora.URI_MAX_LENGTH}]}, "uri"),
        ({"adapters": [{"name": "a" * 129, "uri": "/x"}]}, "name"),
        ({"maxAdapters": 0}, "maxAdapters"),
        ({"maxAdapters": crd_lora.MAX_RESIDENT + 1}, "maxAdapters"),
        ({"maxRank": 0}, "maxRank"),
        ({"maxRank": crd_lora.MAX_RANK + 1}, "maxRank"),
        ({"adapters": [{"name": f"a{i}", "uri": "/x"} for i in range(65)]}, "adapters"),
    ],
)
def test_the_schema_rejects_bad_adapters_and_bounds(lora_spec, where):
    body = {"model": {"name": "tiny", "lora": lora_spec}}
    schema_errors = list(
        jsonschema.Draft202012Validator(ROOT["properties"]["spec"]).iter_errors(body)
    )
    if where is None:
        return
    assert schema_errors, lora_spec
    with pytest.raises(spec.SpecError, match=r"spec\.model\.lora"):
        spec.parse("chat", body, default_image="tokenline:1")


@pytest.mark.parametrize(
    ("lora_spec", "model_extra", "message"),
    [
        # the API server's list-map keys
        (
            {"adapters": [{"name": "a", "uri": "/x"}, {"name": "a", "uri": "/y"}]},
            {},
            r"adapters\[1\]\.name: 'a' is listed twice",
        ),
        # the base model's served name: name, servedName, or derived from uri
        ({"adapters": [{"name": "Qwen", "uri": "/x"}]}, {"name": "Qwen"}, "served model's name"),
        (
            {"adapters": [{"name": "chat", "uri": "/x"}]},
            {"servedName": "chat"},
            "served model's name",
        ),
        # each uri by spec.model.uri's rules and the fetcher's parser
        ({"adapters": [{"name": "a", "uri": "ftp://x/y"}]}, {}, "unknown scheme"),
        ({"adapters": [{"name": "a", "uri": "relative/dir"}]}, {}, "unknown scheme"),
        ({"adapters": [{"name": "a", "uri": "hf://a--b/c"}]}, {}, r"adapters\[0\]\.uri: '--'"),
        ({"adapters": [{"name": "a", "uri": "pvc://Bad_Claim/x"}]}, {}, "pvc://"),
        ({"adapters": [{"name": "a", "uri": "s3://bucket/p?token=x"}]}, {}, "s3://"),
    ],
)
def test_the_operator_rejects_what_the_crd_rules_reject(lora_spec, model_extra, message):
    model_spec = {"name": "Qwen/Qwen3-0.6B", **model_extra, "lora": lora_spec}
    with pytest.raises(spec.SpecError, match=message):
        spec.parse("chat", {"model": model_spec}, default_image="tokenline:1")


def test_the_served_name_derived_from_a_uri_is_taken_too():
    model_spec = {
        "uri": "hf://Qwen/Qwen3-0.6B@main",
        "lora": {"adapters": [{"name": "Qwen/Qwen3-0.6B".split("/")[1], "uri": "/x"}]},
    }
    spec.parse("chat", {"model": model_spec}, default_image="tokenline:1")  # Qwen3-0.6B is free
    model_spec["servedName"] = "Qwen3-0.6B"
    with pytest.raises(spec.SpecError, match="served model's name"):
        spec.parse("chat", {"model": model_spec}, default_image="tokenline:1")


def test_defaults_fill_the_bounds():
    parsed = parse({"adapters": ADAPTERS})
    assert parsed["model"]["lora"]["maxAdapters"] == BY_FLAG["max-loras"].default
    assert parsed["model"]["lora"]["maxRank"] == BY_FLAG["max-lora-rank"].default


# --- the pods -------------------------------------------------------------------------------


def test_without_lora_nothing_changes():
    parsed = parse(None)
    assert manifests.LORA_CONFIG_MAP not in children(parsed)
    for container in containers(parsed).values():
        assert not any("LORA" in name for name in env(container))
        assert all(m["name"] != lora.LORA_VOLUME for m in container["volumeMounts"])


def test_lora_flags_reach_the_api_and_the_scheduler():
    parsed = parse({"adapters": ADAPTERS, "maxAdapters": 8, "maxRank": 64})
    by_stage = containers(parsed)
    scheduler = env(by_stage["scheduler"])
    assert scheduler[BY_FLAG["enable-lora"].env] == "true"
    assert scheduler[BY_FLAG["max-loras"].env] == "8"
    assert scheduler[BY_FLAG["max-lora-rank"].env] == "64"
    assert scheduler[BY_FLAG["lora-config"].env] == "/etc/tokenline/lora/adapters.json"
    assert BY_FLAG["max-cpu-loras"].env not in scheduler  # 8 <= its default 32
    api = env(by_stage["api"])
    assert api[BY_FLAG["enable-lora"].env] == "true"
    assert not {BY_FLAG[f].env for f in ("max-loras", "lora-config")} & set(api)
    for stage in ("tokenizer", "detokenizer"):
        assert not any("LORA" in name for name in env(by_stage[stage]))


def test_many_resident_adapters_raise_the_host_cache():
    scheduler = env(containers(parse({"maxAdapters": 64}))["scheduler"])
    assert scheduler[BY_FLAG["max-cpu-loras"].env] == "64"


def test_the_adapters_file_is_a_configmap_volume_in_the_scheduler():
    parsed = parse({"adapters": ADAPTERS})
    made = children(parsed)
    config_map = made[manifests.LORA_CONFIG_MAP]
    assert config_map["metadata"]["name"] == "chat-lora"
    assert config_map["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    text = config_map["data"]["adapters.json"]
    # the document the scheduler's watcher reads, in the spec's order
    assert parse_adapters(text) == {a["name"]: a["uri"] for a in ADAPTERS}
    assert json.loads(text) == {"adapters": ADAPTERS}

    pod = made["Deployment"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == lora.LORA_VOLUME]
    # the whole ConfigMap (no items, no subPath): only then is the file updated in place
    assert volume["configMap"] == {"name": "chat-lora", "defaultMode": 0o444}
    by_stage = {c["name"]: c for c in pod["containers"]}
    (mount,) = [m for m in by_stage["scheduler"]["volumeMounts"] if m["name"] == lora.LORA_VOLUME]
    assert mount == {"name": "lora-config", "mountPath": "/etc/tokenline/lora", "readOnly": True}
    assert "subPath" not in mount
    for stage in ("api", "tokenizer", "detokenizer"):
        assert all(m["name"] != lora.LORA_VOLUME for m in by_stage[stage]["volumeMounts"])
    kv.validate(config_map, "1.33.0", strict=True)
    kv.validate(made["Deployment"], "1.33.0", strict=True)


@pytest.mark.parametrize(
    "changed",
    [
        [*ADAPTERS, {"name": "new", "uri": "hf://acme/new-lora"}],  # added
        ADAPTERS[1:],  # removed
        [{**ADAPTERS[0], "uri": "https://x.example.com/sql.tar.gz"}, *ADAPTERS[1:]],  # new uri
        [],  # none left
    ],
)
def test_changing_adapters_changes_only_the_configmap(changed):
    before, after = parse({"adapters": ADAPTERS}), parse({"adapters": changed})
    assert template(before) == template(after)
    old, new = children(before), children(after)
    assert old[manifests.LORA_CONFIG_MAP] != new[manifests.LORA_CONFIG_MAP]
    for kind in old:
        if kind != manifests.LORA_CONFIG_MAP:
            assert old[kind] == new[kind], kind


def test_a_changed_bound_rolls_the_pods():
    before = template(parse({"adapters": ADAPTERS}))
    assert before != template(parse({"adapters": ADAPTERS, "maxRank": 32}))
    assert before != template(parse({"adapters": ADAPTERS, "maxAdapters": 2}))


def test_the_scheduler_has_the_models_credentials_whatever_the_adapters():
    secrets = {"hfTokenSecret": {"name": "hf"}, "s3Secret": {"name": "s3"}}
    uri_model = {"uri": "hf://Qwen/Qwen3-0.6B@main", **secrets}
    parsed = spec.parse(
        "chat", {"model": {**uri_model, "lora": {"adapters": []}}}, default_image="t:1"
    )
    scheduler = env(containers(parsed)["scheduler"])
    assert scheduler["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    assert scheduler["AWS_ACCESS_KEY_ID"] == {
        "secretKeyRef": {"name": "s3", "key": "AWS_ACCESS_KEY_ID"}
    }
    assert scheduler["AWS_SESSION_TOKEN"]["secretKeyRef"]["optional"] is True
    # never a plain value
    for container in containers(parsed).values():
        for item in container["env"]:
            if item["name"] in {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}:
                assert "value" not in item
    # an s3:// adapter added later changes the ConfigMap only
    with_s3 = spec.parse(
        "chat",
        {"model": {**uri_model, "lora": {"adapters": [ADAPTERS[1]]}}},
        default_image="t:1",
    )
    assert template(parsed) == template(with_s3)
    # with model.name every stage has HF_TOKEN already: not twice
    named = parse({"adapters": ADAPTERS}, hfTokenSecret={"name": "hf"})
    names_ = [e["name"] for e in containers(named)["scheduler"]["env"]]
    assert names_.count("HF_TOKEN") == 1


def test_pvc_adapters_read_their_claim_read_only():
    adapters = [
        {"name": "a", "uri": "pvc://adapter-store/a"},
        {"name": "b", "uri": "pvc://adapter-store/team/b"},
        {"name": "c", "uri": "pvc://other"},
    ]
    parsed = parse({"adapters": adapters})
    doc = json.loads(children(parsed)[manifests.LORA_CONFIG_MAP]["data"]["adapters.json"])
    assert doc["adapters"] == [
        {"name": "a", "uri": "/mnt/lora/pvc/adapter-store/a"},
        {"name": "b", "uri": "/mnt/lora/pvc/adapter-store/team/b"},
        {"name": "c", "uri": "/mnt/lora/pvc/other"},
    ]
    pod = template(parsed)["spec"]
    claims = {
        v["persistentVolumeClaim"]["claimName"]: v["name"]
        for v in pod["volumes"]
        if v["name"].startswith("lora-pvc-")
    }
    assert set(claims) == {"adapter-store", "other"}
    for v in pod["volumes"]:
        if v["name"].startswith("lora-pvc-"):
            assert v["persistentVolumeClaim"]["readOnly"] is True
    scheduler = {c["name"]: c for c in pod["containers"]}["scheduler"]
    mounts = {m["mountPath"]: m for m in scheduler["volumeMounts"]}
    assert mounts["/mnt/lora/pvc/adapter-store"]["readOnly"] is True
    # another adapter on a claim already mounted: no rollout
    more = parse({"adapters": [*adapters, {"name": "d", "uri": "pvc://other/d"}]})
    assert template(more) == template(parsed)


def test_oci_adapters_are_image_volumes_where_the_cluster_has_them():
    adapters = [{"name": "img", "uri": "oci://ghcr.io/acme/sql-lora:v1"}]
    parsed = parse({"adapters": adapters})
    made = children(parsed, image_volumes=True)
    doc = json.loads(made[manifests.LORA_CONFIG_MAP]["data"]["adapters.json"])
    assert doc["adapters"] == [{"name": "img", "uri": "/mnt/lora/oci/img/models"}]
    pod = made["Deployment"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"].startswith("lora-oci-")]
    assert volume["image"]["reference"] == "ghcr.io/acme/sql-lora:v1"
    # without image volumes: the URI, for the scheduler to refuse (no init container)
    made = children(parsed, image_volumes=False)
    doc = json.loads(made[manifests.LORA_CONFIG_MAP]["data"]["adapters.json"])
    assert doc["adapters"] == adapters


# --- the picker -----------------------------------------------------------------------------


def _extractor(config: dict) -> dict:
    (plugin,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = plugin["parameters"]["engineConfigs"]
    return engine


def test_the_picker_scores_lora_affinity_from_vllms_metric():
    config = endpoint_picker_config(parse({"adapters": ADAPTERS}))
    assert _extractor(config)["loraSpec"] == LORA_METRIC == "vllm:lora_requests_info"
    assert {"type": LORA_SCORER} in config["plugins"]
    refs = {p["pluginRef"]: p["weight"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert refs[LORA_SCORER] == 2
    # every pluginRef names a declared plugin
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    assert set(refs) <= declared


def test_without_lora_the_picker_reads_no_lora_metric():
    config = endpoint_picker_config(parse(None))
    assert _extractor(config)["loraSpec"] == ""
    assert all(p["type"] != LORA_SCORER for p in config["plugins"])


def test_the_picker_configmap_carries_it():
    body = {
        "model": {"name": "tiny", "lora": {"adapters": ADAPTERS}},
        "routing": {"inferencePool": {"enabled": True}},
    }
    parsed = spec.parse("chat", body, default_image="t:1")
    made = [c for c in inference_pool.children(OWNER, parsed) if c["kind"] == "ConfigMap"]
    (text,) = made[0]["data"].values()
    config = yaml.safe_load(text)
    assert {"type": LORA_SCORER} in config["plugins"]
    assert _extractor(config)["loraSpec"] == LORA_METRIC


def test_turning_lora_on_restarts_the_picker_which_reads_its_config_once():
    def picker_template(model_spec: dict) -> dict:
        body = {"model": model_spec, "routing": {"inferencePool": {"enabled": True}}}
        parsed = spec.parse("chat", body, default_image="t:1")
        made = [c for c in inference_pool.children(OWNER, parsed) if c["kind"] == "Deployment"]
        return made[0]["spec"]["template"]

    plain = picker_template({"name": "tiny"})
    with_lora = picker_template({"name": "tiny", "lora": {"adapters": ADAPTERS}})
    assert plain != with_lora
    # an adapter more changes neither the picker nor its configuration
    more = picker_template({"name": "tiny", "lora": {"adapters": ADAPTERS[:1]}})
    assert more == with_lora
