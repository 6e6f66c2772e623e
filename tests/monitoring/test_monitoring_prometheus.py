"""Proof on a real Prometheus: it scrapes the running four-process stack under a short load, and
every PromQL expression of every dashboard panel and of every alert evaluates; the traffic
panels return data. Also `promtool check metrics` on every stage's exposition."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
import yaml
from monitoring_support import (
    ALERTS_FILE,
    CONTRACT_METRICS,
    DASHBOARDS_DIR,
    DOWN_POD,
    FILTERS,
    INFERENCESERVICE,
    NAMESPACE,
    POD,
    STEP_METRICS,
    Prometheus,
)
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

STAGES = ("api", "tokenizer", "scheduler", "detokenizer")
RATE_INTERVAL = "15s"
ALL_FILTERS = dict.fromkeys(FILTERS, ".*")
TRAFFIC_PANELS = ("Requests/s", "Tokens/s", "Time to first token")
WARMUP_REQUESTS = 2
LOAD_REQUESTS = 32
# Sent one after the other: the second finds the first's prompt in the prefix cache.
SHARED_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
SHARED_PROMPT_REQUESTS = 2


def _dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARDS_DIR.glob("*.json"))}


def _panel_targets() -> list[tuple[str, str, dict]]:
    return [
        (uid, panel["title"], target)
        for uid, dashboard in _dashboards().items()
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def _alerts() -> list[dict]:
    groups = yaml.safe_load(ALERTS_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def substitute(expr: str, filters: dict[str, str]) -> str:
    """Expand Grafana template variables the way Grafana would with the given filter values."""
    values = {"__rate_interval": RATE_INTERVAL, "datasource": "prometheus", **filters}

    def expand(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"unknown template variable ${name} in {expr}"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", expand, expr)


def _request(client: OpenAI, model: str, i: int) -> None:
    """One short request; the four kinds alternate: chat or completion, streaming or not."""
    prompt = f"Count to {i % 7 + 2}."
    stream = i % 2 == 1
    if i % 4 < 2:
        messages = [{"role": "user", "content": prompt}]
        answer = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, stream=stream
        )
    else:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=8, stream=stream)
    if stream:
        for _ in answer:
            pass


def send_load(stack, count: int, start: int = 0) -> None:
    client = OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(max_workers=4) as pool:
        for future in [pool.submit(_request, client, stack.model, start + i) for i in range(count)]:
            future.result()


def _wait_for(prometheus: Prometheus, expr: str, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not prometheus.vector(expr):
        assert time.monotonic() < deadline, f"Prometheus never saw {what}: {expr}"
        time.sleep(0.5)


@dataclass(frozen=True)
class Traffic:
    at: float  # the evaluation time: every request served and scraped, inside the rate window


@pytest.fixture(scope="module")
def traffic(stack, prometheus: Prometheus) -> Traffic:
    stage_targets = f'up{{pod="{POD}"}} == 1'
    _wait_for(prometheus, f"count({stage_targets}) == {len(STAGES)}", "every stage target up")
    # A few requests first, so every labelled series exists before the load it must show.
    send_load(stack, WARMUP_REQUESTS)
    time.sleep(2)
    send_load(stack, LOAD_REQUESTS, start=WARMUP_REQUESTS)
    client = OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=120)
    for _ in range(SHARED_PROMPT_REQUESTS):
        client.completions.create(model=stack.model, prompt=SHARED_PROMPT, max_tokens=2)
    served = WARMUP_REQUESTS + LOAD_REQUESTS + SHARED_PROMPT_REQUESTS
    _wait_for(
        prometheus,
        f'sum(tokenline_requests_total{{pod="{POD}"}}) >= {served}',
        f"{served} finished requests",
    )
    # The scheduler adds its prefix cache counts in housekeeping, after the replies. The
    # counter may be non-zero already (earlier tests on the shared stack): wait for this
    # traffic's increase to be scraped, which is what the panel's rate() shows.
    _wait_for(
        prometheus,
        f'sum(rate(tokenline_prefix_cache_hits_total{{pod="{POD}"}}[15s])) > 0',
        "a prefix cache hit",
    )
    return Traffic(at=time.time())


@pytest.mark.parametrize(
    ("uid", "title", "target"),
    _panel_targets(),
    ids=[f"{uid}:{title}:{t['refId']}" for uid, title, t in _panel_targets()],
)
def test_every_dashboard_query_evaluates(prometheus, traffic, uid, title, target):
    answer = prometheus.query(substitute(target["expr"], ALL_FILTERS), traffic.at)
    assert answer.get("status") == "success", answer


@pytest.mark.parametrize("title", TRAFFIC_PANELS)
def test_traffic_panels_return_data(prometheus, traffic, title):
    panel = next(p for p in _dashboards()["tokenline-overview"]["panels"] if p["title"] == title)
    for target in panel["targets"]:
        expr = substitute(target["expr"], ALL_FILTERS)
        values = [float(sample["value"][1]) for sample in prometheus.vector(expr, traffic.at)]
        assert any(math.isfinite(v) and v > 0 for v in values), (expr, values)


def test_error_ratio_panel_shows_a_ratio_under_load(prometheus, traffic):
    panel = next(
        p for p in _dashboards()["tokenline-overview"]["panels"] if p["title"] == "Error ratio"
    )
    expr = substitute(panel["targets"][0]["expr"], ALL_FILTERS)
    values = [float(sample["value"][1]) for sample in prometheus.vector(expr, traffic.at)]
    assert values and all(0 <= v <= 1 for v in values), (expr, values)


def test_prefix_cache_hit_rate_panel_shows_the_repeated_prompt(prometheus, traffic):
    panel = next(
        p
        for p in _dashboards()["tokenline-overview"]["panels"]
        if p["title"] == "Prefix cache hit rate"
    )
    expr = substitute(panel["targets"][0]["expr"], ALL_FILTERS)
    values = [float(sample["value"][1]) for sample in prometheus.vector(expr, traffic.at)]
    assert values and all(0 < v <= 1 for v in values), (expr, values)


def test_stage_targets_panel_shows_up_and_down(prometheus, traffic):
    panel = next(
        p for p in _dashboards()["tokenline-pipeline"]["panels"] if p["title"] == "Stage targets up"
    )
    expr = substitute(panel["targets"][0]["expr"], ALL_FILTERS)
    up = {
        (s["metric"]["pod"], s["metric"]["container"]): s["value"][1]
        for s in prometheus.vector(expr, traffic.at)
    }
    assert up == {**{(POD, stage): "1" for stage in STAGES}, (DOWN_POD, "detokenizer"): "0"}


def test_filters_select_the_scraped_service(prometheus, traffic):
    panel = next(
        p for p in _dashboards()["tokenline-overview"]["panels"] if p["title"] == "Requests/s"
    )
    expr = panel["targets"][0]["expr"]
    ours = {"namespace": NAMESPACE, "inferenceservice": INFERENCESERVICE, "pod": POD}
    assert prometheus.vector(substitute(expr, ours), traffic.at)
    other = {**ours, "namespace": "not-" + NAMESPACE}
    assert prometheus.vector(substitute(expr, other), traffic.at) == []


@pytest.mark.parametrize("title", ["Live uids", "Mean time in stage (stacked)", "Buffer depth"])
def test_pipeline_panels_show_every_stage(prometheus, traffic, title):
    panel = next(p for p in _dashboards()["tokenline-pipeline"]["panels"] if p["title"] == title)
    expr = substitute(panel["targets"][0]["expr"], ALL_FILTERS)
    stages = {sample["metric"].get("stage") for sample in prometheus.vector(expr, traffic.at)}
    assert stages >= set(STAGES), (expr, stages)


def test_filter_variables_list_the_scraped_labels(prometheus, traffic):
    expected = {"namespace": NAMESPACE, "inferenceservice": INFERENCESERVICE, "pod": POD}
    for dashboard in _dashboards().values():
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"])
            assert match, variable["query"]
            series, label = substitute(match.group(1), ALL_FILTERS), match.group(2)
            answer = prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": series})
            assert answer["status"] == "success", answer
            assert expected[label] in answer["data"], (variable["query"], answer["data"])


@pytest.mark.parametrize("rule", _alerts(), ids=[rule["alert"] for rule in _alerts()])
def test_every_alert_expression_evaluates(prometheus, traffic, rule):
    answer = prometheus.query(rule["expr"], traffic.at)
    assert answer.get("status") == "success", answer


def test_prometheus_loads_and_evaluates_every_alert_rule(prometheus, traffic):
    loaded = {
        rule["name"]: rule
        for group in prometheus.get("/api/v1/rules")["data"]["groups"]
        for rule in group["rules"]
    }
    assert set(loaded) == {rule["alert"] for rule in _alerts()}
    for name, rule in loaded.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))


def test_stage_down_alert_finds_only_the_target_that_is_down(prometheus, traffic):
    _wait_for(prometheus, f'ALERTS{{alertname="TokenlineStageDown", pod="{DOWN_POD}"}}', "alert")
    alerts = prometheus.get("/api/v1/alerts")["data"]["alerts"]
    down = [a for a in alerts if a["labels"]["alertname"] == "TokenlineStageDown"]
    assert {a["labels"]["pod"] for a in down} == {DOWN_POD}
    assert {a["state"] for a in down} <= {"pending", "firing"}


# ── promtool check metrics ──────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def expositions(stack) -> dict[str, str]:
    """Every stage's /metrics text after a few requests, so labelled series have samples."""
    send_load(stack, 4)
    return {stage: httpx.get(stack.metrics_urls[stage], timeout=10).text for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_promtool_check_metrics(promtool, expositions, stage):
    text = expositions[stage]
    assert "tokenline_" in text, f"{stage} exports no tokenline metric"
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_stages_export_every_metric_the_dashboards_read(expositions):
    exported: set[str] = set()
    for text in expositions.values():
        for family in text_string_to_metric_families(text):
            exported.add(family.name + "_total" if family.type == "counter" else family.name)
    expected = CONTRACT_METRICS | STEP_METRICS
    assert expected <= exported, expected - exported
