"""The drain every stage runs on SIGTERM: it ends once nothing is held, or when time is up,
and a drain that waits says which requests it waits for."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest

from tokenline.lifecycle import Drain


@pytest.fixture
def restore_signal_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_drain_starts_on_sigterm_and_ends_once_nothing_is_held(restore_signal_handlers):
    drain = Drain(timeout=30)
    assert not drain.done(held={"u1"})  # not draining yet
    os.kill(os.getpid(), signal.SIGTERM)
    assert drain.draining
    assert not drain.done(held={"u1"})
    time.sleep(0.6)
    assert not drain.done(held={"u1"}), "a held request keeps the stage draining"
    assert drain.done(held=set())


def test_drain_gives_up_when_time_is_up(restore_signal_handlers):
    drain = Drain(timeout=0.2)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)
    assert drain.done(held={"u1"})


def test_a_waiting_drain_names_what_it_holds(restore_signal_handlers, caplog):
    caplog.set_level(logging.INFO, logger="tokenline.lifecycle")
    drain = Drain(timeout=30)
    os.kill(os.getpid(), signal.SIGTERM)
    held = {f"req-{i}" for i in range(7)}
    drain.done(held=held)
    drain.done(held=held)  # reported at most every few seconds, not every loop
    reports = [r.getMessage() for r in caplog.records if "still held" in r.getMessage()]
    assert reports == [
        "draining: 7 request(s) still held (req-0, req-1, req-2, req-3, req-4), 30s left"
    ]
