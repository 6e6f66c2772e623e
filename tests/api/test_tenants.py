"""Who a request belongs to and how urgent it is, as the api hands both to the scheduler: the
API key's name or the gateway's fairness header, and vLLM's ``priority`` field (refused where
the scheduler runs first come, first served)."""

from __future__ import annotations

import pytest
from api_testkit import ADMITTED, app_with, client_for

from tokenline.api.http.auth import ApiKeys, named_keys, parse_key_file

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "prompt": "hi"}
RESPONSE = {"model": "tiny", "input": "hi"}


def test_key_file_lines_may_name_their_key() -> None:
    text = "# keys\nteam-a sk-aaa\nsk-bare\n  team b   sk-bbb  \n"
    assert named_keys(text) == [("team-a", "sk-aaa"), ("", "sk-bare"), ("team b", "sk-bbb")]
    assert parse_key_file(text) == ["sk-aaa", "sk-bare", "sk-bbb"]


def test_a_key_matches_with_its_name(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("team-a sk-aaa\nsk-bare\n")
    keys = ApiKeys(["sk-flag"], str(path))
    assert keys.match("sk-aaa") == "team-a"
    assert keys.match("sk-bare") == "" and keys.match("sk-flag") == ""
    assert keys.match("sk-nope") is None and not keys.accepts("team-a sk-aaa")


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION), ("/v1/responses", RESPONSE)],
)
def test_priority_and_tenant_reach_the_ring(tmp_path, path, body) -> None:
    keys = tmp_path / "keys"
    keys.write_text("team-a sk-aaa\nsk-bare\n")
    app, ring = app_with(api_key_file=str(keys), scheduling_policy="priority")
    client = client_for(app)
    header = "x-llm-d-inference-fairness-id"
    cases = [
        ("sk-aaa", {header: "spoofed"}, 3, "team-a"),  # a named key wins over the header
        ("sk-bare", {header: "flow-7"}, -2, "flow-7"),
        ("sk-bare", {}, 0, ""),
    ]
    for key, headers, priority, tenant in cases:
        sent = client.post(
            path,
            json={**body, "priority": priority},
            headers={"Authorization": f"Bearer {key}", **headers},
        )
        assert sent.status_code == ADMITTED, sent.text
        [message] = ring.opened[-1]
        assert (message.priority, message.tenant) == (priority, tenant)


def test_priority_is_refused_under_fcfs_and_bounded() -> None:
    app, _ = app_with()
    client = client_for(app)
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        refused = client.post(path, json={**body, "priority": 1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
        assert "--scheduling-policy" in refused.json()["error"]["message"]
        assert client.post(path, json={**body, "priority": 0}).status_code == ADMITTED
    refused = client.post("/v1/responses", json={**RESPONSE, "priority": 2})
    assert refused.status_code == 400 and "priority" in refused.json()["error"]["message"]
    app, _ = app_with(scheduling_policy="priority")
    huge = client_for(app).post("/v1/completions", json={**COMPLETION, "priority": 2**40})
    assert huge.status_code == 400


def test_the_tenant_header_is_configurable_and_bounded() -> None:
    app, ring = app_with(tenant_header="x-team")
    client = client_for(app)
    assert client.post("/v1/completions", json=COMPLETION, headers={"x-team": "red"}).status_code
    assert ring.opened[-1][0].tenant == "red"
    client.post("/v1/completions", json=COMPLETION, headers={"x-llm-d-inference-fairness-id": "z"})
    assert ring.opened[-1][0].tenant == ""
    too_long = client.post("/v1/completions", json=COMPLETION, headers={"x-team": "r" * 129})
    assert too_long.status_code == 400 and "x-team" in too_long.json()["error"]["message"]
