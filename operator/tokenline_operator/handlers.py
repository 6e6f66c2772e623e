"""kopf handlers: thin wrappers that call :mod:`tokenline_operator.controller`.

They live in their own registry (not kopf's global one), so importing this module changes
nothing until an operator is started with ``registry=handlers.registry``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from typing import Any

import kopf

from . import names
from .controller import resync
from .controller.reconcile import Context, reconcile
from .kube import KINDS, Kube, KubeError, load_configuration
from .metrics import OperatorMetrics

registry = kopf.OperatorRegistry()

#: Seconds kopf waits before retrying a reconcile that failed on the API.
RETRY_DELAY = 30
#: Children whose changes (drift, deletion, rollout progress) trigger a reconcile.
WATCHED_CHILDREN = (
    "ConfigMap",
    "Service",
    "Deployment",
    "LeaderWorkerSet",  # spec.engine.nodes > 1
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "ScaledObject",
    "PodMonitor",
    "NetworkPolicy",
    # spec.routing.inferencePool: the picker's identity and the pool
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "InferencePool",
    # spec.model.uri: the fetch init containers' progress is status.model
    "Pod",
)
_MANAGED = {names.LABEL_MANAGED_BY: names.MANAGED_BY}


@kopf.on.login(registry=registry)
async def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials, from the same configuration the reconciler's client loads."""
    configuration = await load_configuration()
    header = configuration.get_api_key_with_prefix("BearerToken")
    if inspect.isawaitable(header):
        header = await header
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


@kopf.on.startup(registry=registry)
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations under our group, none in status: the
    # status schema is structural and would prune it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.GROUP, key="last-handled-configuration"
    )
    # Watch only the operator's own children, server-side: not every ConfigMap in the cluster.
    for kind in WATCHED_CHILDREN:
        ref = KINDS[kind]
        settings.watching.label_selectors[ref.api_version, ref.plural] = (
            f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"
        )
    # Reconnect watches regularly, so a connection dropped without a FIN cannot stall them.
    settings.watching.server_timeout = 600
    settings.watching.client_timeout = 660
    settings.posting.reporting_component = names.MANAGED_BY
    settings.posting.level = logging.WARNING  # Events for problems, not for every success
    metrics = memo.get("metrics") or OperatorMetrics()
    ctx = memo["ctx"] = Context(
        kube=await Kube.connect(),
        metrics=metrics,
        default_image=memo.get("default_image"),
        image_volumes=memo.get("image_volumes", "auto"),
    )
    # CRDs installed or removed later change no InferenceService: a loop of its own notices.
    interval = memo.get("discovery_interval", resync.DEFAULT_INTERVAL)
    if interval:
        memo["resync"] = asyncio.create_task(resync.run(ctx, interval), name="resync")


@kopf.on.cleanup(registry=registry)
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    task: asyncio.Task[None] | None = memo.get("resync")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    ctx: Context | None = memo.get("ctx")
    if ctx is not None:
        await ctx.kube.close()


@kopf.on.probe(id="reconciles", registry=registry)
def probe_reconciles(memo: kopf.Memo, **_: Any) -> float:
    """Shown on the liveness endpoint: reconciles done so far."""
    ctx: Context | None = memo.get("ctx")
    if ctx is None:
        return 0.0
    (family,) = ctx.metrics.reconciles.collect()
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


@kopf.on.resume(names.GROUP, names.VERSION, names.PLURAL, registry=registry)
@kopf.on.create(names.GROUP, names.VERSION, names.PLURAL, registry=registry)
@kopf.on.update(names.GROUP, names.VERSION, names.PLURAL, registry=registry)
async def reconcile_inference_service(
    body: kopf.Body, name: str, namespace: str, reason: kopf.Reason, memo: kopf.Memo, **_: Any
) -> None:
    result = await reconcile(memo["ctx"], namespace, name, trigger=str(reason))
    if result is None:
        return  # deleted meanwhile: the garbage collector takes the children
    if result.spec_error:
        kopf.warn(body, reason="InvalidSpec", message=result.spec_error)
        raise kopf.PermanentError(result.spec_error)  # retrying cannot help; a new spec will
    if result.api_error:
        raise kopf.TemporaryError(result.api_error, delay=RETRY_DELAY)


@kopf.on.event(names.GROUP, names.VERSION, names.PLURAL, id="forget", registry=registry)
def forget_deleted(type: str | None, namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A deleted InferenceService needs no reconcile when the cluster's APIs change."""
    if type == "DELETED":
        memo["ctx"].forget(namespace, name)


async def on_child_event(
    type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """A child changed or vanished: reconcile its owner (restores drift, updates status)."""
    if type is None:
        return  # the initial listing: the owners' resume handlers cover it
    owner = body.get("metadata", {}).get("labels", {}).get(names.LABEL_OWNER)
    namespace = body.get("metadata", {}).get("namespace")
    if not owner or not namespace:
        return
    try:
        await reconcile(memo["ctx"], namespace, owner, trigger=f"child-{type.lower()}")
    except KubeError as exc:
        logger.warning("Reconciling %s/%s after a child event failed: %s", namespace, owner, exc)


for _kind in WATCHED_CHILDREN:
    _ref = KINDS[_kind]
    kopf.on.event(
        _ref.api_version,  # "v1" means the core group to kopf, "apps/v1" a named one
        _ref.plural,
        labels=_MANAGED,
        id=f"child-{_ref.plural}",
        registry=registry,
    )(on_child_event)
