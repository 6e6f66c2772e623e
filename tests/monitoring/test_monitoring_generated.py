"""The committed dashboards and alert rules are exactly what the generator writes, and they keep
the metric and label contracts of DESIGN.md."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from monitoring_support import (
    ALERTS_FILE,
    CHART,
    CONTRACT_METRICS,
    DASHBOARDS_DIR,
    FILTERS,
    KV_TRANSFER_METRICS,
    LORA_INFO_METRIC,
    LORA_METRICS,
    STEP_METRICS,
    TENANT_METRICS,
    TENSOR_PARALLEL_METRICS,
    metric_names,
)

from tokenline.monitoring import generate


def load_dashboards() -> dict[str, dict]:
    return {
        path.stem: json.loads(path.read_text()) for path in sorted(DASHBOARDS_DIR.glob("*.json"))
    }


def targets(dashboard: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_committed_files_equal_generator_output():
    files = generate.render()
    on_disk = {
        path.relative_to(CHART)
        for folder in ("dashboards", "alerts")
        for path in (CHART / folder).iterdir()
    }
    assert on_disk == set(files), "run: python -m tokenline.monitoring.generate"
    for rel, text in files.items():
        assert (CHART / rel).read_text() == text, f"{rel} drifted; regenerate it"
    assert generate.main(["--check"]) == 0


def test_check_mode_detects_drift(tmp_path: Path):
    chart = tmp_path / "chart"
    assert generate.main(["--chart-dir", str(chart)]) == 0
    assert generate.main(["--chart-dir", str(chart), "--check"]) == 0
    dashboard = chart / "dashboards" / "tokenline-overview.json"
    dashboard.write_text(dashboard.read_text().replace("Requests/s", "Requests per second"))
    assert generate.main(["--chart-dir", str(chart), "--check"]) == 1
    assert generate.main(["--chart-dir", str(chart)]) == 0
    (chart / "dashboards" / "stale.json").write_text("{}")
    assert generate.main(["--chart-dir", str(chart), "--check"]) == 1


def test_overview_and_pipeline_dashboards_exist():
    dashboards = load_dashboards()
    assert set(dashboards) == {"tokenline-overview", "tokenline-pipeline"}
    for uid, dashboard in dashboards.items():
        assert dashboard["uid"] == uid
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_every_query_uses_the_datasource_variable_and_all_filters():
    for uid, dashboard in load_dashboards().items():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for label in FILTERS:
            assert variables[label]["type"] == "query"
            assert variables[label]["includeAll"] and variables[label]["multi"]
            assert variables[label]["allValue"] == ".*"
            assert variables[label]["datasource"]["uid"] == "${datasource}"
        found = targets(dashboard)
        assert found, uid
        for panel, target in found:
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            # every selector of every expression carries the three filters
            for sel in re.findall(r"(?:\btokenline_\w+|\bup|vllm:\w+)\{[^}]*\}", target["expr"]):
                for label in FILTERS:
                    assert f'{label}=~"${label}"' in sel, (panel["title"], sel)


def test_dashboards_read_every_contract_metric_and_nothing_else():
    known = (
        CONTRACT_METRICS
        | LORA_METRICS
        | STEP_METRICS
        | TENSOR_PARALLEL_METRICS
        | TENANT_METRICS
        | KV_TRANSFER_METRICS
    )
    used: dict[str, set[str]] = {}
    for uid, dashboard in load_dashboards().items():
        used[uid] = set().union(*(metric_names(t["expr"]) for _, t in targets(dashboard)))
        assert used[uid] <= known, used[uid] - known
    assert used["tokenline-overview"] | used["tokenline-pipeline"] == known


@pytest.mark.parametrize(
    ("title", "metric", "by"),
    [
        ("LoRA requests/s", "tokenline_lora_requests_total", "adapter"),
        ("LoRA generated tokens/s", "tokenline_lora_generated_tokens_total", "adapter"),
        ("LoRA adapters by state", "tokenline_lora_adapters", "state"),
    ],
)
def test_lora_panels_break_down_by_adapter_and_state(title, metric, by):
    panels = {p["title"]: p for p in load_dashboards()["tokenline-overview"]["panels"]}
    (target,) = panels[title]["targets"]
    assert metric_names(target["expr"]) == {metric}
    assert f"sum by ({by})" in target["expr"]
    assert target["legendFormat"] == "{{" + by + "}}"


def test_lora_panel_shows_each_pods_newest_adapters_info():
    panels = {p["title"]: p for p in load_dashboards()["tokenline-overview"]["panels"]}
    (target,) = panels["Running / waiting adapters"]["targets"]
    expr = target["expr"]
    assert f"topk by (pod) (1, {LORA_INFO_METRIC}{{" in expr  # newest series per pod
    for label in ("running_lora_adapters", "waiting_lora_adapters", "max_lora"):
        assert label in expr and "{{" + label + "}}" in target["legendFormat"]


def row_panels(title: str) -> list[str]:
    """The titles of the overview's panels under the row called ``title``."""
    panels = load_dashboards()["tokenline-overview"]["panels"]
    [start] = [i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == title]
    after = []
    for panel in panels[start + 1 :]:
        if panel["type"] == "row":
            break
        after.append(panel["title"])
    return after


def test_lora_panels_sit_in_their_own_row():
    after = row_panels("LoRA adapters")
    assert after == [
        "LoRA requests/s",
        "LoRA generated tokens/s",
        "LoRA adapters by state",
        "Running / waiting adapters",
    ]


def test_tenant_and_speculation_panels_sit_in_their_own_rows():
    assert row_panels("Tenants and priorities") == [
        "Tokens/s by tenant",
        "Running / waiting by tenant",
        "Queue time p99 by tenant",
        "Preemptions/s by tenant",
    ]
    assert row_panels("Speculative decoding") == [
        "Tokens per verification",
        "Acceptance rate",
        "Accepted by position/s",
    ]


def test_kv_transfer_panels_sit_in_their_own_row_and_break_down_as_exported():
    assert row_panels("Prefill / decode disaggregation") == [
        "KV transfer bytes/s",
        "KV pull time p50 / p99",
        "KV transfer failures/s",
        "KV blocks held for transfer",
    ]
    panels = {p["title"]: p for p in load_dashboards()["tokenline-overview"]["panels"]}
    (sent,) = panels["KV transfer bytes/s"]["targets"]
    assert "sum by (direction)" in sent["expr"] and sent["legendFormat"] == "{{direction}}"
    (failed,) = panels["KV transfer failures/s"]["targets"]
    assert "sum by (reason)" in failed["expr"]
    pulls = panels["KV pull time p50 / p99"]["targets"]
    assert [t["legendFormat"] for t in pulls] == ["p50", "p99"]
    assert all("tokenline_kv_transfer_seconds_bucket" in t["expr"] for t in pulls)
    (held,) = panels["KV blocks held for transfer"]["targets"]
    assert metric_names(held["expr"]) == {"tokenline_kv_blocks_held_for_transfer"}


@pytest.mark.parametrize(
    ("uid", "title", "metric"),
    [
        ("tokenline-overview", "Requests/s", "tokenline_requests_total"),
        ("tokenline-overview", "Tokens/s", "tokenline_generation_tokens_total"),
        ("tokenline-overview", "Time to first token", "tokenline_time_to_first_token_seconds"),
        ("tokenline-overview", "Inter-token latency", "tokenline_inter_token_latency_seconds"),
        ("tokenline-overview", "End-to-end latency", "tokenline_e2e_request_latency_seconds"),
        ("tokenline-overview", "Running / waiting / paused", "tokenline_num_requests_waiting"),
        ("tokenline-overview", "KV cache usage", "tokenline_kv_cache_usage_ratio"),
        ("tokenline-overview", "Prefix cache hit rate", "tokenline_prefix_cache_hits_total"),
        ("tokenline-overview", "Prefix cache hit rate", "tokenline_prefix_cache_queries_total"),
        ("tokenline-overview", "Finish reasons", "tokenline_requests_total"),
        ("tokenline-overview", "Error ratio", "tokenline_requests_total"),
        ("tokenline-pipeline", "Time in stage p50 / p90 / p99", "tokenline_stage_latency_seconds"),
        ("tokenline-pipeline", "Buffer depth", "tokenline_buffer_depth"),
        ("tokenline-pipeline", "Live uids", "tokenline_live_uids"),
        ("tokenline-pipeline", "Leaked uids", "tokenline_leaked_uids"),
        ("tokenline-pipeline", "Aborts by reason", "tokenline_aborts_total"),
        ("tokenline-pipeline", "Malformed frames", "tokenline_malformed_frames_total"),
    ],
)
def test_issue_panels_are_present(uid: str, title: str, metric: str):
    panels = {p["title"]: p for p in load_dashboards()[uid]["panels"]}
    assert title in panels
    assert metric in set().union(*(metric_names(t["expr"]) for t in panels[title]["targets"]))


def test_latency_panels_show_p50_p90_p99():
    for uid, title in [
        ("tokenline-overview", "Time to first token"),
        ("tokenline-overview", "Inter-token latency"),
        ("tokenline-overview", "End-to-end latency"),
        ("tokenline-pipeline", "Time in stage p50 / p90 / p99"),
    ]:
        panel = next(p for p in load_dashboards()[uid]["panels"] if p["title"] == title)
        quantiles = {
            float(m)
            for t in panel["targets"]
            for m in re.findall(r"histogram_quantile\(([\d.]+)", t["expr"])
        }
        assert quantiles == {0.5, 0.9, 0.99}, title


def test_alert_rules_read_only_contract_metrics():
    rules = yaml.safe_load(ALERTS_FILE.read_text())["groups"][0]["rules"]
    for rule in rules:
        # the KV transfer alert reads what only P/D schedulers export (issue 49)
        extra = KV_TRANSFER_METRICS if rule["alert"] == "TokenlineKVTransferFailing" else set()
        assert metric_names(rule["expr"]) <= CONTRACT_METRICS | extra, rule["alert"]


def test_generator_runs_as_a_module(tmp_path: Path):
    shutil.copytree(CHART / "dashboards", tmp_path / "dashboards")
    shutil.copytree(CHART / "alerts", tmp_path / "alerts")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenline.monitoring.generate",
            "--chart-dir",
            str(tmp_path),
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
