"""Shared prefixes and conversations over real HTTP, against the stand-in SSE server.

The stand-in's "prefix" and "turns" profiles report ``cached_tokens`` as a toy prefix cache
would (leading words shared with an earlier prompt), and every profile lists the bodies it
received, so these tests see exactly what the load generator sent.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenline.loadgen.cli import main
from tokenline.loadgen.workload import poisson_arrivals, shared_prefixes

pytestmark = pytest.mark.timeout(60)


def bench(tmp_path: Path, url: str, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "result.json"
    code = main(["--url", url, "--no-progress", "--json-out", str(out), *args])
    return code, json.loads(out.read_text())


def records(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for phase in result["phases"] for r in phase["records"]]


def received(base: str, profile: str) -> list[dict[str, Any]]:
    return httpx.get(f"{base}/{profile}/received", timeout=5, trust_env=False).json()


def test_shared_prefixes_are_sent_cached_tokens_are_reported_and_rounds_get_new_words(
    tmp_path: Path, stand_in_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/prefix",
        "--shared-prefix-len",
        "20",
        "--prefix-groups",
        "2",
        "--prompt-len",
        "5",
        "--num-requests",
        "6",
        "--concurrency",
        "1",
        "--output-len",
        "3",
        "--rounds",
        "2",
        "--seed",
        "9",
    )
    assert code == 0
    bodies = received(stand_in_server, "prefix")
    assert len(bodies) == 1 + 2 * 6  # the warm-up, then two rounds
    prefixes = shared_prefixes(20, 2, seed=9)
    warmup, first, second = bodies[0], bodies[1:7], bodies[7:]
    assert warmup["prompt"].startswith(prefixes[0] + " ")
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        assert a["prompt"].startswith(prefixes[i % 2] + " ")
        assert b["prompt"].startswith(prefixes[i % 2] + " ")
        assert a["prompt"] != b["prompt"] and len(a["prompt"].split()) == 25
    recs = records(result)
    assert all(r["prompt_tokens"] == 25 for r in recs)
    # group 0 was seen in the warm-up; group 1 first in the first round's second request
    assert [r["cached_tokens"] >= 20 for r in recs[:2]] == [True, False]
    assert all(r["cached_tokens"] >= 20 for r in recs[2:])
    summary = result["summaries"]["ours"]
    assert summary["cached_tokens"] == sum(r["cached_tokens"] for r in recs)
    out = capsys.readouterr().out
    assert "shared prefix 20 words in 2 group(s)" in out
    assert f"prompt tokens       300 ({summary['cached_tokens']} cached" in out


def test_repeat_prompts_sends_the_same_words_every_round(
    tmp_path: Path, stand_in_server: str
) -> None:
    before = len(received(stand_in_server, "quick"))
    code, _ = bench(
        tmp_path,
        f"{stand_in_server}/quick",
        "--num-requests",
        "3",
        "--concurrency",
        "1",
        "--output-len",
        "2",
        "--rounds",
        "2",
        "--warmup",
        "0",
        "--repeat-prompts",
    )
    assert code == 0
    bodies = received(stand_in_server, "quick")[before:]
    assert [b["prompt"] for b in bodies[:3]] == [b["prompt"] for b in bodies[3:]]


def test_each_turn_resends_the_conversation_with_the_replies_received(
    tmp_path: Path, stand_in_server: str
) -> None:
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/turns",
        "--endpoint",
        "chat",
        "--turns",
        "3",
        "--num-requests",
        "6",
        "--concurrency",
        "2",
        "--prompt-len",
        "4",
        "--output-len",
        "4",
        "--shared-prefix-len",
        "10",
        "--warmup",
        "0",
    )
    assert code == 0
    by_conversation: dict[str, list[list[dict[str, str]]]] = {}
    for body in received(stand_in_server, "turns"):
        by_conversation.setdefault(body["messages"][0]["content"], []).append(body["messages"])
    assert len(by_conversation) == 2
    prefix = shared_prefixes(10, 1, seed=0)[0]
    reply = "t0 t1 t2 t3 "  # what the stand-in streams for four tokens
    for first, turns in by_conversation.items():
        assert first.startswith(prefix + " ")
        assert [len(messages) for messages in turns] == [1, 3, 5]
        for before, after in itertools.pairwise(turns):
            assert after[: len(before)] == before
            assert after[len(before)] == {"role": "assistant", "content": reply}
            assert after[-1]["role"] == "user" and len(after[-1]["content"].split()) == 4
    recs = sorted(records(result), key=lambda r: r["index"])
    assert [(r["conversation"], r["turn"]) for r in recs] == [
        (c, t) for c in range(2) for t in range(3)
    ]
    for earlier, later in itertools.pairwise(recs):
        if later["turn"]:
            # the previous prompt and its reply lead the next prompt; the toy cache holds
            # prompts only, so the previous prompt is what it finds
            assert later["prompt_tokens"] == earlier["prompt_tokens"] + 4 + 4
            assert later["cached_tokens"] >= earlier["prompt_tokens"]


def test_a_failed_turn_ends_its_conversation(
    tmp_path: Path, stand_in_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # profile "turns-flaky": every second request answers HTTP 500
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/turns-flaky",
        "--endpoint",
        "chat",
        "--turns",
        "3",
        "--num-requests",
        "6",
        "--concurrency",
        "1",
        "--output-len",
        "2",
        "--warmup",
        "0",
    )
    assert code == 1
    recs = sorted(records(result), key=lambda r: r["index"])
    assert [r["error"] is None for r in recs] == [True, False, False] * 2
    assert [r["error"].split(":")[0] for r in recs if r["error"]] == [
        "HTTP 500",
        "not sent",
        "HTTP 500",
        "not sent",
    ]
    assert len(received(stand_in_server, "turns-flaky")) == 4
    assert "2 ok, 4 failed" in capsys.readouterr().out


def test_with_a_request_rate_conversations_arrive_on_the_schedule(
    tmp_path: Path, stand_in_server: str
) -> None:
    code, result = bench(
        tmp_path,
        f"{stand_in_server}/quick",
        "--endpoint",
        "chat",
        "--turns",
        "2",
        "--num-requests",
        "8",
        "--request-rate",
        "20",
        "--output-len",
        "2",
        "--seed",
        "3",
        "--warmup",
        "0",
    )
    assert code == 0
    phase = result["phases"][0]
    recs = {(r["conversation"], r["turn"]): r for r in phase["records"]}
    for conversation, arrival in enumerate(poisson_arrivals(4, 20.0, seed=3)):
        first, second = recs[(conversation, 0)], recs[(conversation, 1)]
        assert -0.005 <= first["start"] - phase["start"] - arrival <= 0.08  # never early
        assert second["start"] >= first["start"] + first["e2e"]


def test_a_rerun_against_a_prefix_cache_is_flagged(
    tmp_path: Path, stand_in_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--num-requests", "3", "--output-len", "2", "--warmup", "0", "--seed", "31")
    assert bench(tmp_path, f"{stand_in_server}/prefix", *args)[0] == 0
    assert "server remembers an earlier run" not in capsys.readouterr().out
    assert bench(tmp_path, f"{stand_in_server}/prefix", *args)[0] == 0
    assert "ours: 100% of prompt tokens were cached" in capsys.readouterr().out
