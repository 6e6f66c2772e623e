"""``spec.model.uri``: how a pod gets its model before any stage starts (issue 26).

One download per pod: an init container from the project's own image runs
``tokenline fetch URI DIR --termination-log /dev/termination-log`` and every stage then reads
the model read-only from ``/models`` (``--model /models/...``, through the ConfigMap). Per
scheme:

- ``hf://``, ``s3://``, ``https://``: fetched into ``/models/<cache_name(uri)>``, on the cache
  (``spec.model.cache``: a PersistentVolumeClaim or a hostPath shared by the replicas, where a
  model already there is not fetched again) or a per-pod emptyDir. Credentials come from
  Secrets through ``valueFrom.secretKeyRef``, never as plain values.
- ``pvc://claim/path``: the claim mounted read-only at ``/models/<claim>``; the init container
  only checks it (and reports its size and digest).
- ``oci://registry/repo:tag``: an image volume where the cluster has them (``volumes[].image``,
  the ImageVolume feature), else an init container from the model image that copies its
  ``/models`` out into an emptyDir; then checked as pvc://.
- a directory inside the pod (``/opt/models/x`` or ``file:///opt/models/x``): checked in place.

Pure functions, no I/O: the URI is parsed with the same ``tokenline.fetch.parse_uri`` the
fetcher uses. The CRD's rules (:data:`URI_RULES`) reject what they can express; the reconcile
rejects the rest with the parser's message.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from tokenline.fetch import InvalidURI, cache_name, is_remote, parse_uri
from tokenline.fetch.uri import S3URI, HfURI, HttpsURI, LocalURI, ModelURI, OciURI, PvcURI

from . import names

Spec = dict[str, Any]  # spec.Spec (not imported: the CRD, which spec reads, imports this)

# --- the CRD's validation -------------------------------------------------------------------
# Each regex is RE2 (CEL's ``matches``) and Python ``re`` at once: no lookaround, no backrefs.

_HF_PART = r"[A-Za-z0-9]([A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
HF_RE = rf"^hf://{_HF_PART}(/{_HF_PART})?/?(@[A-Za-z0-9][A-Za-z0-9._/-]{{0,254}})?$"
_S3_OPTION = r"(endpoint|region|path_style|anonymous)=[^&#]*"
S3_RE = rf"^s3://[a-z0-9][a-z0-9.-]{{1,61}}[a-z0-9](/[^?#]*)?(\?{_S3_OPTION}(&{_S3_OPTION})*)?$"
_DNS1123 = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
PVC_RE = rf"^pvc://{_DNS1123}(/[^?#]*)?$"
_OCI_HOST = (
    r"([A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+(:[0-9]{1,5})?"  # a dotted host
    r"|[A-Za-z0-9-]+:[0-9]{1,5}"  # a host with a port
    r"|localhost(:[0-9]{1,5})?)"
)
_OCI_COMPONENT = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
_OCI_TAG = r":[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_OCI_DIGEST = r"@sha256:[0-9a-f]{64}"
OCI_RE = (
    rf"^oci://{_OCI_HOST}/{_OCI_COMPONENT}(/{_OCI_COMPONENT})*"
    rf"(({_OCI_TAG})({_OCI_DIGEST})?|{_OCI_DIGEST})$"
)
HTTPS_RE = r"^https?://[^/?#@\s]+(/[^/?#\s]*)*/[^/?#\s]+(\?[^#\s]*)?(#sha256=[0-9a-fA-F]{64})?$"
KNOWN_SCHEME_RE = r"^(hf|s3|pvc|oci|https?|file)://"
SCHEMES_HINT = (
    "hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX[?endpoint=URL&region=R&path_style=true], "
    "pvc://CLAIM/PATH, oci://REGISTRY/REPO:TAG, https://HOST/MODEL.tar.gz[#sha256=HEX], or an "
    "absolute directory inside the pod"
)


def _cel(regex: str) -> str:
    """A CEL string literal holding ``regex`` (CEL reads backslash escapes in strings)."""
    return "'" + regex.replace("\\", "\\\\").replace("'", "\\'") + "'"


#: (CEL rule, message) on ``spec.model.uri``, each with the scheme's form and an example.
URI_RULES: tuple[tuple[str, str], ...] = (
    (
        f"!self.contains('://') ? self.startsWith('/') : self.matches({_cel(KNOWN_SCHEME_RE)})",
        f"unknown scheme or relative path; use {SCHEMES_HINT}",
    ),
    (
        f"!self.startsWith('hf://') || self.matches({_cel(HF_RE)})",
        "hf:// URIs are hf://ORG/NAME[@REVISION] (letters, digits, '.', '_', '-'), e.g. "
        "hf://Qwen/Qwen3-0.6B@main",
    ),
    (
        "!self.startsWith('hf://') || !(self.contains('--') || self.contains('..'))",
        "'--' and '..' are not allowed in a Hugging Face repository id",
    ),
    (
        f"!self.startsWith('s3://') || self.matches({_cel(S3_RE)})",
        "s3:// URIs are s3://BUCKET/PREFIX with options endpoint, region, path_style, anonymous "
        "in the query, e.g. s3://models/qwen3?endpoint=http://minio.storage:9000; credentials "
        "come from spec.model.s3Secret, never the URI",
    ),
    (
        f"!self.startsWith('pvc://') || self.matches({_cel(PVC_RE)})",
        "pvc:// URIs are pvc://CLAIM/PATH with a PersistentVolumeClaim name, e.g. "
        "pvc://model-store/qwen3-0.6b",
    ),
    (
        f"!self.startsWith('oci://') || self.matches({_cel(OCI_RE)})",
        "oci:// URIs are oci://REGISTRY/REPOSITORY:TAG (or @sha256:DIGEST) with a registry host "
        "and a tag or digest, e.g. oci://ghcr.io/acme/qwen3-0.6b:v1",
    ),
    (
        "!(self.startsWith('https://') || self.startsWith('http://')) "
        f"|| self.matches({_cel(HTTPS_RE)})",
        "https:// URIs name one archive (.tar, .tar.gz, .tgz, .zip) without user:password, "
        "optionally pinned with #sha256=HEX, e.g. https://models.example.com/qwen3.tar.gz",
    ),
    (
        "!self.startsWith('file://') || self.matches('^file:///.+')",
        "file:// URIs need an absolute path, e.g. file:///opt/models/qwen3",
    ),
)


def uri_schema() -> dict[str, Any]:
    """``spec.model.uri``'s schema: a string, and a CEL rule with a message per scheme."""
    return {
        "type": "string",
        "description": (
            "Where the model comes from: "
            + SCHEMES_HINT
            + ". An init container fetches it once per pod (or checks it, for pvc://, oci:// "
            "and directories) before any stage starts; status.model and the ModelReady "
            "condition report it. Set exactly one of `name` and `uri`."
        ),
        "minLength": 1,
        "maxLength": 2048,
        "x-kubernetes-validations": [
            {"rule": rule, "message": message} for rule, message in URI_RULES
        ],
    }


def crd_rule_violations(uri: str) -> list[str]:
    """The messages of the CRD's rules ``uri`` breaks, evaluated in Python: each rule above is
    a conjunction of ``startsWith``/``contains``/``matches``, read here with the same regexes."""
    problems = []
    has_scheme = "://" in uri
    if (not has_scheme and not uri.startswith("/")) or (
        has_scheme and not re.match(KNOWN_SCHEME_RE, uri)
    ):
        problems.append(URI_RULES[0][1])
    checks = (
        ("hf://", HF_RE, 1),
        ("s3://", S3_RE, 3),
        ("pvc://", PVC_RE, 4),
        ("oci://", OCI_RE, 5),
        ("https://", HTTPS_RE, 6),
        ("http://", HTTPS_RE, 6),
        ("file://", r"^file:///.+", 7),
    )
    for prefix, regex, index in checks:
        if uri.startswith(prefix) and not re.search(regex, uri):
            problems.append(URI_RULES[index][1])
    if uri.startswith("hf://") and ("--" in uri or ".." in uri):
        problems.append(URI_RULES[2][1])
    return problems


def uri_problem(uri: str) -> str | None:
    """What ``tokenline fetch`` would refuse in ``spec.model.uri``, or None: the CRD's rules
    catch most of it, the parser the rest (a '..' segment, an endpoint that is no URL)."""
    try:
        parsed = parse_uri(uri)
    except InvalidURI as exc:
        return str(exc)
    if isinstance(parsed, LocalURI) and not parsed.path.startswith("/"):
        return f"model URI {uri!r}: a directory inside the pod must be an absolute path"
    return None


def uri_problems(uri: str) -> list[str]:
    """Everything refused in a model URI: the CRD's rules it breaks, or else, when it keeps
    them all, what the parser refuses (`uri_problem`)."""
    broken = crd_rule_violations(uri)
    if broken:
        return broken
    refused = uri_problem(uri)
    return [refused] if refused else []


# --- the pod --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    """What the pod gets for ``spec.model.uri``: init containers, volumes, the stages' mounts
    and the directory every stage loads the model from."""

    uri: ModelURI
    model_path: str
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    #: every stage's mounts of the model (read-only)
    stage_mounts: list[dict[str, Any]] = field(default_factory=list)


def uri_of(spec: Spec) -> str | None:
    uri = spec["model"].get("uri")
    return uri.strip() if uri else None


def parsed_uri(spec: Spec) -> ModelURI | None:
    uri = uri_of(spec)
    return parse_uri(uri) if uri else None


def default_served_name(uri: ModelURI) -> str:
    """The name /v1/models lists when ``servedName`` is unset: the Hub id for hf://, else
    the last path component (the archive's name without its extension for https://)."""
    if isinstance(uri, HfURI):
        return uri.repo_id
    if isinstance(uri, S3URI):
        tail = uri.prefix or uri.bucket
    elif isinstance(uri, PvcURI):
        tail = uri.path or uri.claim
    elif isinstance(uri, OciURI):
        tail = uri.repository
    elif isinstance(uri, HttpsURI):
        tail = re.sub(r"(\.tar\.gz|\.tgz|\.tar|\.zip)$", "", uri.url.split("?", 1)[0])
    else:
        tail = uri.path
    return posixpath.basename(tail.rstrip("/")) or tail


def _cache_volume(spec: Spec) -> dict[str, Any]:
    cache = spec["model"].get("cache", {})
    if "claimName" in cache:
        return {"persistentVolumeClaim": {"claimName": cache["claimName"]}}
    if "hostPath" in cache:
        return {"hostPath": {"path": cache["hostPath"], "type": "DirectoryOrCreate"}}
    return {"emptyDir": {"sizeLimit": cache["sizeLimit"]} if "sizeLimit" in cache else {}}


def _secret_env(name: str, secret: str, key: str, optional: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


#: The keys of spec.model.s3Secret, named as the variables they become.
S3_SECRET_KEYS = (
    ("AWS_ACCESS_KEY_ID", False),
    ("AWS_SECRET_ACCESS_KEY", False),
    ("AWS_SESSION_TOKEN", True),  # temporary credentials only
)


def credentials_env(spec: Spec, uri: ModelURI) -> list[dict[str, Any]]:
    """The fetcher's credentials, each from its Secret (never a plain value in the pod spec)."""
    model = spec["model"]
    if isinstance(uri, HfURI) and model.get("hfTokenSecret"):
        secret = model["hfTokenSecret"]
        return [_secret_env("HF_TOKEN", secret["name"], secret["key"])]
    if isinstance(uri, S3URI) and model.get("s3Secret"):
        name = model["s3Secret"]["name"]
        return [_secret_env(key, name, key, optional) for key, optional in S3_SECRET_KEYS]
    return []


#: What the fetch container may use; the download is I/O and hashing, one core at most.
FETCH_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def _fetch_container(
    spec: Spec, uri: str, target: str | None, env: list[dict[str, Any]], mounts: list[dict]
) -> dict[str, Any]:
    args = ["fetch", uri, *([target] if target else [])]
    args += ["--termination-log", "/dev/termination-log"]
    container: dict[str, Any] = {
        "name": names.FETCH_CONTAINER,
        "image": spec["image"],
        "args": args,
        "env": [
            # the fetcher's scratch (a Hub client's cache) on the writable /tmp
            {"name": "HF_HOME", "value": "/tmp/huggingface"},
            *env,
        ],
        "resources": FETCH_RESOURCES,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "securityContext": dict(SECURITY_CONTEXT),
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


#: The copy out of a model image without image volumes: idempotent (a restarted pod keeps its
#: emptyDir), and a cut copy is never taken for a whole one (renamed into place last).
OCI_COPY_SCRIPT = (
    "set -e; [ -d /target/models ] && exit 0; rm -rf /target/.partial; "
    f"cp -R {names.OCI_IMAGE_MODEL_DIR} /target/.partial; mv /target/.partial /target/models"
)


def delivery(spec: Spec, image_volumes: bool) -> Delivery | None:
    """The pod's part of ``spec.model.uri`` (None with ``spec.model.name``).

    ``image_volumes``: the cluster mounts OCI images as volumes (Capabilities.image_volume).
    """
    text = uri_of(spec)
    if text is None:
        return None
    uri = parse_uri(text)
    models = names.MODELS_DIR
    read_only = {"name": "models", "mountPath": models, "readOnly": True}
    if is_remote(uri):
        target = f"{models}/{cache_name(uri)}"
        fetch = _fetch_container(
            spec,
            text,
            target,
            credentials_env(spec, uri),
            [{"name": "models", "mountPath": models}],
        )
        return Delivery(
            uri,
            target,
            [fetch],
            [{"name": "models", **_cache_volume(spec)}],
            [read_only],
        )
    if isinstance(uri, PvcURI):
        mount = {"name": "models", "mountPath": f"{models}/{uri.claim}", "readOnly": True}
        fetch = _fetch_container(
            spec, text, None, [{"name": "TOKENLINE_PVC_ROOT", "value": models}], [mount]
        )
        volume = {
            "name": "models",
            "persistentVolumeClaim": {"claimName": uri.claim, "readOnly": True},
        }
        path = posixpath.join(models, uri.claim, uri.path) if uri.path else f"{models}/{uri.claim}"
        return Delivery(uri, path, [fetch], [volume], [mount])
    if isinstance(uri, OciURI):
        path = f"{models}/models"
        check = _fetch_container(
            spec, text, None, [{"name": "TOKENLINE_OCI_MOUNT", "value": path}], [read_only]
        )
        if image_volumes:
            volume = {
                "name": "models",
                "image": {"reference": uri.reference, "pullPolicy": "IfNotPresent"},
            }
            return Delivery(uri, path, [check], [volume], [read_only])
        sizes = spec["model"].get("cache", {})
        copy = {
            "name": names.OCI_COPY_CONTAINER,
            "image": uri.reference,
            "imagePullPolicy": "IfNotPresent",
            "command": ["sh", "-c", OCI_COPY_SCRIPT],
            "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}},
            "volumeMounts": [{"name": "models", "mountPath": "/target"}],
            "securityContext": dict(SECURITY_CONTEXT),
        }
        volume = {
            "name": "models",
            "emptyDir": {"sizeLimit": sizes["sizeLimit"]} if "sizeLimit" in sizes else {},
        }
        return Delivery(uri, path, [copy, check], [volume], [read_only])
    assert isinstance(uri, LocalURI)
    # a directory of the image (or of a volume every container has): checked where it is
    return Delivery(uri, uri.path, [_fetch_container(spec, text, None, [], [])], [], [])
