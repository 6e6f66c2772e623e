"""``spec.disaggregation`` in the CRD: prefill and decode on pods of their own, in llm-d's
contract; its schema, the CEL rules that refuse what it cannot be combined with, and the same
checks in Python for where no API server ran them.

What the pods make of it (two Deployments, the routing sidecar, the KV side channel):
:mod:`tokenline_operator.pods.disaggregation`; the picker's P/D profiles:
:mod:`tokenline_operator.routing.picker_config`.
"""

from __future__ import annotations

from typing import Any

from .. import names
from .schema import integer, resources, string

#: llm-d's P/D sample configuration's threshold: a prompt whose uncached part is shorter
#: than this is prefilled on the decode pod itself (0 sends every request to a prefill pod).
DEFAULT_NON_CACHED_TOKENS = 16
#: What the sidecar's container asks for by default: a Go reverse proxy.
SIDECAR_REQUESTS = {"cpu": "100m", "memory": "128Mi"}
KV_TRANSFER_FLAG = "--kv-transfer-config"


def _without_default(schema: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in schema.items() if key != "default"}


def _role(which: str, replicas: int) -> dict[str, Any]:
    return {
        "type": "object",
        "description": f"The {which} pods.",
        "default": {},
        "properties": {
            "replicas": integer(f"{which.capitalize()} pods.", default=replicas, minimum=1),
            "tensorParallelSize": integer(
                "GPUs (ranks) of each pod's scheduler; unset: spec.engine.tensorParallelSize. "
                "Each rank lends (prefill) or reads (decode) its own share of the KV heads, so "
                "the two roles may differ; it must divide the model's KV heads.",
                minimum=1,
                maximum=8,
            ),
            "resources": {
                **_without_default(resources("The scheduler container's resources.", {})),
                "description": (
                    "The scheduler container's requests and limits in these pods (the GPUs "
                    "come from tensorParallelSize); unset: spec.resources.scheduler."
                ),
            },
        },
    }


DISAGGREGATION: dict[str, Any] = {
    "type": "object",
    "description": (
        "Prefill and decode on pods of their own, in llm-d's contract: a Deployment "
        "<name>-prefill (pods labelled llm-d.ai/role=prefill, scheduler with kv_role "
        "kv_producer) and <name>-decode (llm-d.ai/role=decode, kv_consumer, with llm-d's "
        "routing sidecar in front of the api), one InferencePool over both, and llm-d's "
        "picker with the disagg-profile-handler and prefix-based-pd-decider. KV blocks move "
        f"over NIXL; the side channel listens on the pod IP, port {names.KV_SIDE_CHANNEL_PORT}. "
        "{} turns it on with the defaults; unset: every pod prefills and decodes."
    ),
    "properties": {
        "prefill": _role("prefill", 1),
        "decode": _role("decode", 1),
        "nonCachedTokens": integer(
            "The prefix-based-pd-decider's threshold: a prompt whose uncached part is at "
            "least this many tokens is prefilled on a prefill pod, a shorter one on the decode "
            "pod itself; 0 sends every request to a prefill pod.",
            default=DEFAULT_NON_CACHED_TOKENS,
            minimum=0,
        ),
        "kvLoadFailurePolicy": string(
            "What a decode pod does when the KV blocks cannot be read (the prefill pod died, "
            "the transfer failed, its lease ran out): recompute prefills locally, fail ends "
            "the request with an error (vLLM's kv_load_failure_policy).",
            enum=["recompute", "fail"],
            default="recompute",
        ),
        "sidecar": {
            "type": "object",
            "description": (
                "llm-d's routing sidecar on each decode pod: it takes the pod's serving port "
                f"({names.API_PORT}), sends the prefill pod the picker chose "
                "(x-prefiller-host-port) the prompt first, then the api "
                f"(port {names.SIDECAR_TARGET_PORT}) the request with the prefill's "
                "kv_transfer_params."
            ),
            "default": {},
            "properties": {
                "image": string(
                    f"The sidecar image (its flags follow {names.LLMD_PD_VERSION}).",
                    default=names.ROUTING_SIDECAR_IMAGE,
                    minLength=1,
                ),
                "args": {
                    "type": "array",
                    "description": (
                        "More flags of the sidecar, after the operator's --port, --vllm-port, "
                        '--kv-connector=nixlv2 and --secure-proxy=false, e.g. ["--enable-'
                        'prefiller-sampling"].'
                    ),
                    "maxItems": 64,
                    "items": {"type": "string", "maxLength": 1024},
                },
                "resources": resources("The sidecar container's resources.", SIDECAR_REQUESTS),
            },
        },
        "pickerImage": string(
            "The picker image (llm-d's inference scheduler: the P/D plugins are its; its "
            f"configuration follows {names.LLMD_PD_VERSION}).",
            default=names.LLMD_PD_PICKER_IMAGE,
            minLength=1,
        ),
    },
}

#: Rules over spec's sections (the API server's; :func:`problems` says the same in Python).
RULES: list[dict[str, str]] = [
    {
        "rule": "!has(self.disaggregation) || self.engine.nodes == 1",
        "message": "disaggregation runs each pod on one node: set engine.nodes to 1",
    },
    {
        "rule": "!has(self.disaggregation) || !has(self.model.runner) || "
        "self.model.runner != 'pooling'",
        "message": "disaggregation splits generation; a pooling model has no decode: unset "
        "disaggregation or model.runner pooling",
    },
    {
        "rule": "!has(self.disaggregation) || !self.autoscaling.enabled",
        "message": "disaggregation sets replicas per role (disaggregation.prefill.replicas, "
        "disaggregation.decode.replicas): set autoscaling.enabled to false",
    },
    {
        "rule": "!has(self.disaggregation) || !has(self.server.tlsSecret)",
        "message": "the routing sidecar speaks plain HTTP to the api: terminate TLS at the "
        "Gateway and unset server.tlsSecret",
    },
    {
        "rule": "!has(self.disaggregation) || self.engine.prefixCaching",
        "message": "a decode pod admits the KV it reads as a cached prefix: set "
        "engine.prefixCaching to true",
    },
]


def tensor_parallel_size(spec: dict[str, Any], role: str) -> int:
    """A role's scheduler ranks: its own tensorParallelSize, else the engine's."""
    own = spec["disaggregation"][role].get("tensorParallelSize")
    return int(own if own is not None else spec["engine"]["tensorParallelSize"])


def schema() -> dict[str, Any]:
    """``spec.disaggregation``: absent by default (absent is off)."""
    return _without_default(DISAGGREGATION)


def enabled(spec: dict[str, Any]) -> bool:
    return spec.get("disaggregation") is not None


def problems(spec: dict[str, Any]) -> list[str]:
    """Why ``spec.disaggregation`` cannot be served with the rest of the spec (none: it can)."""
    if not enabled(spec):
        return []
    found = [
        f"spec: {rule['message']}"
        for rule, broken in zip(
            RULES,
            (
                spec["engine"]["nodes"] != 1,
                spec["model"].get("runner") == "pooling",
                spec["autoscaling"]["enabled"],
                bool(spec["server"].get("tlsSecret")),
                not spec["engine"]["prefixCaching"],
            ),
            strict=True,
        )
        if broken
    ]
    extra = spec["engine"].get("extraArgs") or []
    if any(arg == KV_TRANSFER_FLAG or arg.startswith(KV_TRANSFER_FLAG + "=") for arg in extra):
        found.append(
            f"spec.engine.extraArgs: {KV_TRANSFER_FLAG} is set by the operator with "
            "spec.disaggregation (kv_producer on prefill pods, kv_consumer on decode pods); "
            "remove it from extraArgs"
        )
    return found
