"""The leak ledger finds state held past its end or past its deadline, and reclaims it."""

from __future__ import annotations

import time

from tokenline.ledger import Ledger
from tokenline.metrics import LEAKED_UIDS, LEAKS_RECLAIMED


def test_held_after_close_is_a_leak_and_is_reclaimed():
    ledger = Ledger("test-closed", grace_s=60)
    ledger.open("a", 30)
    ledger.open("b", 30)
    ledger.close("a")
    reclaimed = LEAKS_RECLAIMED.labels(stage="test-closed")
    assert ledger.sweep(held=["a", "b"]) == ["a"]
    assert LEAKED_UIDS.labels(stage="test-closed")._value.get() == 1
    assert reclaimed._value.get() == 1
    assert ledger.sweep(held=["b"]) == []
    assert LEAKED_UIDS.labels(stage="test-closed")._value.get() == 0


def test_past_deadline_plus_grace_is_a_leak():
    ledger = Ledger("test-deadline", grace_s=0.5)
    ledger.open("slow", 0.0)
    assert ledger.sweep(held=["slow"]) == []  # within grace
    time.sleep(0.6)
    assert ledger.sweep(held=["slow"]) == ["slow"]
    assert not ledger.is_open("slow")


def test_unknown_uid_held_is_a_leak():
    assert Ledger("test-unknown").sweep(held=["ghost"]) == ["ghost"]


def test_an_open_uid_the_stage_no_longer_holds_is_a_leak_past_its_deadline():
    """Its state went without its end (a handler that lost it): the entry would otherwise
    stay open, and count as live, forever."""
    ledger = Ledger("test-lost", grace_s=0.2)
    ledger.open("lost", 0.0)
    ledger.open("kept", 60)
    assert ledger.sweep(held=[]) == []  # within grace
    time.sleep(0.3)
    assert ledger.sweep(held=[]) == ["lost"]
    assert not ledger.is_open("lost") and ledger.is_open("kept") and len(ledger) == 1
