"""Level-based reconciliation: make the children match the spec, then report status.

Every trigger (the InferenceService changed, a child changed or vanished, the operator
restarted, the cluster gained or lost an optional API) runs the same function, which reads
the world, writes only what differs, and writes the status only when it changes. Running it
twice in a row writes nothing the second time, which is what keeps watch events from feeding
back into more writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from .. import names
from ..crd import model_uri, spec
from ..kube import Kube, KubeError
from ..metrics import OperatorMetrics
from ..objects import Capabilities, Owner, owned_by, picker_name, selector_labels
from ..pods import disaggregation, lora, model, parallel
from ..routing import inference_pool
from ..routing.network import service_url
from ..status import conditions
from ..status import model as model_status
from . import manifests, side_channel_keys
from .drift import is_subset, stamped

log = logging.getLogger(__name__)


@dataclass
class Context:
    """What reconciliation needs, passed explicitly (kept in kopf's memo by the handlers)."""

    kube: Kube
    metrics: OperatorMetrics
    default_image: str | None = None
    #: oci:// as image volumes: "auto" (the API server is 1.35 or newer, where ImageVolume is
    #: on by default), "on" or "off" (an init container copies the model out of the image).
    image_volumes: str = "auto"
    _locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = field(
        default_factory=weakref.WeakValueDictionary
    )
    #: The optional APIs each InferenceService's children and status were last made from.
    _reconciled_with: dict[tuple[str, str], Capabilities] = field(default_factory=dict)
    #: InferenceServices told (in the log) that the InferencePool they ask for cannot be
    #: served: each reconcile would say it again, so after the first it is said at debug.
    _told_no_pool: set[tuple[str, str]] = field(default_factory=set)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """One lock per InferenceService: its reconciles never interleave."""
        key = (namespace, name)
        lock = self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock

    def reconciled_without(self, caps: Capabilities) -> list[tuple[str, str]]:
        """The InferenceServices last reconciled when the cluster served other optional APIs."""
        return [key for key, seen in self._reconciled_with.items() if seen != caps]

    def remember(self, namespace: str, name: str, caps: Capabilities | None) -> None:
        """What this InferenceService was reconciled with (None: nothing to redo for them)."""
        if caps is None:
            self.forget(namespace, name)
        else:
            self._reconciled_with[namespace, name] = caps

    def forget(self, namespace: str, name: str) -> None:
        """The InferenceService is gone: nothing to re-reconcile when the APIs change."""
        self._reconciled_with.pop((namespace, name), None)
        self._told_no_pool.discard((namespace, name))

    def first_time_without_pool(self, namespace: str, name: str, without: bool) -> bool:
        """Whether the missing InferencePool is news for this InferenceService; ``without``
        False (served again, or no longer asked for) makes a later absence news again."""
        key = (namespace, name)
        if not without:
            self._told_no_pool.discard(key)
            return False
        news = key not in self._told_no_pool
        self._told_no_pool.add(key)
        return news


@dataclass(frozen=True)
class Result:
    """How a reconcile ended: the status written, and the problem if there was one."""

    status: dict[str, Any]
    spec_error: str | None = None
    api_error: str | None = None


#: The first Kubernetes release with the ImageVolume feature on by default (beta; alpha from
#: 1.31, beta off by default in 1.33 and 1.34). Older servers get the copying init container.
IMAGE_VOLUME_DEFAULT_ON = (1, 35)


async def image_volumes_served(kube: Kube, policy: str = "auto") -> bool:
    """Whether pods may use image volumes: the operator's setting, or the server's version
    (a version that cannot be read means no: the copy works everywhere). The version is
    read once per discovery TTL, not at every look for new CRDs: it changes with upgrades."""
    if policy in ("on", "off"):
        return policy == "on"
    version = await kube.server_version()
    return version is not None and version >= IMAGE_VOLUME_DEFAULT_ON


async def capabilities(
    kube: Kube, *, max_age: float | None = None, image_volumes: str = "auto"
) -> Capabilities:
    """The optional APIs the cluster serves, from discovery at most ``max_age`` seconds old."""
    return Capabilities(
        keda=await kube.serves("ScaledObject", max_age=max_age),
        prometheus_operator=await kube.serves("PodMonitor", max_age=max_age),
        inference_pool=await kube.serves("InferencePool", max_age=max_age),
        image_volume=await image_volumes_served(kube, image_volumes),
    )


async def _ensure(ctx: Context, owner: Owner, desired: dict[str, Any]) -> dict[str, Any]:
    """Create the child, or re-apply it when its body changed or it drifted; return the
    live object."""
    desired = stamped(desired)
    kind, name = desired["kind"], desired["metadata"]["name"]
    live = await ctx.kube.get(kind, owner.namespace, name)
    if live is not None and not owned_by(live, owner):
        raise KubeError(
            409,
            f"{kind} {owner.namespace}/{name} exists and is not owned by "
            f"this InferenceService; rename one of them",
        )
    # The stamp is part of ``desired``: a live object made from another body fails the check.
    if live is not None and is_subset(desired, live):
        return live
    action = "apply" if live is not None else "create"
    log.info("%s %s %s/%s", action, kind, owner.namespace, name)
    ctx.metrics.child_writes.labels(kind=kind, action=action).inc()
    try:
        return await ctx.kube.apply(desired)
    except KubeError as exc:
        if exc.status != 404:
            raise
        # Server-side apply creates missing objects; API servers that do not, get a POST.
        return await ctx.kube.create(desired)


async def _remove(ctx: Context, owner: Owner, kind: str, name: str | None = None) -> None:
    """Delete an optional child the spec no longer asks for (only if it is ours)."""
    name = name or owner.name
    if not await ctx.kube.serves(kind):
        return
    live = await ctx.kube.get(kind, owner.namespace, name)
    if live is not None and owned_by(live, owner):
        log.info("delete %s %s/%s", kind, owner.namespace, name)
        ctx.metrics.child_writes.labels(kind=kind, action="delete").inc()
        await ctx.kube.delete(kind, owner.namespace, name)


async def _apply_routing(
    ctx: Context, owner: Owner, parsed: spec.Spec, caps: Capabilities
) -> conditions.Routing:
    """The InferencePool and its picker when routing is on; none of them when it is off."""
    wanted = inference_pool.routing_enabled(parsed, caps)
    if wanted and caps.inference_pool:
        ctx.first_time_without_pool(owner.namespace, owner.name, False)
        live = {}
        for desired in inference_pool.children(owner, parsed):
            live[desired["kind"]] = await _ensure(ctx, owner, desired)
        if "NetworkPolicy" not in live:
            await _remove(ctx, owner, "NetworkPolicy", picker_name(owner))
        return conditions.Routing(
            wanted=True, served=True, pool=owner.name, picker=live["Deployment"]
        )
    for kind in reversed(inference_pool.KINDS):
        await _remove(ctx, owner, kind, inference_pool.child_name(owner, kind))
    # Asked for but not served is a state of the cluster, not a failed reconcile: retrying
    # cannot fix it (kopf would log an error at every retry), the status says it, and the
    # discovery loop (resync.py) reconciles again once the CRD is installed.
    news = ctx.first_time_without_pool(owner.namespace, owner.name, wanted)
    if wanted:
        log.log(
            logging.WARNING if news else logging.DEBUG,
            "%s/%s asks for an InferencePool but the cluster does not serve %s: it is served "
            "through its plain Service until the CRD is installed (see its Degraded condition)",
            owner.namespace,
            owner.name,
            names.INFERENCE_POOL_CRD,
        )
        return conditions.Routing(wanted=True, served=False, pool=None)
    return conditions.Routing(wanted=False, served=caps.inference_pool, pool=None)


async def _apply_children(
    ctx: Context, owner: Owner, parsed: spec.Spec, caps: Capabilities
) -> tuple[dict[str, Any], conditions.Routing]:
    desired = manifests.children(owner, parsed, caps)
    missing = [k for k in desired if k in manifests.OPTIONAL_KINDS and not await ctx.kube.serves(k)]
    if missing:
        raise KubeError(
            404,
            f"the cluster does not serve {', '.join(missing)}: install its "
            f"CRDs or change spec.autoscaling.provider",
        )
    live: dict[str, Any] = {}
    await side_channel_keys.ensure(ctx.kube, ctx.metrics, owner, disaggregation.enabled(parsed))
    # The ConfigMaps first: the Deployment's containers read their settings from them.
    first = ("ConfigMap", manifests.LORA_CONFIG_MAP)
    for kind in (*[k for k in first if k in desired], *[k for k in desired if k not in first]):
        live[kind] = await _ensure(ctx, owner, desired[kind])
    for kind in manifests.OPTIONAL_KINDS:
        if kind not in desired:
            await _remove(ctx, owner, kind)
    if manifests.LORA_CONFIG_MAP not in desired:
        await _remove(ctx, owner, "ConfigMap", lora.config_map_name(owner))
    if "Deployment" not in desired:  # a LeaderWorkerSet, or prefill and decode Deployments
        await _remove(ctx, owner, "Deployment")
    for role, key in disaggregation.DEPLOYMENT_KEYS.items():
        if key not in desired:
            await _remove(ctx, owner, "Deployment", disaggregation.deployment_name(owner, role))
    workload = (
        live.get("Deployment")
        or parallel.as_deployment(live.get("LeaderWorkerSet"))
        or disaggregation.as_deployment(*(live.get(k) for k in manifests.ROLE_DEPLOYMENTS))
    )
    return workload, await _apply_routing(ctx, owner, parsed, caps)


async def reconcile(ctx: Context, namespace: str, name: str, *, trigger: str) -> Result | None:
    """Bring one InferenceService's children and status in line with its spec.

    The object is read afresh under its lock, whatever triggered the call: a handler's
    copy may already be stale (another reconcile just wrote the status), and writing from
    a stale copy would undo newer work. Returns None when the object is gone or going.
    """
    async with ctx.lock(namespace, name):
        body = await ctx.kube.get(names.KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            ctx.forget(namespace, name)
            return None
        return await _reconcile_locked(ctx, body, trigger=trigger)


async def _reconcile_locked(ctx: Context, body: dict[str, Any], *, trigger: str) -> Result:
    started = time.monotonic()
    owner = Owner.from_body(body)
    generation = body["metadata"].get("generation")
    previous = body.get("status") or {}
    spec_error = api_error = None
    deployment = None
    routing: conditions.Routing | None = None
    caps: Capabilities | None = None
    obs_extra: dict[str, Any] = {}
    try:
        parsed = spec.parse(owner.name, body.get("spec"), default_image=ctx.default_image)
    except spec.SpecError as exc:
        spec_error = str(exc)
        parsed = None
    if parsed is not None:
        obs_extra = {
            "desired_replicas": spec.desired_replicas(parsed),
            "url": service_url(owner, parsed),
            "selector": ",".join(f"{k}={v}" for k, v in selector_labels(owner.name).items()),
        }
        try:
            caps = await capabilities(ctx.kube, image_volumes=ctx.image_volumes)
            deployment, routing = await _apply_children(ctx, owner, parsed, caps)
        except KubeError as exc:
            api_error = str(exc)
            deployment = await _read_deployment(ctx, owner)
            if caps is None:  # discovery itself failed
                caps = await _capabilities_or_none(ctx)
            routing = conditions.Routing(
                wanted=inference_pool.routing_enabled(parsed, caps), served=caps.inference_pool
            )
        obs_extra["model"] = await _model_status(ctx, owner, parsed, previous.get("model"))
    else:
        obs_extra["model"] = _invalid_model(body.get("spec"))

    observation = conditions.Observation(
        generation=generation,
        desired_replicas=obs_extra.pop("desired_replicas", None),
        deployment=deployment,
        routing=routing,
        service=owner.name,
        spec_error=spec_error,
        reconcile_error=api_error,
        **obs_extra,
    )
    new_status = conditions.compute(observation, previous)
    if conditions.differs(previous, new_status):
        await ctx.kube.patch_status(
            names.KIND, owner.namespace, owner.name, _merge_patch(previous, new_status)
        )
    # Only once the status says what these APIs made of it (a failed write is retried by
    # kopf). An invalid spec waits for a new spec, whatever the cluster serves.
    ctx.remember(owner.namespace, owner.name, caps)

    result_label = "invalid_spec" if spec_error else "error" if api_error else "ok"
    ctx.metrics.reconciles.labels(trigger=trigger, result=result_label).inc()
    if spec_error:
        ctx.metrics.errors.labels(reason="invalid_spec").inc()
    elif api_error:
        ctx.metrics.errors.labels(reason="api").inc()
    ctx.metrics.duration.observe(time.monotonic() - started)
    return Result(status=new_status, spec_error=spec_error, api_error=api_error)


def _merge_patch(previous: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The status as a merge patch: status.model's keys that went away (a Failed model's
    reason, once Ready) are removed, not left as they were."""
    patch = dict(desired)
    old, new = previous.get("model"), desired.get("model")
    if isinstance(old, dict) and isinstance(new, dict):
        patch["model"] = {**{key: None for key in old if key not in new}, **new}
    return patch


async def _model_status(
    ctx: Context, owner: Owner, parsed: spec.Spec, previous: Any
) -> dict[str, Any]:
    """``status.model``: the served name and, with a uri, the pods' fetch containers' word."""
    served = spec.served_model_name(parsed)
    uri = model.uri_of(parsed)
    if uri is None:
        return {"servedName": served}
    try:
        pods = await ctx.kube.list("Pod", owner.namespace, selector_labels(owner.name))
    except KubeError as exc:
        log.warning("Reading the pods of %s/%s failed: %s", owner.namespace, owner.name, exc)
        pods = None  # the previous state stands
    return model_status.model_status(uri, served, pods, previous)


def _invalid_model(raw_spec: Any) -> dict[str, Any] | None:
    """``status.model`` (Failed, InvalidURI) when it is the uri that makes the spec invalid."""
    raw = raw_spec.get("model") if isinstance(raw_spec, dict) else None
    uri = raw.get("uri") if isinstance(raw, dict) else None
    if not isinstance(uri, str) or not uri.strip():
        return None
    problems = model_uri.uri_problems(uri.strip())
    if not problems:
        return None
    problem = "; ".join(problems)
    served = raw.get("servedName") if isinstance(raw.get("servedName"), str) else None
    return model_status.invalid(uri.strip(), served, problem)


async def _capabilities_or_none(ctx: Context) -> Capabilities:
    try:
        return await capabilities(ctx.kube, image_volumes=ctx.image_volumes)
    except KubeError:
        return Capabilities()


async def _read_deployment(ctx: Context, owner: Owner) -> dict[str, Any] | None:
    try:
        found = await ctx.kube.get("Deployment", owner.namespace, owner.name)
        if found is None:  # spec.disaggregation's two, if any
            role_names = [disaggregation.deployment_name(owner, r) for r in ("prefill", "decode")]
            roles = [await ctx.kube.get("Deployment", owner.namespace, n) for n in role_names]
            found = disaggregation.as_deployment(*roles)
        if found is None and await ctx.kube.serves("LeaderWorkerSet"):
            lws = await ctx.kube.get("LeaderWorkerSet", owner.namespace, owner.name)
            return parallel.as_deployment(lws)
        return found
    except KubeError:
        return None
