"""The adapter bookkeeping without a model: device slots (a running sequence pins its
adapter's; an idle resident one is evicted least recently used first), the host LRU (an
adapter evicted from it is read again from its uri), draining, and the policy admitting a
sequence only with its adapter in a slot."""

from __future__ import annotations

import pytest
from scheduler_testkit import assert_blocks_conserved, assert_states_consistent, fake_seq, fake_step

from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.lora.adapters import AdapterNotFound, LoraAdapter, LoraError
from tokenline.scheduler.lora.slots import LoraSlots
from tokenline.scheduler.policy import BatchPolicy
from tokenline.scheduler.sequence import Status


class Fakes:
    def __init__(self) -> None:
        self.loads: list[str] = []
        self.writes: list[tuple[int, str | None]] = []

    def load(self, name: str, uri: str) -> LoraAdapter:
        if uri == "bad":
            raise LoraError(f"cannot read {name}")
        self.loads.append(name)
        return LoraAdapter(name, 4, 1.0, {})

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        self.writes.append((slot, None if adapter is None else adapter.name))


def slots(max_loras: int = 2, max_cpu: int = 2) -> tuple[LoraSlots, Fakes]:
    fakes = Fakes()
    return LoraSlots(max_loras, max_cpu, fakes.load, fakes.write), fakes


def test_an_idle_resident_adapter_is_evicted_least_recently_used_first():
    loras, fakes = slots(max_loras=2, max_cpu=8)
    for name in "abc":
        loras.add(name, f"/{name}")
    assert loras.acquire("a") == 0 and loras.acquire("b") == 1
    assert loras.acquire("c") is None  # both slots pinned by running sequences
    loras.release("a")
    loras.release("b")
    assert loras.acquire("b") == 1  # resident: no write
    loras.release("b")
    assert loras.acquire("c") == 0  # a was used least recently
    assert fakes.writes == [(0, "a"), (1, "b"), (0, "c")]
    assert loras.counts() == {"resident": 2, "host": 3, "draining": 0}


def test_an_adapter_evicted_from_host_memory_is_read_again_from_its_uri():
    loras, fakes = slots(max_loras=1, max_cpu=1)
    loras.add("a", "/a")
    loras.add("b", "/b")  # evicts a from the host
    assert list(loras.host) == ["b"]
    assert loras.acquire("a") == 0
    assert fakes.loads == ["a", "b", "a"]


def test_load_and_unload_errors_are_vllms():
    loras, _ = slots()
    loras.add("a", "/a")
    with pytest.raises(LoraError, match="has already been loaded"):
        loras.add("a", "/a")
    with pytest.raises(LoraError, match="cannot read"):
        loras.add("x", "bad")
    assert loras.names == ["a"]
    with pytest.raises(AdapterNotFound) as missing:
        loras.unload("zzz")
    assert missing.value.http_status == 404


def test_an_unloaded_adapter_goes_with_its_last_sequence():
    loras, fakes = slots()
    loras.add("a", "/a")
    loras.enter("a")
    loras.acquire("a")
    loras.unload("a")
    assert not loras.known("a") and loras.counts()["draining"] == 1
    with pytest.raises(LoraError, match="being unloaded"):
        loras.add("a", "/a")
    loras.release("a")
    loras.leave("a")
    assert loras.uris == {} and loras.slots == [None, None] and not loras.host
    assert fakes.writes[-1] == (0, None)  # the slot is cleared on the device


def lora_seq(uid: str, lora: str, prompt_len: int = 8, max_tokens: int = 4):
    seq = fake_seq(uid, prompt_len, max_tokens)
    seq.lora = lora
    return seq


def test_the_policy_admits_a_sequence_only_with_its_adapter_in_a_slot():
    loras, _ = slots(max_loras=1)
    for name in "ab":
        loras.add(name, f"/{name}")
    policy = BatchPolicy(BlockPool(64, 4), 8, 64, loras=loras)
    live = {s.uid: s for s in (lora_seq("a1", "a"), lora_seq("b1", "b"), lora_seq("base", ""))}
    for seq in live.values():
        policy.add(seq)
    fake_step(policy)
    # b waits behind a's slot without holding up the base sequence queued after it
    assert [s.uid for s in policy.running] == ["a1", "base"]
    assert live["b1"].status is Status.WAITING and live["b1"].lora_slot == -1
    while policy.has_work():
        fake_step(policy)
        assert_states_consistent(policy)
        assert_blocks_conserved(policy)
        running = {s.lora for s in policy.running if s.lora}
        assert len(running) <= 1
    assert all(len(s.output_ids) == 4 for s in live.values())
    assert not loras.refs and not loras.users


def test_paused_sequences_give_up_their_slot_to_a_waiting_adapter():
    loras, _ = slots(max_loras=1)
    for name in "ab":
        loras.add(name, f"/{name}")
    policy = BatchPolicy(BlockPool(64, 4), 8, 64, loras=loras)
    a, b = lora_seq("a1", "a", max_tokens=10), lora_seq("b1", "b")
    policy.add(a)
    fake_step(policy)
    policy.pause("a1")
    policy.add(b)
    fake_step(policy)
    assert b.status is Status.RUNNING and a.lora_slot == -1 and not a.block_table
    policy.resume("a1")  # parked: recomputed once a slot is free again
    while policy.has_work():
        fake_step(policy)
    assert len(a.output_ids) == 10 and len(b.output_ids) == 4
