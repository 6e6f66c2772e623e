"""Reconcile again the InferenceServices whose cluster gained or lost an optional API.

Which children an InferenceService gets depends on the CRDs the cluster serves: the
InferencePool (routing), KEDA's ScaledObject, the Prometheus operator's PodMonitor. Installing
or removing one changes no InferenceService, so no watch event would bring them up to date.
One loop per operator re-reads API discovery every ``interval`` seconds, one request per
optional API group however many InferenceServices there are, and reconciles those last
reconciled under other capabilities.
"""

from __future__ import annotations

import asyncio
import logging

from ..kube import KubeError
from .reconcile import Context, capabilities, reconcile

log = logging.getLogger(__name__)

#: Seconds between two looks at API discovery: how long a CRD installed (or removed) after
#: an InferenceService may go unnoticed by it.
DEFAULT_INTERVAL = 30.0
TRIGGER = "capabilities"


async def resync_once(ctx: Context) -> list[tuple[str, str]]:
    """Re-read discovery now; reconcile whoever was reconciled under other capabilities."""
    caps = await capabilities(ctx.kube, max_age=0, image_volumes=ctx.image_volumes)
    stale = ctx.reconciled_without(caps)
    for namespace, name in stale:
        log.info(
            "Reconciling %s/%s: the cluster's optional APIs changed: %s", namespace, name, caps
        )
        try:
            await reconcile(ctx, namespace, name, trigger=TRIGGER)
        except KubeError as exc:  # the next look tries again: it is still stale
            log.warning("Reconciling %s/%s for new capabilities failed: %s", namespace, name, exc)
    return stale


async def run(ctx: Context, interval: float) -> None:
    """Look every ``interval`` seconds until cancelled; no failure stops the loop."""
    while True:
        await asyncio.sleep(interval)
        try:
            await resync_once(ctx)
        except KubeError as exc:
            log.warning("Re-reading API discovery failed (next try in %gs): %s", interval, exc)
        except Exception:  # a bug here must not silently end every later resync
            log.exception("Resync of capabilities failed (next try in %gs)", interval)
