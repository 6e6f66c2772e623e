"""spec.model.runner: pooling (issue 51), the pure builders: the pods run with --runner
pooling, and the InferencePool's picker routes every pooling route (/v1/embeddings, /rerank,
/v1/rerank, /score) with a parser that reads no body; generation keeps the OpenAI parser."""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import pytest
import yaml

from tokenline.cli import build_parser, settings_from
from tokenline_operator import names
from tokenline_operator.controller import manifests
from tokenline_operator.crd import spec
from tokenline_operator.objects import Capabilities, Owner
from tokenline_operator.pods import config
from tokenline_operator.routing import inference_pool

OWNER = Owner(name="embed", namespace="serving", uid="0b9c5a3e-3333-4c1b-9f44-2a4c1d6e7f80")
ROUTED = Capabilities(inference_pool=True)


def parse(**fields: Any) -> spec.Spec:
    raw = {"model": {"name": "BAAI/bge-small-en-v1.5"}, **fields}
    return spec.parse(OWNER.name, raw, default_image="tokenline:test")


def picker_config(**fields: Any) -> dict[str, Any]:
    return yaml.safe_load(inference_pool.picker_config_text(parse(**fields)))


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    return next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    )


@pytest.mark.parametrize("runner", ["pooling"])
def test_a_pooling_pool_routes_every_pooling_route_without_reading_bodies(runner):
    config = picker_config(model={"name": "BAAI/bge-small-en-v1.5", "runner": runner})
    types = [p["type"] for p in config["plugins"]]
    assert config["parser"] == {"pluginRef": "passthrough-parser"} and "passthrough-parser" in types
    # the scorers that need the parsed prompt or model are left out, the load scorers stay
    assert "prefix-cache-scorer" not in types and "lora-affinity-scorer" not in types
    refs = {r["pluginRef"] for r in config["schedulingProfiles"][0]["plugins"]}
    assert refs == {"queue-scorer", "kv-cache-utilization-scorer"} and refs <= set(types)
    assert "core-metrics-extractor" in types  # it still reads each pod's load
    parsed = parse(model={"name": "BAAI/bge-small-en-v1.5", "runner": runner})
    assert inference_pool.picker_image(parsed) == names.PICKER_IMAGE
    assert (
        manifests.children(OWNER, parsed, ROUTED)["ConfigMap"]["data"]["TOKENLINE_RUNNER"] == runner
    )


@pytest.mark.parametrize("runner", ["generate", "auto"])
def test_a_generating_pool_keeps_the_openai_parser_and_prefix_affinity(runner):
    config = picker_config(model={"name": "Qwen/Qwen3-0.6B", "runner": runner})
    assert "parser" not in config
    assert "prefix-cache-scorer" in {p["type"] for p in config["plugins"]}


def test_a_pooling_models_scheduler_runs_with_runner_pooling():
    """The kubelet's view of the scheduler container, read by the real CLI: --runner pooling
    (its TOKENLINE_RUNNER mirror, from the ConfigMap)."""
    parsed = parse(model={"name": "BAAI/bge-small-en-v1.5", "runner": "pooling"})
    data = config.config_map(OWNER, parsed)["data"]
    scheduler = container(manifests.children(OWNER, parsed, ROUTED)["Deployment"], "scheduler")
    variables = {
        item["name"]: data[item["valueFrom"]["configMapKeyRef"]["key"]]
        for item in scheduler["env"]
        if "configMapKeyRef" in item.get("valueFrom", {})
    }
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
    with mock.patch.dict(os.environ, {**clean, **variables}, clear=True):
        settings = settings_from(build_parser().parse_args(scheduler["args"]))
    assert settings.runner == "pooling"
