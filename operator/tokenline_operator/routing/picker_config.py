"""The endpoint picker's configuration (its EndpointPickerConfig): the metrics it scrapes on
each pod's api port under our names, and how it scores pods: queue depth, KV cache use and
prefix affinity, the prefix scorer either the upstream approximate one or, with
``spec.router.kvEvents`` and sha256_cbor block names, llm-d's precise-prefix-cache-scorer fed
by the pods' KV-cache events (see :mod:`tokenline_operator.pods.router`).

Two more shapes: with ``spec.disaggregation`` llm-d's P/D profiles (a decode pod always, a
prefill pod when the prompt's uncached part is long enough), and with ``spec.model.runner:
pooling`` a picker that reads no request body, so /rerank and /score, which the OpenAI parser
does not know, are routed as well as /v1/embeddings (:func:`pooling_picker_config`).
:mod:`inference_pool` mounts it into the picker.
"""

from __future__ import annotations

from typing import Any

from tokenline.settings import BY_FLAG

from .. import names
from ..crd import disaggregation
from ..crd.spec import Spec, tls_enabled
from ..pods import lora, router

#: The name our metric mapping is registered under in the picker's ``engineConfigs`` (and
#: the default for every pod).
METRICS_MAPPING_NAME = "tokenline"
#: The scheduler's default block size: the prefix scorer's fallback until it reads the
#: cache configuration (``autoTune``) from the pods' metrics.
DEFAULT_BLOCK_SIZE_TOKENS: int = BY_FLAG["block-size"].default
#: The metric the picker reads each pod's adapters from (the core metrics extractor's
#: ``loraSpec``), under vLLM's name, which the pods export as vLLM does.
LORA_METRIC = "vllm:lora_requests_info"
LORA_SCORER = "lora-affinity-scorer"
#: Its weight beside queue 2, KV cache 2 and prefix 3: a pod that has the adapter resident
#: (or a free slot) is preferred, as much as a short queue.
LORA_SCORER_WEIGHT = 2


def _metrics_plugins(spec: Spec) -> list[dict[str, Any]]:
    """What the picker scrapes on each pod's api port, under our metric names."""
    mapping = {"name": METRICS_MAPPING_NAME, **names.ENDPOINT_METRICS, **names.CACHE_INFO_LABELS}
    # vLLM's info gauge (labels running_lora_adapters, waiting_lora_adapters, max_lora), which
    # the lora-affinity-scorer reads; without spec.model.lora the pods serve no adapters
    mapping["loraSpec"] = LORA_METRIC if lora.enabled(spec) else ""
    return [
        {
            "type": "metrics-data-source",
            "parameters": {
                "scheme": "https" if tls_enabled(spec) else "http",
                "path": "/metrics",
                # pod IPs, which no certificate names: encrypted, unverified
                "insecureSkipVerify": True,
            },
        },
        {
            "type": "core-metrics-extractor",
            "parameters": {"defaultEngine": METRICS_MAPPING_NAME, "engineConfigs": [mapping]},
        },
    ]


#: Where llm-d's picker keeps the tokenizers it downloads (its /tmp is an emptyDir).
TOKENIZERS_DIR = "/tmp/tokenizers"
PRECISE_SCORER = "precise-prefix-cache-scorer"


def precise_prefix_cache_scorer(spec: Spec) -> dict[str, Any]:
    """llm-d's precise-prefix-cache-scorer: it subscribes to every pod's KV-cache events
    (pod discovery: ``tcp://<pod IP>:5557``, topics ``kv@...``), hashes each prompt as the
    pods name their blocks (vLLM's sha256_cbor with the pods' block size and PYTHONHASHSEED)
    and scores each pod by the longest prefix it holds."""
    return {
        "type": PRECISE_SCORER,
        "parameters": {
            "tokenProcessorConfig": {
                "blockSize": router.BLOCK_SIZE,
                "hashSeed": router.hash_seed(spec),
            },
            "indexerConfig": {
                "tokenizersPoolConfig": {
                    "modelName": router.tokenizer_model(spec),
                    "hf": {"tokenizersCacheDir": TOKENIZERS_DIR},
                },
            },
            "kvEventsConfig": {
                "topicFilter": names.KV_EVENTS_TOPIC_PREFIX,
                "concurrency": 4,
                "discoverPods": True,
                "podDiscoveryConfig": {"socketPort": names.KV_EVENTS_PORT},
            },
        },
    }


def _approximate_prefix_scorer() -> dict[str, Any]:
    """The upstream prefix-cache-scorer, which reads the picker's own routing history."""
    return {
        "type": "prefix-cache-scorer",
        "parameters": {"autoTune": True, "blockSizeTokens": DEFAULT_BLOCK_SIZE_TOKENS},
    }


def _weighted_scorers(spec: Spec, prefix: str) -> list[dict[str, Any]]:
    """A generating pool's scorers and their weights, the upstream chart's and llm-d's guide's:
    queue 2, KV cache use 2, prefix (``prefix``, approximate or precise) 3; with
    ``spec.model.lora`` LoRA affinity too (pods with the request's adapter resident first,
    then pods with a free adapter slot; it reads loraSpec's metric)."""
    refs = [
        {"pluginRef": "queue-scorer", "weight": 2},
        {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
        {"pluginRef": prefix, "weight": 3},
    ]
    if lora.enabled(spec):
        refs.append({"pluginRef": LORA_SCORER, "weight": LORA_SCORER_WEIGHT})
    return refs


def pooling(spec: Spec) -> bool:
    """Whether the pods pool (spec.model.runner: pooling); auto is read as generation, since
    only the checkpoint, inside the pods, says which it is."""
    return spec["model"].get("runner") == "pooling"


#: The upstream parser that reads no body: the OpenAI parser refuses /rerank and /score
#: (it reads any unknown path as /v1/completions, which needs a prompt).
PASSTHROUGH_PARSER = "passthrough-parser"


def pooling_picker_config(spec: Spec) -> dict[str, Any]:
    """A pooling pool's picker: queue depth and KV cache use only. No prefix scorer (it
    hashes the parsed prompt, which a body-blind parser does not give it), no LoRA affinity
    (it reads the parsed model name); pooling requests are short-lived prefills, which queue
    depth balances well."""
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": PASSTHROUGH_PARSER},
            *_metrics_plugins(spec),
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                ],
            }
        ],
        "parser": {"pluginRef": PASSTHROUGH_PARSER},
    }


#: llm-d's P/D plugins (llm-d-inference-scheduler names.LLMD_PD_VERSION).
PD_HEADERS_HANDLER = "disagg-headers-handler"
PD_PROFILE_HANDLER = "disagg-profile-handler"
PD_DECIDER = "prefix-based-pd-decider"
PD_FILTERS = {"prefill": "prefill-filter", "decode": "decode-filter"}


def pd_picker_config(spec: Spec) -> dict[str, Any]:
    """llm-d's P/D configuration: the profile handler runs the decode profile (decode-filter:
    pods labelled llm-d.ai/role=decode), then asks the decider whether the prompt's uncached
    part on that pod reaches ``nonCachedTokens``; if so the prefill profile (prefill-filter)
    picks a prefill pod, which the headers handler names in ``x-prefiller-host-port`` for
    the decode pod's sidecar. The decider reads the approximate prefix scorer's match (the
    prepareDataPlugins gate runs it before the profiles), so that is the prefix scorer here
    whatever ``router.kvEvents`` says. Each profile scores as the default one does."""
    prefix = _approximate_prefix_scorer()
    refs = _weighted_scorers(spec, prefix["type"])
    profiles = [
        {
            "name": role,
            "plugins": [
                {"pluginRef": PD_FILTERS[role]},
                {"pluginRef": "max-score-picker"},
                # copies: a shared node would be written to the YAML as an alias
                *(dict(ref) for ref in refs),
            ],
        }
        for role in names.LLMD_ROLES
    ]
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "featureGates": ["prepareDataPlugins"],
        "plugins": [
            {"type": PD_HEADERS_HANDLER},
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            prefix,
            *([{"type": LORA_SCORER}] if lora.enabled(spec) else []),
            *({"type": PD_FILTERS[role]} for role in names.LLMD_ROLES),
            {"type": "max-score-picker"},
            {
                "type": PD_DECIDER,
                "parameters": {"nonCachedTokens": spec["disaggregation"]["nonCachedTokens"]},
            },
            {"type": PD_PROFILE_HANDLER, "parameters": {"deciders": {"prefill": PD_DECIDER}}},
            *_metrics_plugins(spec),
        ],
        "schedulingProfiles": profiles,
    }


def endpoint_picker_config(spec: Spec) -> dict[str, Any]:
    """The EndpointPickerConfig: our metric names, queue + KV + prefix-aware scoring.

    The prefix scorer is the upstream approximate one (from the picker's own routing history),
    or with ``router.kvEvents`` and sha256_cbor block names llm-d's precise one (from the
    pods' KV-cache events). The weights are the upstream chart's and llm-d's guide's, the same
    for both: queue 2, KV cache use 2, prefix 3; with ``spec.model.lora`` the upstream
    lora-affinity-scorer too (weight 2), fed by ``vllm:lora_requests_info``. A pooling pool
    and a disaggregated one have configurations of their own.
    """
    if pooling(spec):
        return pooling_picker_config(spec)
    if disaggregation.enabled(spec):
        return pd_picker_config(spec)
    if router.precise_routing(spec):
        prefix: dict[str, Any] = precise_prefix_cache_scorer(spec)
    else:
        prefix = _approximate_prefix_scorer()
    scorers: list[dict[str, Any]] = [
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
    ]
    refs = _weighted_scorers(spec, prefix["type"])
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            *scorers,
            prefix,
            *([{"type": LORA_SCORER}] if lora.enabled(spec) else []),
            *_metrics_plugins(spec),
        ],
        "schedulingProfiles": [{"name": "default", "plugins": refs}],
    }
