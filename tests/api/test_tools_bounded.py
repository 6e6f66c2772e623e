"""A request's tools cost the api CPU before admission (each schema checked, all compiled into
one grammar): their count is bounded as OpenAI bounds it, and the work runs off the event loop,
so one heavy request never stalls the others or the health probes."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from api_testkit import ADMITTED, app_with, client_for

from tokenline.api.endpoints import chat
from tokenline.api.openai.tools import MAX_TOOLS


def _tools(count: int) -> list[dict]:
    return [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(count)
    ]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}]}),
    ],
)
def test_more_tools_than_openai_takes_are_a_400_naming_tools(path, body):
    app, _ = app_with()
    client = client_for(app)
    over = client.post(path, json={"model": "tiny", **body, "tools": _tools(MAX_TOOLS + 1)})
    assert over.status_code == 400, over.text
    assert over.json()["error"]["param"] == "tools"
    if path.startswith("/v1"):
        within = client.post(path, json={"model": "tiny", **body, "tools": _tools(MAX_TOOLS)})
        assert within.status_code == ADMITTED, within.text


def test_responses_tools_are_bounded_too():
    app, _ = app_with()
    tools = [{"type": "function", "name": f"f{i}", "parameters": {}} for i in range(MAX_TOOLS + 1)]
    response = client_for(app).post(
        "/v1/responses", json={"model": "tiny", "input": "x", "tools": tools}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools"


async def test_the_loop_keeps_answering_while_a_requests_tools_are_planned(monkeypatch):
    plan = chat.plan_tools

    def slow_plan(*args):
        time.sleep(1.0)  # a schema heavy to check, on whichever thread runs it
        return plan(*args)

    monkeypatch.setattr(chat, "plan_tools", slow_plan)
    app, _ = app_with()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
        started = time.monotonic()
        heavy = asyncio.create_task(
            client.post("/v1/chat/completions", json={**body, "tools": _tools(2)})
        )
        await asyncio.sleep(0.1)  # the heavy request is being planned
        health = await client.get("/health")
        answered_in = time.monotonic() - started
        assert health.status_code == 200
        assert answered_in < 0.6, f"/health waited {answered_in:.2f} s behind the plan"
        assert (await heavy).status_code == ADMITTED
