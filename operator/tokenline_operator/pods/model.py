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
fetcher uses. The CRD's rules (:data:`tokenline_operator.crd.model_uri.URI_RULES`) reject what
they can express; the reconcile rejects the rest with the parser's message.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

from tokenline.fetch import cache_name, is_remote, parse_uri
from tokenline.fetch.uri import S3URI, HfURI, LocalURI, ModelURI, OciURI, PvcURI

from .. import names
from ..crd.spec import Spec


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
