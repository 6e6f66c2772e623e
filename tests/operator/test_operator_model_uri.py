"""spec.model.uri (issue 26): each scheme's pod, the CRD's validation, status.model.

Pure builders and pure status: no cluster. The kmock end-to-end test is
test_operator_model_uri_e2e.py.
"""

from __future__ import annotations

import datetime
import json
import re
from typing import Any

import kubernetes_validate.utils as kv
import pytest
from pod_security import baseline_violations, hardening_violations, restricted_violations

from tokenline.fetch import InvalidURI, cache_name, parse_uri
from tokenline_operator import kube, names
from tokenline_operator.controller import manifests
from tokenline_operator.controller.reconcile import IMAGE_VOLUME_DEFAULT_ON, image_volumes_served
from tokenline_operator.crd import definition as crd
from tokenline_operator.crd import model_uri, spec
from tokenline_operator.objects import Capabilities, Owner
from tokenline_operator.pods import config
from tokenline_operator.status import conditions as status_mod
from tokenline_operator.status import model as model_status

OWNER = Owner(name="chat", namespace="serving", uid="0b9c5a3e-2222-4c1b-9f44-2a4c1d6e7f80")
SECRET_ENV = {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
HF = "hf://Qwen/Qwen3-0.6B@main"
S3 = "s3://models/qwen3-0.6b?endpoint=http://minio.storage:9000&region=us-east-1"
HTTPS = "https://models.example.com/qwen3.tar.gz#sha256=" + "a" * 64
PVC = "pvc://model-store/qwen3-0.6b"
OCI = "oci://ghcr.io/acme/qwen3-0.6b:v1"


def parse(model_spec: dict[str, Any], **extra: Any) -> spec.Spec:
    return spec.parse("chat", {"model": model_spec, **extra}, default_image="tokenline:1")


def pod_of(model_spec: dict[str, Any], image_volumes: bool = False, **extra: Any) -> dict:
    parsed = parse(model_spec, **extra)
    children = manifests.children(OWNER, parsed, Capabilities(image_volume=image_volumes))
    return children["Deployment"]["spec"]["template"]["spec"]


def stages(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod["containers"]}


def inits(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod.get("initContainers", [])}


def volumes(pod: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod["volumes"]}


def model_mounts(container: dict) -> list[dict]:
    return [m for m in container["volumeMounts"] if m["name"] == "models"]


def assert_stages_read_the_model(pod: dict, parsed: spec.Spec, path: str) -> None:
    assert config.config_map_data(parsed)["TOKENLINE_MODEL"] == path
    for container in stages(pod).values():
        mounts = model_mounts(container)
        assert mounts and all(m["readOnly"] is True for m in mounts), container["name"]
        assert path.startswith(mounts[0]["mountPath"])


def assert_no_plain_secret(pod: dict) -> None:
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        for env in container.get("env", []):
            if env["name"] in SECRET_ENV:
                assert "value" not in env and "secretKeyRef" in env["valueFrom"], env


# --- the pod, per scheme --------------------------------------------------------------------


def test_hf_one_fetch_into_an_empty_dir_with_the_token_from_its_secret():
    model_spec = {"uri": HF, "hfTokenSecret": {"name": "hf"}}
    pod = pod_of(model_spec)
    target = f"/models/{cache_name(parse_uri(HF))}"
    (fetch,) = pod["initContainers"]
    assert fetch["name"] == names.FETCH_CONTAINER and fetch["image"] == "tokenline:1"
    assert fetch["args"] == ["fetch", HF, target, "--termination-log", "/dev/termination-log"]
    assert fetch["terminationMessagePolicy"] == "File"
    assert {"name": "models", "mountPath": "/models"} in fetch["volumeMounts"]
    token = next(e for e in fetch["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    assert volumes(pod)["models"] == {"name": "models", "emptyDir": {}}
    assert_stages_read_the_model(pod, parse(model_spec), target)
    # the stages download nothing: no token reaches them
    assert all("HF_TOKEN" not in {e["name"] for e in c["env"]} for c in pod["containers"])
    assert_no_plain_secret(pod)
    assert spec.served_model_name(parse(model_spec)) == "Qwen/Qwen3-0.6B"


def test_s3_credentials_each_from_a_secret_key_and_the_cache_on_a_shared_claim():
    model_spec = {"uri": S3, "s3Secret": {"name": "minio"}, "cache": {"claimName": "cache"}}
    pod = pod_of(model_spec)
    (fetch,) = pod["initContainers"]
    env = {e["name"]: e for e in fetch["env"]}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key]["valueFrom"] == {"secretKeyRef": {"name": "minio", "key": key}}
    assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    # the cache is where the fetch writes, one folder per URI: replicas meet there
    assert volumes(pod)["models"]["persistentVolumeClaim"] == {"claimName": "cache"}
    target = f"/models/{cache_name(parse_uri(S3))}"
    assert fetch["args"][2] == target
    assert_stages_read_the_model(pod, parse(model_spec), target)
    assert_no_plain_secret(pod)
    # the stages' own scratch is no longer the cache
    assert volumes(pod)["model-cache"] == {"name": "model-cache", "emptyDir": {}}
    assert spec.served_model_name(parse(model_spec)) == "qwen3-0.6b"


def test_https_archive_into_a_node_cache():
    model_spec = {"uri": HTTPS, "cache": {"hostPath": "/var/lib/tokenline/models"}}
    pod = pod_of(model_spec)
    (fetch,) = pod["initContainers"]
    assert fetch["args"][1] == HTTPS
    assert volumes(pod)["models"]["hostPath"] == {
        "path": "/var/lib/tokenline/models",
        "type": "DirectoryOrCreate",
    }
    assert_stages_read_the_model(pod, parse(model_spec), fetch["args"][2])
    assert baseline_violations(pod) == ["HostPath volumes: volume models"]
    assert spec.served_model_name(parse(model_spec)) == "qwen3"


def test_pvc_mounted_read_only_and_only_checked():
    pod = pod_of({"uri": PVC})
    (check,) = pod["initContainers"]
    assert check["args"] == ["fetch", PVC, "--termination-log", "/dev/termination-log"]
    assert {"name": "TOKENLINE_PVC_ROOT", "value": "/models"} in check["env"]
    assert model_mounts(check) == [
        {"name": "models", "mountPath": "/models/model-store", "readOnly": True}
    ]
    assert volumes(pod)["models"]["persistentVolumeClaim"] == {
        "claimName": "model-store",
        "readOnly": True,
    }
    assert_stages_read_the_model(pod, parse({"uri": PVC}), "/models/model-store/qwen3-0.6b")


def test_oci_as_an_image_volume_where_the_cluster_has_them():
    pod = pod_of({"uri": OCI}, image_volumes=True)
    assert list(inits(pod)) == [names.FETCH_CONTAINER]
    assert volumes(pod)["models"]["image"] == {
        "reference": "ghcr.io/acme/qwen3-0.6b:v1",
        "pullPolicy": "IfNotPresent",
    }
    check = inits(pod)[names.FETCH_CONTAINER]
    assert {"name": "TOKENLINE_OCI_MOUNT", "value": "/models/models"} in check["env"]
    assert_stages_read_the_model(pod, parse({"uri": OCI}), "/models/models")


def test_oci_copied_out_of_the_image_elsewhere():
    pod = pod_of({"uri": OCI, "cache": {"sizeLimit": "20Gi"}}, image_volumes=False)
    assert list(inits(pod)) == [names.OCI_COPY_CONTAINER, names.FETCH_CONTAINER]
    copy = inits(pod)[names.OCI_COPY_CONTAINER]
    assert copy["image"] == "ghcr.io/acme/qwen3-0.6b:v1"
    assert copy["command"][:2] == ["sh", "-c"] and "mv /target/.partial" in copy["command"][2]
    assert copy["volumeMounts"] == [{"name": "models", "mountPath": "/target"}]
    assert volumes(pod)["models"]["emptyDir"] == {"sizeLimit": "20Gi"}
    assert_stages_read_the_model(pod, parse({"uri": OCI}), "/models/models")


def test_a_directory_in_the_pod_is_checked_in_place():
    pod = pod_of({"uri": "/opt/models/qwen3"})
    (check,) = pod["initContainers"]
    assert check["args"][:2] == ["fetch", "/opt/models/qwen3"]
    assert "models" not in volumes(pod)
    assert config.config_map_data(parse({"uri": "/opt/models/qwen3"}))["TOKENLINE_MODEL"] == (
        "/opt/models/qwen3"
    )


def test_name_works_as_before_without_an_init_container():
    pod = pod_of({"name": "Qwen/Qwen3-0.6B", "hfTokenSecret": {"name": "hf"}})
    assert "initContainers" not in pod and "models" not in volumes(pod)
    assert all("HF_TOKEN" in {e["name"] for e in c["env"]} for c in pod["containers"])


@pytest.mark.parametrize(
    ("uri", "image_volumes"),
    [(HF, False), (S3, False), (HTTPS, False), (PVC, False), (OCI, False), (OCI, True)],
)
def test_every_scheme_keeps_the_pod_hardened_and_valid(uri, image_volumes):
    pod = pod_of({"uri": uri, "hfTokenSecret": {"name": "hf"}}, image_volumes=image_volumes)
    assert hardening_violations(pod) == []
    problems = restricted_violations(pod)
    if image_volumes:  # the image volume source is not on the standard's older list
        problems = [p for p in problems if "models" not in p]
    assert problems == []
    parsed = parse({"uri": uri})
    deployment = manifests.children(OWNER, parsed, Capabilities(image_volume=image_volumes))
    kv.validate(deployment["Deployment"], kv.latest_version(), strict=True)


# --- the CRD's validation -------------------------------------------------------------------

VALID = [
    HF,
    "hf://gpt2",
    "hf://Qwen/Qwen3-0.6B",
    "hf://meta-llama/Llama-3.1-8B-Instruct@refs/pr/1",
    S3,
    "s3://models",
    "s3://models/a/b?path_style=true&anonymous=false",
    HTTPS,
    "http://mirror.models.svc/qwen3.tar.gz",
    "https://bucket.s3.amazonaws.com/m.zip?X-Amz-Signature=abc",
    PVC,
    "pvc://model-store",
    OCI,
    "oci://localhost:5000/qwen:1",
    "oci://registry.example:5000/team/qwen3@sha256:" + "b" * 64,
    "/opt/models/qwen3",
    "file:///opt/models/qwen3",
]
#: (uri, a word of the message): the CRD refuses each, and so does the fetcher.
INVALID = [
    ("Qwen/Qwen3-0.6B", "unknown scheme or relative path"),
    ("tiny", "unknown scheme or relative path"),
    ("gs://bucket/model", "unknown scheme"),
    ("hf://a/b/c", "hf://ORG/NAME"),
    ("hf://Qwen/Qwen3@", "hf://ORG/NAME"),
    ("hf://a--b/c", "'--'"),
    ("s3://My_Bucket/x", "s3://BUCKET/PREFIX"),
    ("s3://models/x?access_key=AKIA", "never the URI"),
    ("s3://user:pw@models/x", "s3://BUCKET/PREFIX"),
    ("pvc://Model_Store/x", "pvc://CLAIM/PATH"),
    ("pvc://store/x?ro=1", "pvc://CLAIM/PATH"),
    ("oci://ghcr.io/acme/qwen3", "tag or digest"),
    ("oci://acme/qwen3:v1", "registry host"),
    ("oci://ghcr.io/Acme/qwen3:v1", "oci://REGISTRY"),
    ("https://user:pw@models.example.com/m.tar.gz", "without user:password"),
    ("https://models.example.com/dir/", "one archive"),
    ("https://models.example.com/m.tar.gz#md5=abc", "#sha256"),
    ("file://relative", "absolute path"),
]
#: What only the fetcher's parser sees: the reconcile reports it (Degraded, ModelReady False).
PARSER_ONLY = [
    "s3://models/a/../b",
    "s3://models/a?endpoint=minio:9000",
    "pvc://store/a/../b",
    "s3://models/a//b",
]


@pytest.mark.parametrize("uri", VALID)
def test_valid_uris_pass_the_crd_and_the_fetcher(uri):
    assert model_uri.crd_rule_violations(uri) == []
    parse_uri(uri)
    parsed = parse({"uri": uri})
    assert parsed["model"]["uri"] == uri


@pytest.mark.parametrize(("uri", "word"), INVALID)
def test_invalid_uris_are_refused_by_the_crd_with_a_clear_message(uri, word):
    messages = model_uri.crd_rule_violations(uri)
    assert messages and any(word in m for m in messages), messages
    with pytest.raises(spec.SpecError, match=re.escape(word)):
        parse({"uri": uri})
    if uri not in ("tiny", "Qwen/Qwen3-0.6B"):  # relative paths: a local use of --model
        with pytest.raises(InvalidURI):
            parse_uri(uri)


@pytest.mark.parametrize("uri", PARSER_ONLY)
def test_what_the_crd_cannot_express_the_reconcile_refuses(uri):
    assert model_uri.crd_rule_violations(uri) == []
    with pytest.raises(spec.SpecError, match=r"spec\.model\.uri: model URI"):
        parse({"uri": uri})


def _unquote_cel(literal: str) -> str:
    assert literal[0] == literal[-1] == "'"
    return literal[1:-1].replace("\\'", "'").replace("\\\\", "\\")


def test_the_crd_carries_the_rules_and_their_regexes_are_the_ones_tested():
    uri = crd.MODEL["properties"]["uri"]
    rules = [(r["rule"], r["message"]) for r in uri["x-kubernetes-validations"]]
    assert rules == list(model_uri.URI_RULES)
    regexes = {
        model_uri.HF_RE,
        model_uri.S3_RE,
        model_uri.PVC_RE,
        model_uri.OCI_RE,
        model_uri.HTTPS_RE,
    }
    found = set()
    for rule, _ in rules:
        for literal in re.findall(r"self\.matches\(('(?:[^'\\]|\\.)*')\)", rule):
            found.add(_unquote_cel(literal))
    assert regexes <= found
    for regex in found:
        re.compile(regex)
        assert "(?" not in regex  # RE2 has no lookaround


@pytest.mark.parametrize(
    ("model_spec", "problem"),
    [
        ({}, "set exactly one of name and uri"),
        ({"name": "tiny", "uri": HF}, "set exactly one of name and uri"),
        ({"uri": "hf://Qwen/Qwen3-0.6B", "revision": "main"}, "pin the revision in it"),
        ({"name": "tiny", "cache": {"hostPath": "/data"}}, "cache.hostPath needs uri"),
        ({"uri": HF, "cache": {"hostPath": "/d", "claimName": "c"}}, "set one of sizeLimit"),
        ({"uri": HF, "cache": {"hostPath": "relative"}}, "spec.model.cache.hostPath"),
    ],
)
def test_model_rules(model_spec, problem):
    with pytest.raises(spec.SpecError, match=re.escape(problem)):
        parse(model_spec)


def test_the_model_rules_are_cel_rules_of_the_crd():
    rules = {r["rule"] for r in crd.MODEL["x-kubernetes-validations"]}
    assert "has(self.name) != has(self.uri)" in rules
    assert "!has(self.uri) || !has(self.revision)" in rules
    assert "name" not in crd.MODEL["required"]


# --- status.model from the init containers --------------------------------------------------


def pod(uri: str, *statuses: dict, deleting: bool = False) -> dict:
    meta: dict[str, Any] = {"name": "chat-1"}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"initContainers": [{"name": names.FETCH_CONTAINER, "args": ["fetch", uri]}]},
        "status": {"initContainerStatuses": list(statuses)},
    }


def fetch_status(state: dict, last: dict | None = None, name: str = names.FETCH_CONTAINER):
    return {"name": name, "state": state, "lastState": last or {}}


READY = {
    "terminated": {
        "exitCode": 0,
        "message": json.dumps(
            {
                "uri": HF,
                "state": "Ready",
                "size": 1234,
                "revision": "abc123",
                "digest": "sha256:" + "c" * 64,
            }
        ),
    }
}
FAILED = {
    "terminated": {
        "exitCode": 1,
        "reason": "Error",
        "message": json.dumps(
            {"state": "Failed", "reason": "Unauthorized", "message": "401: set hfTokenSecret"}
        ),
    }
}


def test_running_is_downloading_for_a_download_and_verifying_in_place():
    running = fetch_status({"running": {"startedAt": "x"}})
    got = model_status.model_status(HF, "q", [pod(HF, running)], None)
    assert got["state"] == "Downloading" and got["uri"] == HF and got["servedName"] == "q"
    assert model_status.model_status(PVC, "q", [pod(PVC, running)], None)["state"] == "Verifying"


def test_exit_zero_is_ready_with_the_termination_message():
    got = model_status.model_status(HF, "q", [pod(HF, fetch_status(READY))], None)
    assert got == {
        "uri": HF,
        "servedName": "q",
        "state": "Ready",
        "size": 1234,
        "revision": "abc123",
        "digest": "sha256:" + "c" * 64,
    }
    ok, reason, message = model_status.condition(got)
    assert (ok, reason) == (True, "Ready") and "abc123" in message


@pytest.mark.parametrize(
    "init",
    [
        fetch_status(FAILED),
        fetch_status({"waiting": {"reason": "CrashLoopBackOff"}}, FAILED),
    ],
    ids=["terminated", "restarting"],
)
def test_a_failed_fetch_is_failed_with_its_reason(init):
    got = model_status.model_status(HF, "q", [pod(HF, init)], None)
    assert (got["state"], got["reason"]) == ("Failed", "Unauthorized")
    assert model_status.condition(got) == (False, "Unauthorized", "401: set hfTokenSecret")


def test_a_missing_secret_or_image_is_failed():
    waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf"'}}
    got = model_status.model_status(HF, "q", [pod(HF, fetch_status(waiting))], None)
    assert (got["state"], got["reason"], got["message"]) == (
        "Failed",
        "CreateContainerConfigError",
        'secret "hf"',
    )
    pull = {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}}
    copy = fetch_status(pull, name=names.OCI_COPY_CONTAINER)
    got = model_status.model_status(OCI, "q", [pod(OCI, copy)], None)
    assert (got["state"], got["reason"]) == ("Failed", "ImagePullBackOff")


def test_an_oci_copy_under_way_is_downloading_then_the_check_decides():
    copying = fetch_status({"running": {}}, name=names.OCI_COPY_CONTAINER)
    waiting = fetch_status({"waiting": {"reason": "PodInitializing"}})
    assert model_status.model_status(OCI, "q", [pod(OCI, copying, waiting)], None)["state"] == (
        "Downloading"
    )
    copied = fetch_status({"terminated": {"exitCode": 0}}, name=names.OCI_COPY_CONTAINER)
    checking = fetch_status({"running": {}})
    assert model_status.model_status(OCI, "q", [pod(OCI, copied, checking)], None)["state"] == (
        "Verifying"
    )


def test_replicas_failure_wins_then_ready_and_other_uris_are_ignored():
    running = fetch_status({"running": {}})
    pods = [pod(HF, running), pod(HF, fetch_status(READY))]
    assert model_status.model_status(HF, "q", pods, None)["state"] == "Ready"
    pods.append(pod(HF, fetch_status(FAILED)))
    assert model_status.model_status(HF, "q", pods, None)["state"] == "Failed"
    others = [pod(S3, fetch_status(FAILED)), pod(HF, fetch_status(FAILED), deleting=True)]
    got = model_status.model_status(HF, "q", others, None)
    assert (got["state"], got["reason"]) == ("Pending", "NoPod")


def test_a_delivered_model_stays_ready_without_pods_or_when_they_cannot_be_read():
    ready = model_status.model_status(HF, "q", [pod(HF, fetch_status(READY))], None)
    assert model_status.model_status(HF, "q", [], ready) == ready
    assert model_status.model_status(HF, "q", None, ready) == ready
    assert model_status.model_status(S3, "q", [], ready)["state"] == "Pending"


def test_the_status_has_model_ready_and_a_failed_model_degrades():
    now = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    failed = model_status.model_status(HF, "q", [pod(HF, fetch_status(FAILED))], None)
    obs = status_mod.Observation(
        generation=1, desired_replicas=1, deployment=None, model=failed, service="chat"
    )
    result = status_mod.compute(obs, None, now)
    conditions = {c["type"]: c for c in result["conditions"]}
    assert conditions["ModelReady"]["status"] == "False"
    assert conditions["ModelReady"]["reason"] == "Unauthorized"
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == (
        "True",
        "ModelFailed",
    )
    assert result["model"]["state"] == "Failed" and result["phase"] == "Degraded"
    # with name: the served name, no ModelReady
    plain = status_mod.Observation(
        generation=1, desired_replicas=1, deployment=None, model={"servedName": "tiny"}
    )
    result = status_mod.compute(plain, None, now)
    assert "ModelReady" not in {c["type"] for c in result["conditions"]}
    assert result["model"] == {"servedName": "tiny"}


def test_the_status_schema_holds_what_the_status_writes():
    import jsonschema

    schema = crd.STATUS
    ready = model_status.model_status(HF, "q", [pod(HF, fetch_status(READY))], None)
    jsonschema.validate({"model": ready}, schema)
    jsonschema.validate({"model": model_status.invalid("gs://x", None, "bad")}, schema)
    columns = {c["name"]: c["jsonPath"] for c in crd.PRINTER_COLUMNS}
    assert columns["Model State"] == ".status.model.state"


# --- image volumes: from the server's version, or the operator's setting ---------------------


class FakeKube:
    def __init__(self, version):
        self.version = version

    async def server_version(self, *, max_age=None):
        return self.version


@pytest.mark.parametrize(
    ("policy", "version", "expected"),
    [
        ("auto", IMAGE_VOLUME_DEFAULT_ON, True),
        ("auto", (1, 34), False),
        ("auto", None, False),  # unknown: the copy works everywhere
        ("on", None, True),
        ("off", (1, 40), False),
    ],
)
async def test_image_volumes_from_the_version_or_the_setting(policy, version, expected):
    assert await image_volumes_served(FakeKube(version), policy) is expected


def test_server_versions_are_read_as_clusters_write_them():
    assert kube._version_of({"major": "1", "minor": "35+"}) == (1, 35)
    assert kube._version_of({"major": "", "minor": "", "gitVersion": "v1.33.2-eks-1"}) == (1, 33)
    assert kube._version_of({}) is None
