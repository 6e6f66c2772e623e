"""What the operator renders into each container is what the real `tokenline` CLI accepts.

The pod spec is built by one package and read by another; this resolves every container's
environment the way the kubelet does (ConfigMap keys, literal values) and parses its args
with the stage's own argument parser.
"""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import pytest

from tokenline.cli import build_parser, settings_from
from tokenline_operator import names
from tokenline_operator.crd import spec
from tokenline_operator.objects import Owner
from tokenline_operator.pods import config
from tokenline_operator.pods import deployment as pods

OWNER = Owner(name="chat", namespace="serving", uid="0b9c5a3e-2222-4c1b-9f44-2a4c1d6e7f80")
SPECS: dict[str, dict[str, Any]] = {
    "minimal": {"model": {"name": "tiny"}},
    "tuned": {
        "model": {"name": "Qwen/Qwen3-0.6B", "servedName": "qwen3", "revision": "main"},
        "engine": {
            "gpus": 1,
            "dtype": "bfloat16",
            "maxModelLen": 4096,
            "kvCacheMemory": "8GiB",
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 4096,
            "compile": True,
        },
    },
    "secured": {
        "model": {"name": "tiny"},
        "engine": {"gpus": 0, "prefixCaching": False},
        "server": {"apiKeySecret": {"name": "keys"}, "tlsSecret": {"name": "tls"}},
    },
    # a vllm serve command line carried over (spec.engine.extraArgs)
    "vllm": {
        "model": {"name": "tiny", "servedName": "chat"},
        "engine": {
            "gpus": 0,
            "extraArgs": [
                "--served-model-name", "chat", "gpt-4o",
                "--enable-prefix-caching",
                "--generation-config", "vllm",
                "--block-size=32",
                "--chat-template", "{{ messages[0]['content'] }}",
            ],
        },
    },
}  # fmt: skip


def _resolved_env(container: dict[str, Any], config: dict[str, str]) -> dict[str, str]:
    env = {}
    for item in container["env"]:
        source = item.get("valueFrom", {})
        if "configMapKeyRef" in source:
            env[item["name"]] = config[source["configMapKeyRef"]["key"]]
        elif "value" in item:
            env[item["name"]] = item["value"]
    return env


@pytest.mark.parametrize("name", list(SPECS))
def test_every_stage_container_parses_with_the_real_cli(name):
    parsed = spec.parse(OWNER.name, SPECS[name], default_image="tokenline:test")
    data = config.config_map(OWNER, parsed)["data"]
    pod_spec = pods.deployment(OWNER, parsed)["spec"]["template"]["spec"]
    seen = set()
    rings = set()
    for container in pod_spec["containers"]:
        env = _resolved_env(container, data)
        clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
        with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
            args = build_parser().parse_args(container["args"])
        settings = settings_from(args)
        stage = container["args"][0]
        seen.add(stage)
        assert settings.model == parsed["model"]["name"]
        if stage == "scheduler" and name == "tuned":
            assert settings.kv_cache_memory == 8 * 2**30
            assert settings.max_num_batched_tokens == 4096
            assert settings.dtype == "bfloat16"
            assert settings.compile is True
        if stage == "scheduler" and name == "minimal":
            assert settings.compile is False
            assert settings.max_num_batched_tokens is None  # the scheduler's device default
        if stage == "scheduler":
            assert settings.no_prefix_caching is (name == "secured")
        if stage == "api":
            assert settings.model_name == spec.served_model_name(parsed)
            secured = name == "secured"
            assert (settings.api_key_file == names.API_KEY_FILE) is secured
            assert (settings.ssl_certfile == names.TLS_CERT_FILE) is secured
            assert (settings.ssl_keyfile == names.TLS_KEY_FILE) is secured
        if name == "vllm":  # each stage took the flags it has, and no other
            assert settings.model_names == ["chat", "gpt-4o"]
            assert settings.chat_template == "{{ messages[0]['content'] }}"
            if stage == "scheduler":
                assert settings.block_size == 32
            if stage == "api":
                assert settings.generation_config == "vllm"
        rings.add(settings.endpoints)
    assert seen == {"api", "tokenizer", "scheduler", "detokenizer"}
    # One ring: every stage binds and connects the same endpoints, none of them a port.
    (ring,) = rings
    for stage in seen:
        assert ring.of(stage) == f"ipc://{names.RING_DIR}/{stage}.sock"
