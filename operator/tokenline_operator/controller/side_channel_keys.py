"""The KV side channel's Secret (pods/side_channel_keys.py), which reconcile creates once and
never re-applies: unlike the other children it is not made from the spec, and a certificate
made anew would part the pods that already read the old one."""

from __future__ import annotations

import logging

from ..kube import Kube, KubeError
from ..metrics import OperatorMetrics
from ..objects import Owner, owned_by
from ..pods import side_channel_keys

log = logging.getLogger(__name__)


async def ensure(kube: Kube, metrics: OperatorMetrics, owner: Owner, wanted: bool) -> None:
    """The service's Secret exists while its spec asks for prefill and decode pods, and not
    after; one of that name the service does not own is never touched."""
    name = side_channel_keys.secret_name(owner)
    live = await kube.get("Secret", owner.namespace, name)
    if live is not None and not owned_by(live, owner):
        if not wanted:
            return
        raise KubeError(
            409,
            f"Secret {owner.namespace}/{name} exists and is not owned by this "
            "InferenceService; rename one of them (it holds the KV side channel's keys)",
        )
    if wanted and live is None:
        log.info("create Secret %s/%s (the KV side channel's keys)", owner.namespace, name)
        metrics.child_writes.labels(kind="Secret", action="create").inc()
        await kube.create(side_channel_keys.new_secret(owner))
    elif not wanted and live is not None:
        log.info("delete Secret %s/%s", owner.namespace, name)
        metrics.child_writes.labels(kind="Secret", action="delete").inc()
        await kube.delete("Secret", owner.namespace, name)
