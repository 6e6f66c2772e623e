"""ZeroMQ sockets for the ring, built from configured endpoints.

Each stage binds a PULL socket on its own endpoint (its inbox) and connects a PUSH socket to the
next stage's endpoint (its outbox). Frames are MessagePack; a frame that fails to decode is
counted in ``tokenline_malformed_frames_total`` and dropped, never raised.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from tokenline import protocol
from tokenline.metrics import MALFORMED_FRAMES

log = logging.getLogger(__name__)

DEFAULT_ENDPOINTS = {
    "api": "tcp://127.0.0.1:5601",
    "tokenizer": "tcp://127.0.0.1:5602",
    "scheduler": "tcp://127.0.0.1:5603",
    "detokenizer": "tcp://127.0.0.1:5604",
}
NEXT_STAGE = {
    "api": "tokenizer",
    "tokenizer": "scheduler",
    "scheduler": "detokenizer",
    "detokenizer": "api",
}
INBOX_UNION = {
    "api": protocol.ToApi,
    "tokenizer": protocol.ToTokenizer,
    "scheduler": protocol.ToScheduler,
    "detokenizer": protocol.ToDetokenizer,
}
# A stage's inbox never blocks its sender for long: per-request backpressure is explicit
# (Pause/Resume), so these limits only guard against a dead peer.
HIGH_WATER_MARK = 100_000


@dataclass(frozen=True)
class RingEndpoints:
    api: str = DEFAULT_ENDPOINTS["api"]
    tokenizer: str = DEFAULT_ENDPOINTS["tokenizer"]
    scheduler: str = DEFAULT_ENDPOINTS["scheduler"]
    detokenizer: str = DEFAULT_ENDPOINTS["detokenizer"]

    def of(self, stage: str) -> str:
        return getattr(self, stage)

    @classmethod
    def in_directory(cls, directory: str) -> RingEndpoints:
        """IPC endpoints inside one directory (what `tokenline serve` uses)."""
        return cls(**{s: f"ipc://{os.path.join(directory, s)}.sock" for s in protocol.STAGES})


def _remove_ipc_file(endpoint: str) -> None:
    """libzmq leaves a bound IPC socket file behind on some exits; the binder removes it."""
    if endpoint.startswith("ipc://"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(endpoint.removeprefix("ipc://"))


class _Decoder:
    def __init__(self, stage: str) -> None:
        self._stage = stage
        self._codec = protocol.Codec(INBOX_UNION[stage])
        self._malformed = MALFORMED_FRAMES.labels(stage=stage)

    def decode(self, frame: bytes) -> msgspec.Struct | None:
        try:
            return self._codec.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._malformed.inc()
            log.warning(
                "%s: dropped a malformed frame of %d bytes: %s", self._stage, len(frame), exc
            )
            return None


def _configure(sock: zmq.Socket, hwm_option: int) -> None:
    sock.setsockopt(hwm_option, HIGH_WATER_MARK)
    sock.setsockopt(zmq.LINGER, 0)


class SyncRing:
    """Blocking sockets for the tokenizer, scheduler and detokenizer loops."""

    def __init__(self, stage: str, endpoints: RingEndpoints) -> None:
        self.stage = stage
        self._ctx = zmq.Context()
        self._inbox = self._ctx.socket(zmq.PULL)
        _configure(self._inbox, zmq.RCVHWM)
        self._bound = endpoints.of(stage)
        self._inbox.bind(self._bound)
        self._outbox = self._ctx.socket(zmq.PUSH)
        _configure(self._outbox, zmq.SNDHWM)
        self._outbox.connect(endpoints.of(NEXT_STAGE[stage]))
        self._decoder = _Decoder(stage)
        self._encoder = msgspec.msgpack.Encoder()

    def poll(self, timeout_ms: int) -> bool:
        """True when at least one frame is waiting."""
        return bool(self._inbox.poll(timeout_ms))

    def recv_ready(self, limit: int = 10_000) -> list[msgspec.Struct]:
        """Every message already waiting (up to ``limit``), without blocking."""
        messages: list[msgspec.Struct] = []
        while len(messages) < limit:
            try:
                frame = self._inbox.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            message = self._decoder.decode(frame)
            if message is not None:
                messages.append(message)
        return messages

    def send(self, message: msgspec.Struct) -> None:
        self._outbox.send(self._encoder.encode(message), copy=False)

    def close(self) -> None:
        self._inbox.close()
        _remove_ipc_file(self._bound)
        self._outbox.close()
        self._ctx.term()


class AsyncRing:
    """asyncio sockets for the api: it sends to the tokenizer and hears from the detokenizer."""

    def __init__(self, endpoints: RingEndpoints) -> None:
        self._ctx = zmq.asyncio.Context()
        self._inbox = self._ctx.socket(zmq.PULL)
        _configure(self._inbox, zmq.RCVHWM)
        self._bound = endpoints.api
        self._inbox.bind(self._bound)
        # A plain socket: sends never wait, so no future is left unobserved.
        self._sync_ctx = zmq.Context()
        self._outbox = self._sync_ctx.socket(zmq.PUSH)
        _configure(self._outbox, zmq.SNDHWM)
        self._outbox.connect(endpoints.tokenizer)
        self._decoder = _Decoder("api")
        self._encoder = msgspec.msgpack.Encoder()

    async def recv(self) -> msgspec.Struct | None:
        """The next message; None for a malformed frame (already counted)."""
        frame = await self._inbox.recv(copy=True)
        return self._decoder.decode(frame)

    def send_nowait(self, message: msgspec.Struct) -> None:
        """Queue a message for the tokenizer; never waits (the HWM is far above real load)."""
        self._outbox.send(self._encoder.encode(message), flags=zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self._inbox.close()
        _remove_ipc_file(self._bound)
        self._outbox.close()
        self._ctx.term()
        self._sync_ctx.term()
