"""The Helm chart with real Helm (helm-python-sdk): lint, render, validate, schema."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml
from pod_security import hardening_violations, restricted_violations

from tokenline_operator import chartgen, names, rbac
from tokenline_operator.crd import definition as crd
from tokenline_operator.crd import spec
from tokenline_operator.objects import Owner
from tokenline_operator.pods.deployment import deployment

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tokenline"
RELEASE, NAMESPACE = "tl", "tokenline"
#: Kubernetes versions every rendered built-in object must validate against (strict).
KUBE_VERSIONS = ["1.30", kv.latest_version()]
#: Custom resources kubernetes-validate has no schema for; checked otherwise below.
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", names.KIND}

ALL_ON: dict[str, Any] = {
    "imagePullSecrets": [{"name": "registry"}],
    "operator": {
        "watchNamespaces": ["serving", "team-*"],
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops"}],
        "affinity": {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 1,
                        "preference": {
                            "matchExpressions": [
                                {"key": "pool", "operator": "In", "values": ["system"]}
                            ]
                        },
                    }
                ]
            }
        },
        "podAnnotations": {"example.com/owner": "ml-platform"},
        "podLabels": {"team": "ml"},
        "priorityClassName": "system-cluster-critical",
    },
    "serviceAccount": {"annotations": {"example.com/role": "operator"}},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "dashboards": {"enabled": True, "annotations": {"grafana_folder": "tokenline"}},
    "alerts": {"enabled": True, "labels": {"release": "prom"}},
    "sample": {"enabled": True},
}


def render(values: dict[str, Any] | None = None, chart: Path = CHART) -> list[dict[str, Any]]:
    with helm.Chart.load(chart) as loaded:
        manifests = loaded.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        kinds.setdefault(obj["kind"], []).append(obj)
    return kinds


def crd_schema() -> dict[str, Any]:
    (version,) = crd.custom_resource_definition()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def assert_valid(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        for version in KUBE_VERSIONS:
            kv.validate(obj, version, strict=True)


@pytest.mark.parametrize("values", [None, ALL_ON], ids=["default", "all-on"])
def test_lint_is_clean_in_strict_mode(values):
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert report["messages"] == []


def test_default_render_installs_the_operator_only():
    objects = render()
    assert_valid(objects)
    kinds = {kind: len(objs) for kind, objs in by_kind(objects).items()}
    assert kinds == {
        "ServiceAccount": 1,
        "ClusterRole": 1,
        "ClusterRoleBinding": 1,
        "Deployment": 1,
        "Service": 1,
        "NetworkPolicy": 1,
    }
    (deployment,) = by_kind(objects)["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][0] == "operator"
    assert container["image"] == "ghcr.io/tokenline/tokenline:0.1.0"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TOKENLINE_DEFAULT_IMAGE"] == container["image"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert pod["enableServiceLinks"] is False
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_all_optional_parts_render_and_validate():
    objects = render(ALL_ON)
    assert_valid(objects)
    kinds = by_kind(objects)

    dashboards = sorted(CHART.glob("dashboards/*.json"))
    config_maps = kinds.get("ConfigMap", [])
    assert len(config_maps) == len(dashboards)
    for cm in config_maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "tokenline"}
        ((key, text),) = cm["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / key).read_text())

    alerts = sorted(CHART.glob("alerts/*.yaml"))
    rules = kinds.get("PrometheusRule", [])
    assert len(rules) == len(alerts)
    for rule, path in zip(rules, alerts, strict=True):
        assert rule["apiVersion"] == "monitoring.coreos.com/v1"
        assert rule["metadata"]["labels"]["release"] == "prom"
        assert rule["spec"]["groups"] == yaml.safe_load(path.read_text())["groups"]

    (monitor,) = kinds["ServiceMonitor"]
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    (operator,) = kinds["Deployment"]
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=serving" in args and "--namespace=team-*" in args

    (sample,) = kinds[names.KIND]
    jsonschema.validate(sample, crd_schema())
    spec.parse(sample["metadata"]["name"], sample["spec"], default_image=None)

    (test_pod,) = kinds["Pod"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = test_pod["spec"]["containers"][0]["args"][0]
    assert f"http://tiny.{NAMESPACE}.svc:8000/v1/models" in script
    compile(script, "helm-test", "exec")  # the hook's Python at least parses


def test_chart_renders_when_dashboards_and_alerts_are_missing(tmp_path):
    bare = tmp_path / "tokenline"
    shutil.copytree(CHART, bare, ignore=shutil.ignore_patterns("dashboards", "alerts"))
    (bare / "alerts").mkdir()
    (bare / "alerts" / "empty.yaml").write_text("# no rules yet\n")
    assert helm.lint(bare, ALL_ON, strict=True)["errors"] == []
    kinds = by_kind(render(ALL_ON, chart=bare))
    assert "ConfigMap" not in kinds
    assert "PrometheusRule" not in kinds


def test_chart_rbac_is_the_operators():
    (role,) = by_kind(render())["ClusterRole"]
    assert role["rules"] == rbac.rules()
    (binding,) = by_kind(render())["ClusterRoleBinding"]
    (subject,) = binding["subjects"]
    assert (subject["name"], subject["namespace"]) == (f"{RELEASE}-tokenline-operator", NAMESPACE)


def test_generated_chart_files_are_current():
    """CRD, RBAC rules and values schema come from Python; regenerate with chartgen."""
    assert chartgen.stale_files(CHART) == [], "run: python -m tokenline_operator.chartgen"
    with helm.Chart.load(CHART) as loaded:
        (crd_file,) = loaded.crds
        assert yaml.safe_load(crd_file["data"]) == crd.custom_resource_definition()
        assert loaded.schema == chartgen.values_schema()
    for version in KUBE_VERSIONS:
        kv.validate(crd.custom_resource_definition(), version, strict=True)


@pytest.mark.parametrize(
    "values",
    [
        {"operator": {"logLevel": "loud"}},
        {"operator": {"watchNamespaces": "serving"}},
        {"operator": {"metricsPort": 70000}},
        {"serviceAccount": {"create": "yes"}},
        {"image": {"pullPolicy": "Sometimes"}},
        {"dashboards": {"enabeld": True}},
        {"unknownTopLevel": 1},
        {"sample": {"name": "Not_A_Name"}},
        {"sample": {"spec": {"model": {"name": "tiny"}, "engine": {"dtype": "int4"}}}},
        {"sample": {"spec": {"model": {"name": ""}}}},
        {"metrics": {"serviceMonitor": {"interval": "often"}}},
        {"networkPolicy": {"enabled": "yes"}},
        {"networkPolicy": {"metricsFrom": {"namespace": "monitoring"}}},
        {"tests": {"apiKeySecret": {"key": "k"}}},
        {"sample": {"spec": {"model": {"name": "m"}, "server": {"apiKeySecret": {}}}}},
        # spec.model.lora (issue 27): a bad adapter name, a missing uri, out of bounds
        {
            "sample": {
                "spec": {
                    "model": {"name": "m", "lora": {"adapters": [{"name": "a b", "uri": "/x"}]}}
                }
            }
        },
        {"sample": {"spec": {"model": {"name": "m", "lora": {"adapters": [{"name": "a"}]}}}}},
        {"sample": {"spec": {"model": {"name": "m", "lora": {"maxRank": 0}}}}},
    ],
    ids=lambda v: json.dumps(v, sort_keys=True)[:60],
)
def test_values_schema_rejects_bad_values(values):
    with helm.Chart.load(CHART) as loaded:
        with pytest.raises(helm.HelmValuesError):
            loaded.validate_schema(values)
        with pytest.raises(helm.HelmError):
            loaded.render(values, name=RELEASE, namespace=NAMESPACE)


def test_values_schema_accepts_the_documented_values():
    with helm.Chart.load(CHART) as loaded:
        loaded.validate_schema(None)
        loaded.validate_schema(ALL_ON)
        example = next(
            yaml.safe_load_all((ROOT / "examples" / "inferenceservice.yaml").read_text())
        )
        loaded.validate_schema({"sample": {"enabled": True, "spec": example["spec"]}})


def test_the_sample_serves_lora_adapters():
    adapters = [{"name": "sql", "uri": "hf://acme/sql-lora@v1"}, {"name": "b", "uri": "/opt/b"}]
    values = {
        "sample": {
            "enabled": True,
            "spec": {"model": {"name": "tiny", "lora": {"adapters": adapters, "maxRank": 8}}},
        }
    }
    with helm.Chart.load(CHART) as loaded:
        loaded.validate_schema(values)
    (sample,) = by_kind(render(values))[names.KIND]
    jsonschema.validate(sample, crd_schema())
    parsed = spec.parse(sample["metadata"]["name"], sample["spec"], default_image="t:1")
    assert parsed["model"]["lora"]["adapters"] == adapters


def test_dockerfile_has_no_hadolint_errors():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run(
        [hadolint, "--no-color", "--format", "json", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    findings = json.loads(result.stdout or "[]")
    assert [f for f in findings if f["level"] == "error"] == []
    assert findings == [], "hadolint warnings: fix them or ignore them with a reason"


def test_dockerfile_honours_the_image_contract():
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tokenline"]' in text
    # The last USER wins: numeric, not root, in a non-root group.
    users = re.findall(r"^USER (\S+)$", text, flags=re.MULTILINE)
    assert users[-1] == f"{names.RUN_AS_USER}:{names.RUN_AS_USER}"
    assert f'VOLUME ["{names.MODEL_CACHE_DIR}"]' in text
    final_stage = text.rsplit("\nFROM ", 1)[1]
    # torch.compile builds kernels at run time (Triton's launcher, inductor's C++): a C and a
    # C++ compiler and Python's headers, but no build tools beyond them
    assert all(package in final_stage for package in ("gcc", "g++", "python3-dev"))
    assert "build-essential" not in final_stage
    assert (ROOT / ".dockerignore").is_file()


def test_kubernetes_validate_cli_strict_passes_on_the_whole_release(tmp_path):
    """The same check as above through the `kubernetes-validate --strict` command itself."""
    release = tmp_path / "release.yaml"
    release.write_text(yaml.safe_dump_all(render(ALL_ON)))
    cli = shutil.which("kubernetes-validate") or str(
        Path(sys.executable).parent / "kubernetes-validate"
    )
    versions = [arg for v in KUBE_VERSIONS for arg in ("-k", v)]
    crd_file = CHART / "crds" / f"{names.CRD_NAME}.yaml"
    result = subprocess.run(
        [cli, "--strict", *versions, str(release), str(crd_file)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout
    unchecked = {
        line.split("kind ")[1].split(" ")[0]
        for line in result.stdout.splitlines()
        if line.startswith("WARN")
    }
    assert unchecked <= CUSTOM_KINDS


def pod_templates(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, pod template or Pod) of everything the release runs."""
    found = []
    for obj in objects:
        if obj["kind"] == "Pod":
            found.append((obj["metadata"]["name"], obj))
        elif obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            found.append((obj["metadata"]["name"], obj["spec"]["template"]))
    return found


@pytest.mark.parametrize("values", [None, ALL_ON], ids=["default", "all-on"])
def test_every_pod_passes_the_restricted_pod_security_standard(values):
    objects = render(values)
    pods = pod_templates(objects)
    assert {name for name, _ in pods} >= {f"{RELEASE}-tokenline-operator"}
    for name, pod in pods:
        assert restricted_violations(pod["spec"], pod.get("metadata")) == [], name
        assert hardening_violations(pod["spec"]) == [], name
    # The sample's stage pods are the operator's to render: the same checks.
    for sample in by_kind(objects).get(names.KIND, []):
        parsed = spec.parse(sample["metadata"]["name"], sample["spec"], default_image=None)
        owner = Owner(sample["metadata"]["name"], NAMESPACE, "uid")
        template = deployment(owner, parsed)["spec"]["template"]
        assert restricted_violations(template["spec"], template["metadata"]) == []


def test_only_the_operator_pod_gets_a_service_account_token():
    for name, pod in pod_templates(render(ALL_ON)):
        wants_token = name == f"{RELEASE}-tokenline-operator"
        assert pod["spec"]["automountServiceAccountToken"] is wants_token, name


def test_operator_network_policy_admits_prometheus_to_the_metrics_port_only():
    (policy,) = by_kind(render())["NetworkPolicy"]
    (deployment,) = by_kind(render())["Deployment"]
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8080}]

    peers = [{"podSelector": {"matchLabels": {"app": "prometheus"}}}]
    values = {"networkPolicy": {"metricsFrom": peers}, "operator": {"metricsPort": 9100}}
    (policy,) = by_kind(render(values))["NetworkPolicy"]
    assert policy["spec"]["ingress"] == [
        {"from": peers, "ports": [{"protocol": "TCP", "port": 9100}]}
    ]
    # No peers closes the port: an ingress rule without peers would admit everyone.
    (policy,) = by_kind(render({"networkPolicy": {"metricsFrom": []}}))["NetworkPolicy"]
    assert policy["spec"]["ingress"] == []
    assert "NetworkPolicy" not in by_kind(render({"networkPolicy": {"enabled": False}}))


def test_helm_test_sends_the_samples_api_key():
    keyed = {
        "sample": {
            "enabled": True,
            "spec": {"model": {"name": "tiny"}, "server": {"apiKeySecret": {"name": "llm-keys"}}},
        }
    }
    objects = render(keyed)
    assert_valid(objects)
    (pod,) = by_kind(objects)["Pod"]
    (volume,) = pod["spec"]["volumes"]
    assert volume["secret"]["secretName"] == "llm-keys"
    assert volume["secret"]["items"] == [{"key": "api-keys", "path": "api-keys"}]
    (container,) = pod["spec"]["containers"]
    (mount,) = container["volumeMounts"]
    assert "subPath" not in mount
    script = container["args"][0]
    assert f"{mount['mountPath']}/api-keys" in script and "Authorization" in script
    compile(script, "helm-test", "exec")

    other = {"tests": {"target": "chat", "apiKeySecret": {"name": "chat-keys", "key": "k"}}}
    (pod,) = by_kind(render(other))["Pod"]
    (volume,) = pod["spec"]["volumes"]
    assert volume["secret"]["items"] == [{"key": "k", "path": "api-keys"}]
    (pod,) = by_kind(render({"sample": {"enabled": True}}))["Pod"]
    assert "volumes" not in pod["spec"]
