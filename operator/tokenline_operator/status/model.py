"""``status.model`` and the ``ModelReady`` condition, from the pods' fetch init containers.

Pure functions: the pods (as the API server returns them) in, the status out. Each pod's
``fetch`` init container (and ``oci-copy`` before it, where an image is copied out) says where
its model is: running means Downloading (Verifying for a model read in place), terminated
with exit 0 means Ready with the termination message's JSON (revision, digest, size), a
non-zero exit or a container that cannot start (a missing Secret, an image that cannot be
pulled) means Failed with its reason and message. Across the replicas, a failure wins, then
a model delivered, then one on its way.
"""

from __future__ import annotations

import json
from typing import Any

from tokenline.fetch import is_remote, parse_uri, redact

from .. import names

#: Waiting reasons that will not resolve on their own: the model cannot be delivered.
STUCK = {
    "CreateContainerConfigError",  # a Secret or key that does not exist
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CrashLoopBackOff",
}
#: Order of precedence across replicas (first wins).
PRECEDENCE = ("Failed", "Ready", "Downloading", "Verifying", "Pending")


def _termination(terminated: dict[str, Any]) -> dict[str, Any]:
    try:
        body = json.loads(terminated.get("message") or "")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _fetch_args_uri(pod: dict[str, Any]) -> str | None:
    for container in pod.get("spec", {}).get("initContainers") or []:
        if container.get("name") == names.FETCH_CONTAINER:
            args = container.get("args") or []
            return args[1] if len(args) > 1 else None
    return None


def _failed(reason: str, message: str) -> dict[str, Any]:
    return {"state": "Failed", "reason": reason, "message": message[:1000]}


def container_state(status: dict[str, Any], remote: bool) -> dict[str, Any]:
    """One init container's status as the model's state (with what its message says)."""
    state = status.get("state") or {}
    last = (status.get("lastState") or {}).get("terminated")
    name = status.get("name", names.FETCH_CONTAINER)
    if "terminated" in state:
        done = state["terminated"]
        body = _termination(done)
        if done.get("exitCode") == 0:
            return {**body, "state": "Ready"} if name == names.FETCH_CONTAINER else {}
        return _failed(
            body.get("reason") or done.get("reason") or "Error",
            body.get("message")
            or done.get("message")
            or f"{name} exited with status {done.get('exitCode')}",
        )
    if "running" in state:
        if name == names.OCI_COPY_CONTAINER or remote:
            return {"state": "Downloading"}
        return {"state": "Verifying"}
    waiting = state.get("waiting") or {}
    if last and last.get("exitCode", 0) != 0:
        # restarted after a failure: the last run's reason is the model's
        body = _termination(last)
        return _failed(
            body.get("reason") or last.get("reason") or "Error",
            body.get("message") or last.get("message") or f"{name} failed",
        )
    if waiting.get("reason") in STUCK:
        return _failed(waiting["reason"], waiting.get("message") or f"{name} cannot start")
    return {"state": "Pending"}


def pod_state(pod: dict[str, Any], remote: bool) -> dict[str, Any]:
    """The model's state in one pod: the first init container that is not done decides."""
    statuses = {
        s.get("name"): s for s in (pod.get("status", {}).get("initContainerStatuses") or [])
    }
    for name in (names.OCI_COPY_CONTAINER, names.FETCH_CONTAINER):
        if name not in statuses:
            continue
        found = container_state(statuses[name], remote)
        if found:  # an oci-copy that finished says nothing: the check after it decides
            return found
    return {"state": "Pending"}


def model_status(
    uri: str,
    served_name: str,
    pods: list[dict[str, Any]] | None,
    previous: dict[str, Any] | None,
) -> dict[str, Any]:
    """``status.model`` for ``spec.model.uri``; ``pods`` None when they could not be read
    (the previous state of the same URI is kept)."""
    shown = parse_uri(uri).redacted()
    base = {"uri": shown, "servedName": served_name}
    previous = previous if isinstance(previous, dict) else {}
    same = previous.get("uri") == shown
    if pods is None:
        kept = {k: v for k, v in previous.items() if k not in base} if same else {}
        return {**base, **(kept or {"state": "Pending"})}
    remote = is_remote(parse_uri(uri))
    mine = [
        p
        for p in pods
        if not p.get("metadata", {}).get("deletionTimestamp") and _fetch_args_uri(p) == uri
    ]
    states = [pod_state(p, remote) for p in mine]
    if not states:
        if same and previous.get("state") == "Ready":
            # scaled to zero, or between pods: what was delivered still holds
            return {**base, **{k: v for k, v in previous.items() if k not in base}}
        return {
            **base,
            "state": "Pending",
            "reason": "NoPod",
            "message": "Waiting for a pod to fetch the model.",
        }
    best = min(states, key=lambda s: PRECEDENCE.index(s["state"]))
    body = {**base, **{k: v for k, v in best.items() if k in FIELDS}}
    if best["state"] == "Downloading":
        body["message"] = (
            f"{sum(s['state'] == 'Downloading' for s in states)} of {len(states)} pods "
            "downloading; progress is in the fetch container's log"
        )
    return body


#: What status.model may hold from a termination message (nothing else is copied).
FIELDS = ("state", "revision", "digest", "size", "reason", "message")


def invalid(uri: str, served_name: str | None, message: str) -> dict[str, Any]:
    """``status.model`` for a URI that cannot work as written."""
    body = {
        "uri": redact(uri) if uri.startswith(("http://", "https://")) else uri,
        "state": "Failed",
        "reason": "InvalidURI",
        "message": message[:1000],
    }
    if served_name:
        body["servedName"] = served_name
    return body


def condition(model: dict[str, Any]) -> tuple[bool, str, str]:
    """The ModelReady condition as (status, reason, message)."""
    state = model.get("state", "Pending")
    if state == "Ready":
        details = [f"{model.get('size', 0)} bytes"]
        for key in ("revision", "digest"):
            if model.get(key):
                details.append(f"{key} {model[key]}")
        return True, "Ready", f"{model['uri']} is delivered ({', '.join(details)})."
    if state == "Failed":
        return False, model.get("reason") or "Failed", model.get("message") or "Fetch failed."
    messages = {
        "Downloading": "The model is being downloaded.",
        "Verifying": "The model is being checked where it lies.",
        "Pending": "Waiting for a pod to fetch the model.",
    }
    return False, state, model.get("message") or messages.get(state, state)
