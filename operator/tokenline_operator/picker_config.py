"""The endpoint picker's configuration (its EndpointPickerConfig): the metrics it scrapes on
each pod's api port under our names, and how it scores pods: queue depth, KV cache use and
prefix affinity, the prefix scorer either the upstream approximate one or, with
``spec.router.kvEvents`` and sha256_cbor block names, llm-d's precise-prefix-cache-scorer fed
by the pods' KV-cache events (see :mod:`router`). :mod:`inference_pool` mounts it into the
picker.
"""

from __future__ import annotations

from typing import Any

from tokenline.settings import BY_FLAG

from . import names, router
from .spec import Spec, tls_enabled

#: The name our metric mapping is registered under in the picker's ``engineConfigs`` (and
#: the default for every pod).
METRICS_MAPPING_NAME = "tokenline"
#: The scheduler's default block size: the prefix scorer's fallback until it reads the
#: cache configuration (``autoTune``) from the pods' metrics.
DEFAULT_BLOCK_SIZE_TOKENS: int = BY_FLAG["block-size"].default


def _metrics_plugins(spec: Spec) -> list[dict[str, Any]]:
    """What the picker scrapes on each pod's api port, under our metric names."""
    mapping = {"name": METRICS_MAPPING_NAME, **names.ENDPOINT_METRICS, **names.CACHE_INFO_LABELS}
    mapping["loraSpec"] = ""  # tokenline serves no LoRA adapters: nothing to scrape
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


def endpoint_picker_config(spec: Spec) -> dict[str, Any]:
    """The EndpointPickerConfig: our metric names, queue + KV + prefix-aware scoring.

    The prefix scorer is the upstream approximate one (from the picker's own routing history),
    or with ``router.kvEvents`` and sha256_cbor block names llm-d's precise one (from the
    pods' KV-cache events). The weights are the upstream chart's and llm-d's guide's, the same
    for both: queue 2, KV cache use 2, prefix 3.
    """
    if router.precise_routing(spec):
        prefix: dict[str, Any] = precise_prefix_cache_scorer(spec)
    else:
        prefix = {
            "type": "prefix-cache-scorer",
            "parameters": {"autoTune": True, "blockSizeTokens": DEFAULT_BLOCK_SIZE_TOKENS},
        }
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            prefix,
            *_metrics_plugins(spec),
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                    {"pluginRef": prefix["type"], "weight": 3},
                ],
            }
        ],
    }
