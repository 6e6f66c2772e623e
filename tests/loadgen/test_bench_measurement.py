"""The load generator measures what a real HTTP server did.

These tests run `tokenline bench` over real HTTP against a stand-in SSE server whose delays
and token counts are fixed in advance (tests/loadgen/stand_in_sse_server.py), and check the
load generator's own measurements: TTFT, gaps between chunks, token counts, percentiles,
failures, the JSON and the PNG, and `--compare`. They say nothing about tokenline's server.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from tokenline.loadgen.cli import main
from tokenline.loadgen.report import percentile
from tokenline.loadgen.workload import poisson_arrivals

pytestmark = pytest.mark.timeout(60)


def bench(tmp_path: Path, url: str, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "result.json"
    code = main(["--url", url, "--no-progress", "--warmup", "0", "--json-out", str(out), *args])
    return code, json.loads(out.read_text())


def records(result: dict[str, Any], label: str = "ours") -> list[dict[str, Any]]:
    return [r for phase in result["phases"] if phase["target"] == label for r in phase["records"]]


def test_ttft_and_gaps_match_the_servers_configured_delays(
    tmp_path: Path, stand_in_server: str
) -> None:
    # profile "fast": first token 150 ms after arrival, then one token every 20 ms
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/fast",
        "--num-requests",
        "8",
        "--concurrency",
        "4",
        "--output-len",
        "10",
    )
    assert code == 0
    recs = records(result)
    assert len(recs) == 8 and all(r["error"] is None for r in recs)
    for r in recs:
        assert 0.150 <= r["ttft"] < 0.250
        assert len(r["itl"]) == 9
        assert r["e2e"] >= 0.150 + 9 * 0.020
    summary = result["summaries"]["ours"]
    assert summary["model"] == "fast"  # discovered at /v1/models
    assert 0.018 <= summary["itl"]["p50"] <= 0.030
    assert 0.018 <= summary["tpot"]["p50"] <= 0.030


def test_reported_percentiles_are_those_of_the_request_records(
    tmp_path: Path, stand_in_server: str
) -> None:
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/quick",
        "--num-requests",
        "12",
        "--concurrency",
        "3",
        "--output-len",
        "3:12",
    )
    assert code == 0
    recs, summary = records(result), result["summaries"]["ours"]
    gaps = [g for r in recs for g in r["itl"]]
    for key, values in (
        ("ttft", [r["ttft"] for r in recs]),
        ("itl", gaps),
        ("e2e", [r["e2e"] for r in recs]),
    ):
        for q in (50, 90, 99):
            assert summary[key][f"p{q}"] == pytest.approx(percentile(values, q), abs=1e-12)
        assert summary[key]["count"] == len(values)
    span = sum(p["duration"] for p in result["phases"])
    assert summary["output_throughput"] == pytest.approx(summary["output_tokens"] / span)
    assert summary["request_throughput"] == pytest.approx(12 / span)


def test_token_counts_are_exact_when_chunks_pack_several_tokens(
    tmp_path: Path, stand_in_server: str
) -> None:
    # profile "packed": three tokens per chunk, with a final usage chunk
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/packed",
        "--num-requests",
        "10",
        "--concurrency",
        "5",
        "--output-len",
        "4:20",
        "--seed",
        "5",
    )
    assert code == 0
    recs = records(result)
    for r in recs:
        assert r["tokens_source"] == "usage"
        assert r["output_tokens"] == r["max_tokens"]
        assert r["chunks"] == math.ceil(r["max_tokens"] / 3)
        assert r["prompt_tokens"] == r["prompt_words"]
    summary = result["summaries"]["ours"]
    assert summary["output_tokens"] == sum(r["max_tokens"] for r in recs)
    assert summary["short_outputs"] == 0
    # three tokens a chunk but a request's last (4 to 20 tokens): its accepted length, seen
    per_chunk = summary["tokens_per_chunk"]
    assert per_chunk["count"] == len(recs)
    assert 2 <= per_chunk["p50"] <= 3 and per_chunk["mean"] == pytest.approx(
        sum(r["max_tokens"] / math.ceil(r["max_tokens"] / 3) for r in recs) / len(recs)
    )
    # chunks arrive every 3 x 10 ms; per token that is 10 ms
    assert 0.027 <= summary["itl"]["p50"] <= 0.040
    assert 0.008 <= summary["tpot"]["p50"] <= 0.016


def test_without_usage_tokens_are_counted_as_chunks(
    tmp_path: Path, stand_in_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # profile "nousage": two tokens per chunk and never a usage chunk
    code, result = bench(
        tmp_path, f"{stand_in_server}/nousage", "--num-requests", "4", "--output-len", "9"
    )
    assert code == 0
    for r in records(result):
        assert (r["tokens_source"], r["chunks"], r["output_tokens"]) == ("chunks", 5, 5)
    assert result["summaries"]["ours"]["tokens_per_chunk"] is None  # unknown, not 1
    out = capsys.readouterr().out
    assert "tokens counted as chunks" in out
    assert "tokens per chunk    - (no usage" in out


def test_chat_ttft_ignores_the_role_only_first_chunk(tmp_path: Path, stand_in_server: str) -> None:
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/fast",
        "--endpoint",
        "chat",
        "--num-requests",
        "3",
        "--output-len",
        "4",
    )
    assert code == 0
    for r in records(result):
        assert r["ttft"] >= 0.150
        assert (r["output_tokens"], r["chunks"]) == (4, 4)


def test_ignore_eos_is_sent_so_output_length_is_max_tokens(
    tmp_path: Path, stand_in_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # profile "eos": stops after 5 tokens unless the request says ignore_eos
    code, result = bench(
        tmp_path, f"{stand_in_server}/eos", "--num-requests", "3", "--output-len", "12"
    )
    assert code == 0 and [r["output_tokens"] for r in records(result)] == [12, 12, 12]
    capsys.readouterr()
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/eos",
        "--num-requests",
        "3",
        "--output-len",
        "12",
        "--no-ignore-eos",
    )
    assert code == 0 and [r["output_tokens"] for r in records(result)] == [5, 5, 5]
    assert "3 requests ended before max_tokens" in capsys.readouterr().out


def test_failed_requests_are_counted_and_make_the_exit_code_nonzero(
    tmp_path: Path, stand_in_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # profile "flaky": every third request answers HTTP 500
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/flaky",
        "--num-requests",
        "9",
        "--concurrency",
        "1",
        "--output-len",
        "2",
    )
    assert code == 1
    summary = result["summaries"]["ours"]
    assert (summary["completed"], summary["failed"]) == (6, 3)
    assert summary["output_tokens"] == 12
    out = capsys.readouterr().out
    assert "6 ok, 3 failed" in out and "HTTP 500" in out


def test_request_rate_starts_requests_on_the_poisson_schedule(
    tmp_path: Path, stand_in_server: str
) -> None:
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/quick",
        "--num-requests",
        "10",
        "--request-rate",
        "25",
        "--output-len",
        "2",
        "--seed",
        "11",
    )
    assert code == 0
    assert result["config"]["concurrency"] is None
    phase = result["phases"][0]
    expected = poisson_arrivals(10, 25.0, seed=11)
    for r, arrival in zip(phase["records"], expected, strict=True):
        # never early; late by at most an event loop's hiccup on a busy machine
        assert -0.005 <= r["start"] - phase["start"] - arrival <= 0.08


def test_compare_interleaves_rounds_and_prints_ratios_json_and_plot(
    tmp_path: Path, stand_in_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # "fast": TTFT 150 ms; "slow": TTFT 300 ms, same 20 ms gaps, and, like `transformers
    # serve`, it answers 422 to fields outside the OpenAI schema (ignore_eos) and sends no [DONE]
    plot = tmp_path / "bench.png"
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/fast",
        "--compare",
        f"{stand_in_server}/slow/v1",
        "--num-requests",
        "4",
        "--concurrency",
        "4",
        "--output-len",
        "5",
        "--plot",
        str(plot),
    )
    assert code == 0
    assert [(p["target"], p["round"]) for p in result["phases"]] == [
        ("ours", 0),
        ("theirs", 0),
        ("theirs", 1),
        ("ours", 1),
    ]
    assert len(records(result, "theirs")) == 8
    ttft = result["comparison"]["TTFT p50 (ms)"]
    assert ttft["ratio"] == pytest.approx(0.5, abs=0.08)
    assert result["comparison"]["ITL p50 (ms)"]["ratio"] == pytest.approx(1.0, abs=0.25)
    out = capsys.readouterr().out
    assert "ours vs theirs (ratio = ours/theirs)" in out
    row = re.search(r"^TTFT p50 \(ms\)\s+(\S+)\s+(\S+)\s+(\S+)\s+lower$", out, re.M)
    assert row is not None and float(row[3]) == pytest.approx(
        float(row[1]) / float(row[2]), abs=0.01
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_an_unreachable_server_fails_fast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--url", "http://127.0.0.1:9", "--no-progress", "--num-requests", "1"])
    assert code == 1
    assert "Cannot connect to host 127.0.0.1:9" in capsys.readouterr().err
