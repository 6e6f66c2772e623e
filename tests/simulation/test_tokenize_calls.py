"""/tokenize and /detokenize calls (`RingClient.call`) around the in-memory ring: answered through
every hop, failed by name, refused when the ring is down, and cleaned up on every path
(answer, failure, cancellation, timeout, ring failure) with no ledger left holding a uid."""

from __future__ import annotations

import asyncio

import pytest
from ring_sim import RingSim

from tokenline import protocol
from tokenline.api.http.errors import ApiError
from tokenline.metrics import LATE_REPLIES

LATE = LATE_REPLIES.labels(stage="api")


def ring(tokenizer) -> RingSim:
    sim = RingSim(0, tokenizer)
    for _ in range(3):  # the ring answers before the first call
        sim.heartbeat()
        sim.settle_links()
    assert sim.ring_client.problem() is None
    return sim


def nothing_held(sim: RingSim) -> list[str]:
    problems = sim.violations()
    if len(sim.ring_client.calls):
        problems.append(f"api holds calls {list(sim.ring_client.calls)}")
    return problems


async def answered(sim: RingSim, call: asyncio.Task):
    await asyncio.sleep(0)  # the call is sent
    sim.settle_links()
    return await call


def tokenize(uid: str, **fields) -> protocol.TokenizeCall:
    return protocol.TokenizeCall(uid=uid, **fields)


async def test_a_call_is_answered_through_every_hop(sim_tokenizer):
    sim = ring(sim_tokenizer)
    call = asyncio.create_task(sim.ring_client.call(lambda uid: tokenize(uid, prompt="old river")))
    answer = await answered(sim, call)
    assert answer.ids == sim_tokenizer("old river")["input_ids"]
    assert answer.max_model_len == sim.max_model_len
    decode = asyncio.create_task(sim.ring_client.call(lambda uid: tokenize(uid, decode=answer.ids)))
    assert (await answered(sim, decode)).text == "old river"
    assert nothing_held(sim) == []


async def test_a_failed_call_raises_its_error(sim_tokenizer):
    sim = ring(sim_tokenizer)
    call = asyncio.create_task(sim.ring_client.call(lambda uid: tokenize(uid, decode=[10**6])))
    with pytest.raises(ApiError) as caught:
        await answered(sim, call)
    assert (caught.value.status, caught.value.param) == (400, "tokens")
    assert "token id 1000000 " in caught.value.message
    assert nothing_held(sim) == []


async def test_a_call_is_refused_at_once_while_the_ring_is_down(sim_tokenizer):
    sim = RingSim(0, sim_tokenizer)  # no heartbeat has come back yet
    with pytest.raises(ApiError) as caught:
        await sim.ring_client.call(lambda uid: tokenize(uid, prompt="x"))
    assert (caught.value.status, caught.value.code) == (503, "stage_unavailable")
    assert not sim.links["tokenizer"]  # nothing was sent
    assert nothing_held(sim) == []


async def test_a_ring_failure_fails_the_waiting_call_and_its_late_answer_is_expected(
    sim_tokenizer,
):
    sim = ring(sim_tokenizer)
    call = asyncio.create_task(sim.ring_client.call(lambda uid: tokenize(uid, prompt="x")))
    await asyncio.sleep(0)
    sim.ring_client.route(protocol.Link(reporter="sim", peer="scheduler", up=False))
    with pytest.raises(ApiError) as caught:
        await call
    assert (caught.value.status, caught.value.code) == (503, "stage_failure")
    late = LATE._value.get()
    sim.settle_links()  # the answer still arrives: dropped as expected, not counted late
    assert LATE._value.get() == late
    assert nothing_held(sim) == []


async def test_a_cancelled_call_leaves_nothing(sim_tokenizer):
    sim = ring(sim_tokenizer)
    call = asyncio.create_task(sim.ring_client.call(lambda uid: tokenize(uid, prompt="x")))
    await asyncio.sleep(0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert len(sim.ring_client.calls) == 0 and len(sim.ring_client.ledger) == 0
    late = LATE._value.get()
    sim.settle_links()
    assert LATE._value.get() == late
    assert nothing_held(sim) == []


async def test_a_call_past_the_request_timeout_is_a_504(sim_tokenizer):
    sim = ring(sim_tokenizer)
    sim.ring_client.settings.request_timeout = 0.05
    # never delivered: the tokenizer's inbox is not drained
    with pytest.raises(ApiError) as caught:
        await sim.ring_client.call(lambda uid: tokenize(uid, prompt="x"))
    assert (caught.value.status, caught.value.code) == (504, "request_timeout")
    sim.settle_links()
    assert nothing_held(sim) == []


async def test_an_unknown_answer_is_counted_late(sim_tokenizer):
    sim = ring(sim_tokenizer)
    late = LATE._value.get()
    sim.ring_client.route(protocol.TokenizerAnswer(uid="nobody", ids=[1]))
    assert LATE._value.get() == late + 1


async def test_calls_count_as_waiting_so_a_flood_of_them_gets_429s(sim_tokenizer):
    sim = ring(sim_tokenizer)
    sim.ring_client.settings.max_waiting = 2
    # not delivered yet: both wait in the tokenizer's inbox
    first = [
        asyncio.create_task(sim.ring_client.call(lambda uid: tokenize(uid, prompt="x")))
        for _ in range(2)
    ]
    await asyncio.sleep(0)
    with pytest.raises(ApiError) as caught:
        await sim.ring_client.call(lambda uid: tokenize(uid, prompt="x"))
    assert (caught.value.status, caught.value.code) == (429, "too_many_requests")
    with pytest.raises(ApiError) as caught:  # generations wait behind the same inbox
        sim.ring_client.open(
            [protocol.Generate(uid="", sampling=protocol.SamplingParams(), prompt="x", timeout_s=1)]
        )
    assert caught.value.status == 429
    sim.settle_links()
    for call in first:
        assert (await call).ids
    assert nothing_held(sim) == []
