"""ZeroMQ sockets for the ring, built from configured endpoints.

Each stage binds a PULL socket on its own endpoint (its inbox) and connects a PUSH socket to the
next stage's endpoint (its outbox). Frames are MessagePack; a frame that fails to decode is
counted in ``tokenline_malformed_frames_total`` and dropped, never raised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
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
    """Sockets for the tokenizer, scheduler and detokenizer loops.

    A receiver thread owns the inbox: it takes each frame off the socket as it arrives and
    stamps its arrival time, so a message that waits while the stage is busy (a model step)
    is counted as time in that stage, and the stage's loop never blocks on the socket.
    """

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
        # queue.Queue, not SimpleQueue: CPython's SimpleQueue.get(timeout) turns into a wait
        # without end when a signal handler (our SIGTERM drain) runs past the timeout, and a
        # stage that is draining never wakes up again once its peers are gone.
        self._arrived: queue.Queue[tuple[float, msgspec.Struct]] = queue.Queue()
        self._held: list[tuple[float, msgspec.Struct]] = []  # taken off the queue by poll()
        self._closing = threading.Event()
        self._receiver = threading.Thread(target=self._receive, name=f"{stage}-inbox", daemon=True)
        self._receiver.start()

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                if not poller.poll(100):
                    continue
                while True:
                    try:
                        frame = self._inbox.recv(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    message = self._decoder.decode(frame)
                    if message is not None:
                        self._arrived.put((time.monotonic(), message))
        finally:
            self._inbox.close()

    def poll(self, timeout_ms: int) -> bool:
        """True when at least one message is waiting; waits up to ``timeout_ms``."""
        if self._held or not self._arrived.empty():
            return True
        try:
            self._held.append(self._arrived.get(timeout=timeout_ms / 1000))
        except queue.Empty:
            return False
        return True

    def recv_timed(self, limit: int = 10_000) -> list[tuple[float, msgspec.Struct]]:
        """Every waiting message (up to ``limit``) with its monotonic arrival time."""
        items, self._held = self._held[:limit], self._held[limit:]
        while len(items) < limit:
            try:
                items.append(self._arrived.get_nowait())
            except queue.Empty:
                break
        return items

    def recv_ready(self, limit: int = 10_000) -> list[msgspec.Struct]:
        """Every waiting message (up to ``limit``), without blocking."""
        return [message for _, message in self.recv_timed(limit)]

    def send(self, message: msgspec.Struct) -> None:
        self._outbox.send(self._encoder.encode(message), copy=False)

    def close(self) -> None:
        self._closing.set()
        self._receiver.join()
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
