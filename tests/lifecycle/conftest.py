"""A stack with short limits, for tests that break things on purpose."""

from __future__ import annotations

import time

import pytest

SHORT_FLAGS = (
    "--request-timeout",
    "8",
    "--slow-client-timeout",
    "2",
    "--drain-timeout",
    "5",
    "--max-waiting",
    "24",
)
STAGES = ("api", "tokenizer", "scheduler", "detokenizer")


@pytest.fixture(scope="module")
def short_stack(launch_stack):
    stack = launch_stack(*SHORT_FLAGS)
    yield stack
    stack.stop()


def held_state(stack) -> dict[str, float]:
    """Everything that must be zero once a stack is idle."""
    state = {}
    for s in STAGES:
        state[f"live[{s}]"] = stack.metric(s, "tokenline_live_uids", stage=s)
        state[f"leaked[{s}]"] = stack.metric(s, "tokenline_leaked_uids", stage=s)
    state["kv_cache_usage"] = stack.metric("scheduler", "tokenline_kv_cache_usage_ratio")
    for buffer in ("waiting", "running", "paused"):
        state[f"scheduler.{buffer}"] = stack.metric(
            "scheduler", "tokenline_buffer_depth", stage="scheduler", buffer=buffer
        )
    state["api.replies"] = stack.metric(
        "api", "tokenline_buffer_depth", stage="api", buffer="replies"
    )
    return state


def assert_nothing_held(stack, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    state = held_state(stack)
    while any(state.values()) and time.monotonic() < deadline:
        time.sleep(0.25)
        state = held_state(stack)
    assert not any(state.values()), f"state held after the stack went idle: {state}"


@pytest.fixture
def nothing_held():
    """Assert, once the stack is idle, that no stage holds or leaked a uid and the KV is empty."""
    return assert_nothing_held
