"""Every child an InferenceService asks for, from the builders of each part:
:mod:`~tokenline_operator.pods.config` (ConfigMap), :mod:`~tokenline_operator.pods.deployment`
(Deployment), :mod:`~tokenline_operator.routing.network` (Service, NetworkPolicy),
:mod:`~tokenline_operator.pods.scaling` (autoscaler, PodDisruptionBudget),
:mod:`~tokenline_operator.pods.monitoring` (PodMonitor); the InferencePool and its picker are
:mod:`~tokenline_operator.routing.inference_pool`'s, applied on their own.
"""

from __future__ import annotations

from ..crd import spec as spec_module
from ..crd.spec import Spec
from ..objects import Capabilities, Manifest, Owner
from ..pods import disaggregation, lora
from ..pods.config import config_map
from ..pods.deployment import deployment
from ..pods.monitoring import pod_monitor
from ..pods.parallel import leader_worker_set, multi_node
from ..pods.scaling import (
    autoscaler_kind,
    horizontal_pod_autoscaler,
    pod_disruption_budget,
    scaled_object,
    wants_disruption_budget,
)
from ..routing.inference_pool import routing_enabled
from ..routing.network import network_policy, service

# --- the whole set ------------------------------------------------------------------------

#: The key of spec.model.lora's ConfigMap (``<name>-lora``) among `children`: a second
#: ConfigMap, applied before the Deployment and deleted when LoRA is turned off.
LORA_CONFIG_MAP = "LoraConfigMap"

#: The keys of spec.disaggregation's two Deployments (``<name>-prefill``, ``<name>-decode``)
#: among `children`, in place of the one Deployment; deleted when it is turned off.
ROLE_DEPLOYMENTS = tuple(disaggregation.DEPLOYMENT_KEYS.values())

#: Kinds that exist only in some configurations; the reconciler deletes them when unwanted.
OPTIONAL_KINDS = (
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "ScaledObject",
    "PodMonitor",
    "NetworkPolicy",
    "LeaderWorkerSet",  # spec.engine.nodes > 1, in place of the Deployment
)


def children(owner: Owner, spec: Spec, caps: Capabilities) -> dict[str, Manifest]:
    """Every child the spec asks for, by kind (one object per kind, but for the LoRA
    adapters' ConfigMap under :data:`LORA_CONFIG_MAP` and the prefill and decode Deployments
    under :data:`ROLE_DEPLOYMENTS`), in the order they are applied."""
    autoscaler = autoscaler_kind(spec, caps)
    routing = routing_enabled(spec, caps)
    result: dict[str, Manifest] = {"ConfigMap": config_map(owner, spec)}
    if lora.enabled(spec):
        result[LORA_CONFIG_MAP] = lora.config_map(owner, spec, caps.image_volume)
    result |= {
        "Deployment": deployment(
            owner,
            spec,
            manage_replicas=autoscaler is None,
            routing=routing,
            image_volumes=caps.image_volume,
        ),
        "Service": service(owner, spec),
    }
    if multi_node(spec):  # one LeaderWorkerSet group of pods per replica
        result["LeaderWorkerSet"] = leader_worker_set(owner, spec, result.pop("Deployment"))
    if disaggregation.enabled(spec):  # prefill and decode pods in place of the one kind
        del result["Deployment"]
        result |= disaggregation.deployments(
            owner, spec, routing=routing, image_volumes=caps.image_volume
        )
    # with spec.disaggregation, one budget over both roles' pods: evictions one pod at a time
    pods = {**spec, "replicas": spec_module.desired_replicas(spec)}
    if wants_disruption_budget(pods):
        result["PodDisruptionBudget"] = pod_disruption_budget(owner, spec)
    if autoscaler == "ScaledObject":
        result["ScaledObject"] = scaled_object(owner, spec)
    elif autoscaler == "HorizontalPodAutoscaler":
        result["HorizontalPodAutoscaler"] = horizontal_pod_autoscaler(owner, spec)
    if spec["monitoring"]["podMonitor"] and caps.prometheus_operator:
        result["PodMonitor"] = pod_monitor(owner, spec)
    if spec["networkPolicy"]["enabled"]:
        result["NetworkPolicy"] = network_policy(owner, spec, routing)
    return result
