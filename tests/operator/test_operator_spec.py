"""The CRD and the spec reader: defaults, validation, the example manifest."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml

from tokenline_operator import names
from tokenline_operator.crd import definition as crd
from tokenline_operator.crd import spec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inferenceservice.yaml"
MINIMAL = {"model": {"name": "tiny"}}


def object_schema() -> dict[str, Any]:
    (version,) = crd.custom_resource_definition()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)]
    for key, sub in schema.get("properties", {}).items():
        found += walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        found += walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        found += walk(schema["additionalProperties"], f"{path}{{}}")
    return found


@pytest.mark.parametrize("version", ["1.30", kv.latest_version()])
def test_crd_passes_kubernetes_validate_strict(version):
    kv.validate(crd.custom_resource_definition(), version, strict=True)


def test_crd_schema_is_structural():
    """Every node names its type (or is int-or-string), as the API server demands."""
    for path, node in walk(object_schema()):
        if path == ".metadata":
            assert node == {"type": "object"}
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path


def test_crd_defaults_satisfy_their_own_schema():
    for _, node in walk(object_schema()):
        if "default" in node:
            jsonschema.validate(node["default"], node)


def test_crd_names_scale_and_printer_columns():
    body = crd.custom_resource_definition()["spec"]
    assert body["names"]["shortNames"] == ["tlis"]
    (version,) = body["versions"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Ready", "Replicas", "Model", "Model State", "Age"]


def test_defaults_come_from_the_crd_and_leave_the_input_alone():
    raw = copy.deepcopy(MINIMAL)
    parsed = spec.parse("chat", raw, default_image="img:1")
    assert raw == MINIMAL
    assert parsed["image"] == "img:1"
    assert parsed["replicas"] == 1
    assert parsed["engine"] == {
        "gpus": 1,
        "device": "auto",
        "dtype": "auto",
        "gpuMemoryUtilization": 0.9,
        "maxNumSeqs": 256,
        "compile": False,
        "enforceEager": False,
        "prefixCaching": True,
        "tensorParallelSize": 1,
        "nodes": 1,
    }
    assert parsed["server"]["drainTimeoutSeconds"] == 30
    assert parsed["resources"]["scheduler"]["requests"] == {"cpu": "2", "memory": "8Gi"}
    assert parsed["autoscaling"]["enabled"] is False
    assert parsed["networkPolicy"] == {
        "enabled": True,
        "metricsFrom": [{"namespace": "monitoring"}],
    }
    assert "apiKeySecret" not in parsed["server"] and "tlsSecret" not in parsed["server"]
    assert spec.served_model_name(parsed) == "tiny"
    keyed = spec.parse(
        "chat", {**MINIMAL, "server": {"apiKeySecret": {"name": "k"}}}, default_image="img:1"
    )
    assert keyed["server"]["apiKeySecret"] == {"name": "k", "key": "api-keys"}


def test_user_values_win_over_defaults():
    parsed = spec.parse(
        "chat",
        {
            "model": {"name": "m", "servedName": "served"},
            "image": "mine:2",
            "resources": {"api": {"limits": {"cpu": "1"}}},
        },
        default_image="img:1",
    )
    assert parsed["image"] == "mine:2"
    assert parsed["resources"]["api"] == {"limits": {"cpu": "1"}}
    assert spec.served_model_name(parsed) == "served"


@pytest.mark.parametrize(
    ("name", "patch", "problem"),
    [
        ("chat", {"engine": {"dtype": "int4"}}, "spec.engine.dtype"),
        ("chat", {"engine": {"gpus": -1}}, "spec.engine.gpus"),
        ("chat", {"engine": {"gpuMemoryUtilization": 1.5}}, "spec.engine.gpuMemoryUtilization"),
        ("chat", {"engine": {"kvCacheMemory": "lots"}}, "spec.engine.kvCacheMemory"),
        ("chat", {"replicas": 0}, "spec.replicas"),
        ("chat", {"resources": {"api": {"limits": {"cpu": "two"}}}}, "spec.resources.api"),
        ("chat", {"model": {}}, "spec.model"),
        ("chat", {"tolerations": [{"operator": "Maybe"}]}, "spec.tolerations[0].operator"),
        ("chat", {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas"),
        (
            "chat",
            {"model": {"name": "m", "cache": {"sizeLimit": "1Gi", "claimName": "c"}}},
            "set one of sizeLimit (emptyDir), claimName (PVC) or hostPath",
        ),
        ("chat", {"engine": {"prefixCaching": "no"}}, "spec.engine.prefixCaching"),
        ("chat", {"server": {"apiKeySecret": {"key": "k"}}}, "spec.server.apiKeySecret"),
        ("chat", {"server": {"tlsSecret": {}}}, "spec.server.tlsSecret"),
        (
            "chat",
            {"networkPolicy": {"apiFrom": [{"cidr": "10.0.0.0/8", "namespace": "a"}]}},
            "spec.networkPolicy.apiFrom[0]: cidr cannot be combined",
        ),
        (
            "chat",
            {"networkPolicy": {"metricsFrom": [{"namespace": "a", "namespaceLabels": {}}]}},
            "spec.networkPolicy.metricsFrom[0]: set either namespace or namespaceLabels",
        ),
        ("chat", {"networkPolicy": {"apiFrom": [{"cidr": "anywhere"}]}}, "apiFrom[0].cidr"),
        ("chat", {"networkPolicy": {"apiFrom": [{"namespace": "Bad_NS"}]}}, "apiFrom[0].namespace"),
        ("chat", {"networkPolicy": {"apiFrom": [{}] * 33}}, "spec.networkPolicy.apiFrom"),
        (
            "chat",
            {"server": {"allowedOrigins": ["https://app.example.com/path"]}},
            "spec.server.allowedOrigins[0]",
        ),
        ("chat", {"server": {"allowedOrigins": ["https://a.example/"]}}, "allowedOrigins[0]"),
        ("chat", {"server": {"allowedOrigins": ["https://App.example"]}}, "allowedOrigins[0]"),
        ("chat", {"server": {"allowedOrigins": ["app.example.com"]}}, "allowedOrigins[0]"),
        ("chat", {"server": {"allowedOrigins": ["https://a,https://b"]}}, "allowedOrigins[0]"),
        ("chat", {"server": {"allowedOrigins": ["*"] * 65}}, "spec.server.allowedOrigins"),
        ("Chat", {}, "metadata.name"),
        ("x" * 53, {}, "metadata.name"),
    ],
)
def test_invalid_specs_name_the_problem(name, patch, problem):
    raw = {**MINIMAL, **patch}
    with pytest.raises(spec.SpecError, match=re.escape(problem)):
        spec.parse(name, raw, default_image="img:1")


@pytest.mark.parametrize(
    "origin",
    ["*", "https://app.example.com", "http://localhost:3000", "http://[::1]:8080", "app://x"],
)
def test_allowed_origins_accept_any_and_scheme_host_port(origin):
    raw = {**MINIMAL, "server": {"allowedOrigins": [origin]}}
    jsonschema.validate(
        {"apiVersion": names.API_VERSION, "kind": names.KIND, "spec": raw}, object_schema()
    )
    assert spec.parse("chat", raw, default_image="img:1")["server"]["allowedOrigins"] == [origin]


def test_no_image_anywhere_is_an_error():
    with pytest.raises(spec.SpecError, match=r"spec\.image"):
        spec.parse("chat", MINIMAL, default_image=None)


def test_example_validates_against_the_crd_schema():
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    assert docs, "the example has no documents"
    schema = object_schema()
    for doc in docs:
        assert doc["apiVersion"] == names.API_VERSION and doc["kind"] == names.KIND
        jsonschema.validate(doc, schema)
        spec.parse(doc["metadata"]["name"], doc["spec"], default_image="img:1")


def test_cli_parses_flags_and_environment(monkeypatch):
    from tokenline_operator import cli

    monkeypatch.setenv("TOKENLINE_DEFAULT_IMAGE", "registry.example/tokenline:9")
    monkeypatch.setenv("TOKENLINE_HEALTH_PORT", "9999")
    args = cli.build_parser().parse_args(["-n", "serving", "-n", "team-*"])
    assert args.namespace == ["serving", "team-*"]
    assert args.default_image == "registry.example/tokenline:9"
    assert (args.metrics_port, args.health_port) == (8080, 9999)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
