"""Protocol round trips, and malformed frames that are counted and dropped, never fatal."""

from __future__ import annotations

import signal
import threading
import time

import msgspec
import pytest
import zmq

from tokenline import protocol
from tokenline.metrics import MALFORMED_FRAMES
from tokenline.transport import RingEndpoints, SyncRing

SAMPLING = protocol.SamplingParams(max_tokens=8, temperature=0.5, seed=3, stop=["x"])
MESSAGES = {
    "tokenizer": [
        protocol.Generate(uid="a-1", sampling=SAMPLING, timeout_s=5, prompt="hi"),
        protocol.Generate(
            uid="a-2",
            sampling=SAMPLING,
            timeout_s=5,
            messages=[protocol.ChatMessage(role="user", content="hé 🙂")],
        ),
        protocol.Abort(uid="a-1", reason="client_disconnect"),
        protocol.Pause(uid="a-1"),
        protocol.Resume(uid="a-1"),
        protocol.Heartbeat(
            seq=1, origin="o", statuses=[protocol.StageStatus(stage="tokenizer", instance="i")]
        ),
    ],
    "scheduler": [
        protocol.Tokenized(uid="a-1", prompt_ids=[1, 2, 3], sampling=SAMPLING, timeout_s=5),
        protocol.Failed(uid="a-3", code="context_length_exceeded", message="too long"),
    ],
    "detokenizer": [
        protocol.Begin(uid="a-1", prompt_tokens=3, stop=["x"]),
        protocol.TokenBatch(
            outputs=[protocol.TokenOutput(uid="a-1", token_ids=[5], finish_reason="length")]
        ),
        protocol.TokenBatch(
            outputs=[
                protocol.TokenOutput(
                    uid="a-2",
                    token_ids=[7],
                    logprobs=[
                        protocol.TokenLogprobs(
                            token_id=7, logprob=-0.25, top_ids=[7, 9], top_logprobs=[-0.25, -2.0]
                        )
                    ],
                )
            ]
        ),
    ],
    "api": [
        protocol.ReplyBatch(
            replies=[
                protocol.Reply(
                    uid="a-1", text="ok", num_tokens=1, finish_reason="stop", prompt_tokens=3
                ),
                protocol.Reply(
                    uid="a-2",
                    text="é",
                    num_tokens=2,
                    logprobs=[
                        protocol.LogprobEntry(
                            token="\ufffd",
                            logprob=-1.5,
                            bytes=[195],
                            top=[protocol.TopLogprob(token="\ufffd", logprob=-1.5, bytes=[195])],
                        ),
                        protocol.LogprobEntry(token="\ufffd", logprob=-0.5, bytes=[169]),
                    ],
                ),
            ]
        ),
    ],
}


def test_requests_without_logprobs_carry_nothing_for_them():
    plain = msgspec.msgpack.Encoder()
    assert "logprobs" not in msgspec.msgpack.decode(plain.encode(SAMPLING))
    # array-like structs keep every position: an absent list costs one nil byte, no more
    for message in (
        protocol.TokenOutput(uid="a-1", token_ids=[5]),
        protocol.Reply(uid="a-1", text="ok", num_tokens=1),
    ):
        assert msgspec.msgpack.decode(plain.encode(message))[-1] is None
        assert plain.encode(message).endswith(b"\xc0")


@pytest.mark.parametrize("stage", list(MESSAGES))
def test_every_message_round_trips_through_its_hop(stage):
    from tokenline.transport import INBOX_UNION

    codec = protocol.Codec(INBOX_UNION[stage])
    for message in MESSAGES[stage]:
        assert codec.decode(codec.encode(message)) == message


def test_a_message_for_another_hop_is_rejected_not_misread():
    codec = protocol.Codec(protocol.ToApi)
    with pytest.raises(msgspec.ValidationError):
        codec.decode(codec.encode(protocol.Pause(uid="x")))


def test_no_pickle_only_msgpack_on_the_wire():
    frame = protocol.Codec(protocol.ToTokenizer).encode(MESSAGES["tokenizer"][0])
    assert msgspec.msgpack.decode(frame)["t"] == "generate"


def test_malformed_frames_are_counted_and_dropped_and_the_inbox_keeps_working(tmp_path):
    endpoints = RingEndpoints.in_directory(str(tmp_path))
    ring = SyncRing("tokenizer", endpoints)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoints.tokenizer)
    counter = MALFORMED_FRAMES.labels(stage="tokenizer")
    before = counter._value.get()
    try:
        good = protocol.Codec(protocol.ToTokenizer).encode(MESSAGES["tokenizer"][0])
        for frame in (b"\xc1garbage", b"", msgspec.msgpack.encode({"t": "nope"}), good):
            push.send(frame)
        received: list = []
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            ring.poll(100)
            received += [m for _, m in ring.recv_timed() if isinstance(m, msgspec.Struct)]
        assert received == [MESSAGES["tokenizer"][0]]
        assert counter._value.get() - before == 3
    finally:
        push.close()
        ctx.term()
        ring.close()


def test_a_running_stage_survives_garbage_on_its_socket(stack):
    from openai import OpenAI

    before = stack.metric("scheduler", "tokenline_malformed_frames_total", stage="scheduler")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{stack.ipc_dir}/scheduler.sock")
    for frame in (b"\x00\x01\x02", b"not msgpack at all", msgspec.msgpack.encode([1, 2])):
        push.send(frame)
    push.close(linger=1000)
    ctx.term()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = stack.metric("scheduler", "tokenline_malformed_frames_total", stage="scheduler")
        if now - before >= 3:
            break
        time.sleep(0.2)
    assert now - before == 3
    client = OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused")
    reply = client.completions.create(  # EOS ignored: a sampled one would end it with stop
        model=stack.model, prompt="still alive?", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"


def test_a_slow_signal_handler_cannot_turn_a_poll_into_an_endless_wait(tmp_path):
    """A SIGTERM drain handler that runs past poll's timeout once left CPython's
    SimpleQueue.get(timeout) waiting for ever: a draining stage whose peers were gone hung
    until it was killed. poll must still return, empty, soon after the handler."""
    ring = SyncRing("tokenizer", RingEndpoints.in_directory(str(tmp_path)))
    main = threading.main_thread().ident
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: time.sleep(0.2))
    interrupt = threading.Timer(0.05, signal.pthread_kill, (main, signal.SIGUSR1))
    # If poll hangs, a message 3 s later ends the wait, so the test fails instead of hanging.
    rescue = threading.Timer(3.0, ring._arrived.put, ((0.0, MESSAGES["tokenizer"][0]),))
    try:
        interrupt.start()
        rescue.start()
        started = time.monotonic()
        assert ring.poll(100) is False
        assert time.monotonic() - started < 1.0
    finally:
        interrupt.cancel()
        rescue.cancel()
        signal.signal(signal.SIGUSR1, previous)
        ring.close()
