"""What an endpoint picker reads on the api port, scraped from the running stack.

The names come from the EndpointPickerConfig the operator gives the picker, so a rename on
either side fails here: each must exist on the api's /metrics, as a gauge, in its range,
and agree with the scheduler it copies.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tokenline.settings import Settings
from tokenline_operator.controller import manifests
from tokenline_operator.crd import spec
from tokenline_operator.routing import inference_pool

pytestmark = pytest.mark.timeout(120)

OWNER = manifests.Owner(name="chat", namespace="serving", uid="uid-chat")


def picker_engine_config() -> dict:
    """The metric mapping the operator configures the endpoint picker with."""
    parsed = spec.parse(OWNER.name, {"model": {"name": "tiny"}}, default_image="x")
    data = inference_pool.picker_config_map(OWNER, parsed)["data"]
    config = yaml.safe_load(data[inference_pool.PICKER_CONFIG_FILE])
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    (engine,) = extractor["parameters"]["engineConfigs"]
    return engine


def scrape(url: str) -> dict[str, tuple[str, list]]:
    """name → (type, samples) from one scrape."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def scheduler_blocks(log_path: str) -> int:
    """The KV blocks the scheduler allocated, as its startup log line says (one reserved)."""
    found = re.findall(r"scheduler ready: .*?, (\d+) KV blocks", Path(log_path).read_text())
    assert found, f"no scheduler startup line in {log_path}"
    return int(found[-1]) - 1


def sample(families: dict, name: str) -> tuple[str, dict, float]:
    kind, samples = families[name]
    (only,) = samples  # one model per pod: one series, which is what the picker reads
    return kind, only.labels, only.value


def test_every_metric_the_picker_reads_is_on_the_api_port(stack):
    engine = picker_engine_config()
    families = scrape(stack.metrics_urls["api"])
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        kind, labels, value = sample(families, engine[key])
        assert kind == "gauge", (key, kind)
        assert labels["model"] == stack.model
        assert value >= 0, key
    _, _, kv_usage = sample(families, engine["kvUsageSpec"])
    assert 0.0 <= kv_usage <= 1.0
    _, info, value = sample(families, engine["cacheInfoSpec"])
    assert value == 1
    assert int(info[engine["cacheBlockSizeLabelName"]]) == Settings().block_size
    assert int(info[engine["cacheNumBlocksLabelName"]]) == scheduler_blocks(stack.log_path)
    # Distinct from the scheduler's own gauges, which the dashboards sum per pod.
    scheduler = scrape(stack.metrics_urls["scheduler"])
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        assert engine[key] not in scheduler
    # ... and the api still exports no series of the scheduler's names.
    for name in ("tokenline_num_requests_waiting", "tokenline_kv_cache_usage_ratio"):
        assert families.get(name, ("gauge", []))[1] == [], name


def test_the_api_copies_follow_the_schedulers_load(stack):
    engine = picker_engine_config()
    client = OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=90)
    done = threading.Event()

    def generate() -> None:
        try:
            for _ in client.completions.create(
                model=stack.model,
                prompt="the river runs past the old mountain road " * 8,
                max_tokens=1500,
                extra_body={"ignore_eos": True},
                stream=True,
            ):
                if done.is_set():
                    break  # the client goes: the api aborts the rest
        finally:
            done.set()

    workers = [threading.Thread(target=generate) for _ in range(2)]
    for worker in workers:
        worker.start()
    seen: tuple[float, float] | None = None
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and seen is None:
            families = scrape(stack.metrics_urls["api"])
            running = sample(families, engine["runningRequestsSpec"])[2]
            kv_usage = sample(families, engine["kvUsageSpec"])[2]
            if running >= 1 and kv_usage > 0:
                seen = (running, kv_usage)
            time.sleep(0.1)
    finally:
        done.set()
        for worker in workers:
            worker.join(timeout=60)
    assert seen is not None, "the api never showed the scheduler's running requests"
    running, kv_usage = seen
    assert 1 <= running <= 2 and 0 < kv_usage <= 1

    # Idle again: the copies return to zero within a few heartbeats, like the scheduler's.
    def idle() -> bool:
        families = scrape(stack.metrics_urls["api"])
        return (
            sample(families, engine["runningRequestsSpec"])[2] == 0
            and sample(families, engine["queuedRequestsSpec"])[2] == 0
            and sample(families, engine["kvUsageSpec"])[2] == 0
        )

    deadline = time.monotonic() + 15
    while not idle():
        assert time.monotonic() < deadline, "the api's copies did not return to idle"
        time.sleep(0.2)
    # The scheduler's own gauge is set on its housekeeping tick, the heartbeat status read
    # live: either may lead by a moment, both settle at zero.
    while stack.metric("scheduler", "tokenline_num_requests_running"):
        assert time.monotonic() < deadline, "the scheduler's gauge did not return to idle"
        time.sleep(0.2)
    assert idle()


def test_a_restarted_scheduler_with_another_cache_leaves_one_info_series():
    from prometheus_client import REGISTRY

    from tokenline import protocol
    from tokenline.api.http.endpoint_metrics import EndpointMetrics

    gauges = EndpointMetrics("unit-model")
    status = protocol.StageStatus(stage="scheduler", instance="a", block_size=16, num_blocks=99)
    gauges.update(status)
    gauges.update(protocol.StageStatus(stage="scheduler", instance="b", kv_usage=1.5))
    labels = {"model": "unit-model"}
    assert REGISTRY.get_sample_value("tokenline_endpoint_kv_cache_usage_ratio", labels) == 1.0
    gauges.update(
        protocol.StageStatus(stage="scheduler", instance="c", block_size=32, num_blocks=40)
    )
    info = [
        s.labels
        for family in REGISTRY.collect()
        if family.name == "tokenline_endpoint_cache_config_info"
        for s in family.samples
        if s.labels["model"] == "unit-model"
    ]
    assert info == [{"model": "unit-model", "block_size": "32", "num_gpu_blocks": "40"}]
    assert REGISTRY.get_sample_value("tokenline_endpoint_kv_cache_usage_ratio", labels) == 0.0
