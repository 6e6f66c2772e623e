"""Pure manifest builders: the pod contract, the optional children, strict validation."""

from __future__ import annotations

from typing import Any

import kubernetes_validate.utils as kv
import pytest
from pod_security import hardening_violations, restricted_violations

from tokenline.cli import build_parser, settings_from
from tokenline_operator import names, rbac
from tokenline_operator.controller import manifests
from tokenline_operator.crd import spec
from tokenline_operator.objects import Capabilities, Owner, selector_labels
from tokenline_operator.pods import config, monitoring, scaling
from tokenline_operator.pods import deployment as pods
from tokenline_operator.routing import network

OWNER = Owner(name="chat", namespace="serving", uid="0b9c5a3e-1111-4c1b-9f44-2a4c1d6e7f80")
ALL_CAPS = Capabilities(keda=True, prometheus_operator=True)
#: Custom resources kubernetes-validate has no schema for.
CUSTOM_KINDS = {"ScaledObject", "PodMonitor"}

FULL: dict[str, Any] = {
    "model": {
        "name": "Qwen/Qwen2.5-7B-Instruct",
        "servedName": "qwen",
        "revision": "main",
        "hfTokenSecret": {"name": "hf"},
        "cache": {"claimName": "models"},
    },
    "image": "registry.example/tokenline:1.0",
    "imagePullPolicy": "IfNotPresent",
    "imagePullSecrets": ["regcred"],
    "replicas": 3,
    "engine": {"gpus": 2, "dtype": "bfloat16", "maxModelLen": 8192, "kvCacheMemory": "8GiB"},
    "resources": {"scheduler": {"requests": {"cpu": "4"}, "limits": {"memory": "64Gi"}}},
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": "inference",
    "serviceAccountName": "models",
    "service": {"type": "LoadBalancer", "port": 80, "annotations": {"a": "b"}},
    "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8},
    "monitoring": {"labels": {"release": "prom"}},
    "networkPolicy": {
        "apiFrom": [
            {"namespace": "gateway", "podLabels": {"app": "envoy"}},
            {"namespaceLabels": {"team": "ml"}},
            {"podLabels": {"app": "chat-ui"}},
            {"cidr": "10.20.0.0/16"},
        ],
        "metricsFrom": [{"namespace": "observability"}],
    },
}
#: Every optional pod feature at once: keys, TLS, prefix caching off.
SECURED: dict[str, Any] = {
    "model": {"name": "tiny"},
    "engine": {"gpus": 0, "prefixCaching": False},
    "server": {"apiKeySecret": {"name": "llm-keys"}, "tlsSecret": {"name": "llm-tls"}},
}


def parse(raw: dict[str, Any]) -> spec.Spec:
    return spec.parse(OWNER.name, raw, default_image="tokenline:test")


def pod_of(raw: dict[str, Any]) -> dict[str, Any]:
    return pods.deployment(OWNER, parse(raw))["spec"]["template"]["spec"]


def containers_of(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod_of(raw)["containers"]}


CONFIGS = {
    "minimal": ({"model": {"name": "tiny"}}, Capabilities()),
    "full-keda": (FULL, ALL_CAPS),
    "full-hpa": (FULL, Capabilities()),
    "secured": (SECURED, ALL_CAPS),
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("version", ["1.30", kv.latest_version()])
def test_every_child_passes_kubernetes_validate_strict(config, version):
    raw, caps = CONFIGS[config]
    children = manifests.children(OWNER, parse(raw), caps)
    for kind, obj in children.items():
        assert obj["kind"] == kind
        if kind in CUSTOM_KINDS:
            continue
        kv.validate(obj, version, strict=True)


def test_children_are_owned_and_labelled():
    for obj in manifests.children(OWNER, parse(FULL), ALL_CAPS).values():
        meta = obj["metadata"]
        assert meta["namespace"] == OWNER.namespace
        (ref,) = meta["ownerReferences"]
        assert ref == {
            "apiVersion": names.API_VERSION,
            "kind": names.KIND,
            "name": OWNER.name,
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert meta["labels"][names.LABEL_MANAGED_BY] == names.MANAGED_BY
        assert meta["labels"][names.LABEL_OWNER] == OWNER.name


def test_one_pod_runs_four_stages_over_ipc():
    containers = containers_of({"model": {"name": "tiny"}})
    assert list(containers) == list(names.STAGES)
    assert containers["api"]["args"][:1] == ["api"]
    for stage in ("tokenizer", "scheduler", "detokenizer"):
        port = names.METRICS_PORTS[stage]
        assert containers[stage]["args"] == [stage, "--metrics-port", str(port)]
        assert containers[stage]["ports"] == [
            {"name": names.PORT_NAMES[stage], "containerPort": port, "protocol": "TCP"}
        ]
        assert containers[stage]["livenessProbe"]["httpGet"]["path"] == "/metrics"
    # Every stage knows every inbox, as a socket in the shared ring volume: no ring port.
    expected = {
        f"TOKENLINE_{stage.upper()}_ENDPOINT": f"ipc://{names.RING_DIR}/{stage}.sock"
        for stage in names.STAGES
    }
    for container in containers.values():
        env = {e["name"]: e.get("value") for e in container["env"] if "ENDPOINT" in e["name"]}
        assert env == expected, container["name"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["ring"] == names.RING_DIR
    volumes = {v["name"]: v for v in pod_of({"model": {"name": "tiny"}})["volumes"]}
    assert volumes["ring"]["emptyDir"]["medium"] == "Memory"


def test_api_probes_allow_model_loading_and_drain():
    raw = {"model": {"name": "tiny"}, "server": {"startupTimeoutSeconds": 900}}
    api = containers_of(raw)["api"]
    startup = api["startupProbe"]
    assert startup["httpGet"]["path"] == "/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
    assert api["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert api["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert api["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"

    pod = pod_of({"model": {"name": "tiny"}, "server": {"drainTimeoutSeconds": 45}})
    assert pod["terminationGracePeriodSeconds"] > 45 + pods.PRESTOP_SLEEP_SECONDS
    assert pod["enableServiceLinks"] is False


def test_gpu_goes_to_the_scheduler_only():
    containers = containers_of({"model": {"name": "m"}, "engine": {"gpus": 2}})
    sched = containers["scheduler"]["resources"]
    assert sched["limits"]["nvidia.com/gpu"] == 2
    assert sched["requests"]["nvidia.com/gpu"] == 2
    for stage in ("api", "tokenizer", "detokenizer"):
        assert "nvidia.com/gpu" not in str(containers[stage]["resources"])

    cpu_only = parse({"model": {"name": "tiny"}, "engine": {"gpus": 0}})
    assert "nvidia.com/gpu" not in str(pods.deployment(OWNER, cpu_only))
    assert config.config_map_data(cpu_only)["TOKENLINE_DEVICE"] == "cpu"


def test_step_budget_is_the_schedulers_own_unless_the_spec_sets_one():
    """The scheduler picks its step budget by device (2048 on a GPU, 128 on CPU); a default
    in the CRD would give CPU pods GPU-sized steps."""
    unset = parse({"model": {"name": "tiny"}, "engine": {"gpus": 0}})
    assert "TOKENLINE_MAX_NUM_BATCHED_TOKENS" not in config.config_map_data(unset)
    chosen = parse({"model": {"name": "tiny"}, "engine": {"maxNumBatchedTokens": 512}})
    assert config.config_map_data(chosen)["TOKENLINE_MAX_NUM_BATCHED_TOKENS"] == "512"


def test_each_stage_gets_only_its_own_settings_from_the_configmap():
    containers = containers_of(FULL)
    settings = config.config_map_data(parse(FULL))
    assert settings["TOKENLINE_MAX_MODEL_LEN"] == "8192"
    for stage, container in containers.items():
        from_configmap = {
            e["name"]
            for e in container["env"]
            if e.get("valueFrom", {}).get("configMapKeyRef", {}).get("name") == "chat-config"
        }
        allowed = {*config.STAGE_SETTINGS["common"], *config.STAGE_SETTINGS[stage]}
        assert from_configmap == allowed & set(settings), stage
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_HOME"]["value"].startswith(names.MODEL_CACHE_DIR)
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["model-cache"] == names.MODEL_CACHE_DIR


def test_model_cache_is_an_emptydir_or_a_claim():
    volumes = {v["name"]: v for v in pod_of({"model": {"name": "m"}})["volumes"]}
    assert volumes["model-cache"]["emptyDir"] == {}
    sized = {"model": {"name": "m", "cache": {"sizeLimit": "50Gi"}}}
    volumes = {v["name"]: v for v in pod_of(sized)["volumes"]}
    assert volumes["model-cache"]["emptyDir"] == {"sizeLimit": "50Gi"}
    volumes = {v["name"]: v for v in pod_of(FULL)["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "models"}


def test_settings_change_rolls_the_pods_and_replicas_do_not():
    def pod_hash(raw: dict[str, Any]) -> str:
        template = pods.deployment(OWNER, parse(raw))["spec"]["template"]
        return template["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH]

    base = {"model": {"name": "a"}}
    assert pod_hash(base) == pod_hash({**base, "replicas": 4})
    assert pod_hash(base) != pod_hash({"model": {"name": "b"}})
    assert pod_hash(base) != pod_hash({**base, "engine": {"maxNumSeqs": 8}})


def test_optional_children_follow_the_spec_and_the_cluster():
    def kinds(raw: dict[str, Any], caps: Capabilities) -> set[str]:
        return set(manifests.children(OWNER, parse(raw), caps))

    base = {"ConfigMap", "Deployment", "Service", "NetworkPolicy"}
    one = {"model": {"name": "m"}}
    assert kinds(one, Capabilities()) == base
    assert kinds(one, ALL_CAPS) == base | {"PodMonitor"}
    assert kinds({**one, "replicas": 2}, Capabilities()) == base | {"PodDisruptionBudget"}
    auto = {**one, "autoscaling": {"enabled": True, "maxReplicas": 3}}
    assert kinds(auto, Capabilities()) == base | {"PodDisruptionBudget", "HorizontalPodAutoscaler"}
    assert kinds(auto, Capabilities(keda=True)) == base | {"PodDisruptionBudget", "ScaledObject"}
    forced = {**one, "autoscaling": {"enabled": True, "maxReplicas": 1, "provider": "hpa"}}
    assert kinds(forced, ALL_CAPS) == base | {"HorizontalPodAutoscaler", "PodMonitor"}
    off = {**one, "monitoring": {"podMonitor": False}}
    assert kinds(off, ALL_CAPS) == base


def test_autoscalers_target_the_waiting_gauge():
    parsed = parse(FULL)
    scaled = scaling.scaled_object(OWNER, parsed)
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["metadata"]["query"] == (
        'sum(tokenline_num_requests_waiting{namespace="serving",inferenceservice="chat"})'
    )
    assert scaled["spec"]["scaleTargetRef"]["name"] == OWNER.name
    hpa = scaling.horizontal_pod_autoscaler(OWNER, parsed)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == names.WAITING_METRIC
    assert "replicas" not in manifests.children(OWNER, parsed, ALL_CAPS)["Deployment"]["spec"]


def test_pod_monitor_scrapes_every_stage_with_its_owner_label():
    monitor = monitoring.pod_monitor(OWNER, parse(FULL))
    assert monitor["metadata"]["labels"]["release"] == "prom"
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == [names.PORT_NAMES[s] for s in names.STAGES]
    relabel = endpoints[0]["relabelings"][0]
    assert relabel["targetLabel"] == "inferenceservice"
    label = names.LABEL_OWNER.replace(".", "_").replace("/", "_")
    assert relabel["sourceLabels"] == [f"__meta_kubernetes_pod_label_{label}"]


def test_rbac_allows_every_write_the_reconciler_makes():
    from tokenline_operator.kube import KINDS

    granted: dict[tuple[str, str], set[str]] = {}
    for rule in rbac.rules():
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    for kind in manifests.children(OWNER, parse(FULL), ALL_CAPS):
        ref = KINDS[kind]
        verbs = granted[(ref.group, ref.plural)]
        assert {"get", "list", "watch", "create", "patch"} <= verbs, kind
        if kind in manifests.OPTIONAL_KINDS:
            assert "delete" in verbs, kind
    assert "patch" in granted[(names.GROUP, f"{names.PLURAL}/status")]
    assert "create" in granted[("", "events")]
    kv.validate(rbac.cluster_role("tokenline-operator"), kv.latest_version(), strict=True)


@pytest.mark.parametrize("config", CONFIGS)
def test_stage_pods_pass_the_restricted_pod_security_standard(config):
    raw, caps = CONFIGS[config]
    template = manifests.children(OWNER, parse(raw), caps)["Deployment"]["spec"]["template"]
    assert restricted_violations(template["spec"], template["metadata"]) == []
    assert hardening_violations(template["spec"]) == []
    # No stage talks to the API server: no token to steal.
    assert template["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize(
    ("change", "control"),
    [
        (lambda pod: pod.update(hostNetwork=True), "Host namespaces"),
        (lambda pod: pod["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "HostPath"),
        (lambda pod: pod["volumes"].append({"name": "n", "nfs": {"server": "s"}}), "Volume types"),
        (lambda pod: pod["securityContext"].pop("runAsNonRoot"), "Running as non-root"),
        (lambda pod: pod["securityContext"].update(runAsUser=0), "non-root user"),
        (lambda pod: pod["securityContext"].pop("seccompProfile"), "Seccomp"),
        (
            lambda pod: pod["containers"][0]["securityContext"].update(
                seccompProfile={"type": "Unconfined"}
            ),
            "Seccomp",
        ),
        (
            lambda pod: pod["containers"][1]["securityContext"].pop("allowPrivilegeEscalation"),
            "Privilege escalation",
        ),
        (
            lambda pod: pod["containers"][2]["securityContext"].update(privileged=True),
            "Privileged",
        ),
        (
            lambda pod: pod["containers"][2]["securityContext"].update(
                capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}
            ),
            "Capabilities",
        ),
        (
            lambda pod: pod["containers"][3]["securityContext"].update(capabilities={}),
            "must drop ALL",
        ),
        (lambda pod: pod["containers"][0]["ports"][0].update(hostPort=80), "Host ports"),
        (
            lambda pod: pod["securityContext"].update(sysctls=[{"name": "kernel.msgmax"}]),
            "Sysctls",
        ),
    ],
)
def test_the_checker_catches_what_the_standard_forbids(change, control):
    pod = pod_of({"model": {"name": "tiny"}})
    change(pod)
    problems = restricted_violations(pod)
    assert any(control in p for p in problems), problems


def test_read_only_root_leaves_a_volume_for_every_path_a_stage_writes():
    pod = pod_of(SECURED)
    writable_env = {
        "TOKENLINE_MODEL_CACHE_DIR",
        "HF_HOME",
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
    }
    for container in pod["containers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = [m for m in container["volumeMounts"] if not m.get("readOnly")]
        env = {e["name"]: e.get("value") for e in container["env"]}
        paths = ["/tmp", names.RING_DIR] + [env[k] for k in writable_env if k in env]
        paths += [
            env[k].removeprefix("ipc://").rsplit("/", 1)[0] for k in env if k.endswith("_ENDPOINT")
        ]
        for path in paths:
            assert any(
                path == m["mountPath"] or path.startswith(m["mountPath"] + "/") for m in mounts
            ), (container["name"], path)
    scheduler = {c["name"]: c for c in pod["containers"]}["scheduler"]
    env = {e["name"]: e.get("value") for e in scheduler["env"]}
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(names.COMPILE_CACHE_DIR)
    assert env["TRITON_CACHE_DIR"].startswith(names.COMPILE_CACHE_DIR)


def test_api_keys_come_from_a_whole_secret_directory():
    pod = pod_of(SECURED)
    containers = {c["name"]: c for c in pod["containers"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret = volumes["api-key"]["secret"]
    assert secret["secretName"] == "llm-keys"
    assert secret["items"] == [{"key": "api-keys", "path": "api-keys"}]
    # Readable by the stages' group (the pod's fsGroup), by nobody else.
    assert secret["defaultMode"] == 0o440
    api = containers["api"]
    (mount,) = [m for m in api["volumeMounts"] if m["name"] == "api-key"]
    # A subPath mount would keep the old key after the Secret is rotated.
    assert "subPath" not in mount and mount["readOnly"] is True
    env = {e["name"]: e.get("value") for e in api["env"]}
    assert env["TOKENLINE_API_KEY_FILE"] == f"{mount['mountPath']}/api-keys"
    for stage in ("tokenizer", "scheduler", "detokenizer"):
        assert "TOKENLINE_API_KEY_FILE" not in str(containers[stage]["env"])
        assert "api-key" not in {m["name"] for m in containers[stage]["volumeMounts"]}
    chosen = {"model": {"name": "m"}, "server": {"apiKeySecret": {"name": "k", "key": "keys"}}}
    volumes = {v["name"]: v for v in pod_of(chosen)["volumes"]}
    assert volumes["api-key"]["secret"]["items"] == [{"key": "keys", "path": "api-keys"}]
    plain = pod_of({"model": {"name": "m"}})
    assert "api-key" not in {v["name"] for v in plain["volumes"]}
    assert "TOKENLINE_API_KEY_FILE" not in str(plain)


def test_tls_secret_serves_https_and_probes_follow():
    parsed = parse(SECURED)
    pod_spec = pods.deployment(OWNER, parsed)["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod_spec["containers"]}
    api = containers["api"]
    env = {e["name"]: e.get("value") for e in api["env"]}
    (mount,) = [m for m in api["volumeMounts"] if m["name"] == "tls"]
    assert env["TOKENLINE_SSL_CERTFILE"] == f"{mount['mountPath']}/tls.crt"
    assert env["TOKENLINE_SSL_KEYFILE"] == f"{mount['mountPath']}/tls.key"
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "llm-tls"
    assert {i["key"] for i in volumes["tls"]["secret"]["items"]} == {"tls.crt", "tls.key"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert api[probe]["httpGet"]["scheme"] == "HTTPS", probe
    for stage in ("tokenizer", "scheduler", "detokenizer"):
        assert "scheme" not in containers[stage]["livenessProbe"]["httpGet"]
        assert "SSL" not in str(containers[stage]["env"])
    assert network.service(OWNER, parsed)["spec"]["ports"][0]["appProtocol"] == "https"
    endpoints = monitoring.pod_monitor(OWNER, parsed)["spec"]["podMetricsEndpoints"]
    assert [e.get("scheme", "http") for e in endpoints] == ["https", "http", "http", "http"]

    plain = containers_of({"model": {"name": "m"}})["api"]
    assert "scheme" not in plain["readinessProbe"]["httpGet"]
    assert "SSL" not in str(plain["env"])


def test_prefix_caching_off_reaches_the_scheduler_alone_and_on_rolls_nothing():
    def template(raw: dict[str, Any]) -> dict[str, Any]:
        return pods.deployment(OWNER, parse(raw))["spec"]["template"]

    off = parse({"model": {"name": "m"}, "engine": {"prefixCaching": False}})
    assert config.config_map_data(off)["TOKENLINE_NO_PREFIX_CACHING"] == "1"
    containers = containers_of({"model": {"name": "m"}, "engine": {"prefixCaching": False}})
    for stage, container in containers.items():
        has = any(e["name"] == "TOKENLINE_NO_PREFIX_CACHING" for e in container["env"])
        assert has == (stage == "scheduler"), stage
    # On (the default) adds nothing: pods made before the field existed do not roll.
    default = {"model": {"name": "m"}}
    assert "TOKENLINE_NO_PREFIX_CACHING" not in config.config_map_data(parse(default))
    explicit = {"model": {"name": "m"}, "engine": {"prefixCaching": True}}
    assert template(default) == template(explicit)


APP_ORIGIN = "https://app.example.com"


def test_allowed_origins_reach_the_api_alone_and_unset_rolls_nothing():
    raw = {"model": {"name": "m"}, "server": {"allowedOrigins": [APP_ORIGIN]}}
    assert config.config_map_data(parse(raw))["TOKENLINE_ALLOWED_ORIGIN"] == APP_ORIGIN
    for stage, container in containers_of(raw).items():
        env = {e["name"]: e for e in container["env"]}
        if stage == "api":
            ref = env["TOKENLINE_ALLOWED_ORIGIN"]["valueFrom"]["configMapKeyRef"]
            assert ref == {"name": "chat-config", "key": "TOKENLINE_ALLOWED_ORIGIN"}
        else:
            assert "TOKENLINE_ALLOWED_ORIGIN" not in env, stage
    # Unset and empty both leave CORS off and add no key: existing pods do not roll.
    unset = {"model": {"name": "m"}}
    assert "TOKENLINE_ALLOWED_ORIGIN" not in config.config_map_data(parse(unset))
    empty = {**unset, "server": {"allowedOrigins": []}}
    assert pods.deployment(OWNER, parse(unset)) == pods.deployment(OWNER, parse(empty))


def test_several_allowed_origins_parse_back_as_the_api_reads_its_env(monkeypatch):
    origins = [APP_ORIGIN, "http://localhost:3000", "*"]
    raw = {"model": {"name": "m"}, "server": {"allowedOrigins": origins}}
    value = config.config_map_data(parse(raw))["TOKENLINE_ALLOWED_ORIGIN"]
    monkeypatch.setenv("TOKENLINE_ALLOWED_ORIGIN", value)
    assert settings_from(build_parser().parse_args(["api"])).allowed_origins == origins


def rules_of(raw: dict[str, Any]) -> list[dict[str, Any]]:
    return network.network_policy(OWNER, parse(raw))["spec"]["ingress"]


def test_network_policy_defaults_to_the_own_namespace_and_monitoring():
    policy = network.network_policy(OWNER, parse({"model": {"name": "m"}}))
    assert policy["spec"]["podSelector"] == {"matchLabels": selector_labels(OWNER.name)}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    api, metrics = policy["spec"]["ingress"]
    # An empty podSelector with no namespaceSelector: every pod of the owner's namespace.
    assert api == {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 8000}]}
    assert metrics["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert [p["port"] for p in metrics["ports"]] == [8000, 8001, 8002, 8003]


def test_network_policy_admits_exactly_the_named_peers():
    api, metrics = rules_of(FULL)
    assert api["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
            "podSelector": {"matchLabels": {"app": "envoy"}},
        },
        {"namespaceSelector": {"matchLabels": {"team": "ml"}}},
        {"podSelector": {"matchLabels": {"app": "chat-ui"}}},
        {"ipBlock": {"cidr": "10.20.0.0/16"}},
    ]
    assert [p["port"] for p in api["ports"]] == [names.API_PORT]
    assert metrics["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}}
    ]
    everywhere = {"model": {"name": "m"}, "networkPolicy": {"apiFrom": [{"namespaceLabels": {}}]}}
    assert rules_of(everywhere)[0]["from"] == [{"namespaceSelector": {}}]


def test_network_policy_never_writes_a_rule_that_admits_everyone():
    """A rule with no peers admits every source: an empty list must drop the rule."""
    closed = {"model": {"name": "m"}, "networkPolicy": {"apiFrom": [], "metricsFrom": []}}
    (api,) = rules_of(closed)
    assert api["from"] == [{"podSelector": {}}]  # empty apiFrom: the own namespace
    for raw in (closed, FULL, {"model": {"name": "m"}}):
        for rule in rules_of(raw):
            assert rule["from"] and all(rule["from"]) and rule["ports"]


def test_network_policy_can_be_turned_off():
    def kinds(raw: dict[str, Any]) -> set[str]:
        return set(manifests.children(OWNER, parse(raw), Capabilities()))

    assert "NetworkPolicy" in kinds({"model": {"name": "m"}})
    assert "NetworkPolicy" not in kinds(
        {"model": {"name": "m"}, "networkPolicy": {"enabled": False}}
    )
    assert "NetworkPolicy" in manifests.OPTIONAL_KINDS  # so the reconciler deletes it
