"""ZeroMQ sockets for the ring, built from configured endpoints.

Each stage binds a PULL socket on its own endpoint (its inbox) and connects a PUSH socket to the
next stage's endpoint (its outbox). Frames are MessagePack; a frame that fails to decode is
counted in ``tokenline_malformed_frames_total`` and dropped, never raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from tokenline import protocol
from tokenline.metrics import MALFORMED_FRAMES
from tokenline.ring_security import RingSecurity

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


_PEER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class PeerConnections:
    """Whether a socket's peer is connected, from the socket's ZMQ monitor events.

    A peer that exits, crashes or is killed has its connections closed by the kernel, so this
    flips within milliseconds; a peer that hangs keeps them open (the heartbeat catches it).
    Connections are counted by file descriptor: a bound socket may see a stray connection
    (a port scan) come and go without its real peer changing.
    """

    def __init__(self) -> None:
        self._fds: set[int] = set()

    @property
    def up(self) -> bool:
        return bool(self._fds)

    def on_event(self, frames: list[bytes]) -> bool | None:
        """Apply one monitor event; the new state when it changed, else None."""
        event = parse_monitor_message(frames)
        was = self.up
        if event["event"] in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
            self._fds.add(int(event["value"]))
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self._fds.discard(int(event["value"]))
        return self.up if self.up != was else None


@dataclass(frozen=True)
class UpstreamLink:
    """Put on a stage's inbox queue when the connection from its upstream peer opens or
    closes; the stage runtime turns it into a `protocol.Link` report."""

    up: bool


class SyncRing:
    """Sockets for the tokenizer, scheduler and detokenizer loops.

    A receiver thread owns the inbox: it takes each frame off the socket as it arrives and
    stamps its arrival time, so a message that waits while the stage is busy (a model step)
    is counted as time in that stage, and the stage's loop never blocks on the socket.
    """

    def __init__(
        self, stage: str, endpoints: RingEndpoints, security: RingSecurity | None = None
    ) -> None:
        self.stage = stage
        security = security or RingSecurity()
        self._bound = endpoints.of(stage)
        security.check(stage, [self._bound, endpoints.of(NEXT_STAGE[stage])])
        self._ctx = zmq.Context()
        self._authenticator = security.start_authenticator(self._ctx)
        self._inbox = self._ctx.socket(zmq.PULL)
        _configure(self._inbox, zmq.RCVHWM)
        security.serve(self._inbox)
        self._inbox_monitor = self._inbox.get_monitor_socket(_PEER_EVENTS)
        self._upstream = PeerConnections()
        self._inbox.bind(self._bound)
        self._outbox = self._ctx.socket(zmq.PUSH)
        _configure(self._outbox, zmq.SNDHWM)
        security.connect(self._outbox)
        self._outbox.connect(endpoints.of(NEXT_STAGE[stage]))
        self._decoder = _Decoder(stage)
        self._encoder = msgspec.msgpack.Encoder()
        # queue.Queue, not SimpleQueue: CPython's SimpleQueue.get(timeout) turns into a wait
        # without end when a signal handler (our SIGTERM drain) runs past the timeout, and a
        # stage that is draining never wakes up again once its peers are gone.
        self._arrived: queue.Queue[tuple[float, msgspec.Struct | UpstreamLink]] = queue.Queue()
        self._held: list[tuple[float, msgspec.Struct | UpstreamLink]] = []  # taken by poll()
        self._closing = threading.Event()
        self._receiver = threading.Thread(target=self._receive, name=f"{stage}-inbox", daemon=True)
        self._receiver.start()

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        poller.register(self._inbox_monitor, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                ready = dict(poller.poll(100))
                if self._inbox_monitor in ready:
                    changed = self._upstream.on_event(self._inbox_monitor.recv_multipart())
                    if changed is not None:
                        self._arrived.put((time.monotonic(), UpstreamLink(changed)))
                if self._inbox not in ready:
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
            self._inbox.disable_monitor()
            self._inbox_monitor.close()
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

    def recv_timed(self, limit: int = 10_000) -> list[tuple[float, msgspec.Struct | UpstreamLink]]:
        """Every waiting message (up to ``limit``) with its monotonic arrival time; link
        changes of the upstream peer come in order among them."""
        items, self._held = self._held[:limit], self._held[limit:]
        while len(items) < limit:
            try:
                items.append(self._arrived.get_nowait())
            except queue.Empty:
                break
        return items

    def send(self, message: msgspec.Struct) -> None:
        self._outbox.send(self._encoder.encode(message), copy=False)

    def close(self) -> None:
        self._closing.set()
        self._receiver.join()
        _remove_ipc_file(self._bound)
        self._outbox.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.term()


class AsyncRing:
    """asyncio sockets for the api: it sends to the tokenizer and hears from the detokenizer."""

    def __init__(self, endpoints: RingEndpoints, security: RingSecurity | None = None) -> None:
        security = security or RingSecurity()
        self._bound = endpoints.api
        security.check("api", [self._bound, endpoints.tokenizer])
        self._ctx = zmq.asyncio.Context()
        self._authenticator = security.start_authenticator(self._ctx)
        self._inbox = self._ctx.socket(zmq.PULL)
        _configure(self._inbox, zmq.RCVHWM)
        security.serve(self._inbox)
        self._inbox_monitor = self._inbox.get_monitor_socket(_PEER_EVENTS)
        self._inbox.bind(self._bound)
        # A plain socket: sends never wait, so no future is left unobserved.
        self._sync_ctx = zmq.Context()
        self._outbox = self._sync_ctx.socket(zmq.PUSH)
        _configure(self._outbox, zmq.SNDHWM)
        security.connect(self._outbox)
        self._outbox_monitor = zmq.asyncio.Socket.from_socket(
            self._outbox.get_monitor_socket(_PEER_EVENTS)
        )
        self._outbox.connect(endpoints.tokenizer)
        self._decoder = _Decoder("api")
        self._encoder = msgspec.msgpack.Encoder()

    async def recv(self) -> msgspec.Struct | None:
        """The next message; None for a malformed frame (already counted)."""
        frame = await self._inbox.recv(copy=True)
        return self._decoder.decode(frame)

    async def watch_peers(self, on_change: Callable[[str, bool], None]) -> None:
        """Call ``on_change(stage, up)`` whenever the tokenizer (the outbox's peer) or the
        detokenizer (the inbox's peer) connects or goes away. Runs until cancelled."""

        async def watch(monitor: zmq.asyncio.Socket, stage: str) -> None:
            peer = PeerConnections()
            while True:
                changed = peer.on_event(await monitor.recv_multipart())
                if changed is not None:
                    on_change(stage, changed)

        await asyncio.gather(
            watch(self._outbox_monitor, "tokenizer"), watch(self._inbox_monitor, "detokenizer")
        )

    def encode(self, message: msgspec.Struct) -> bytes:
        """Raises (OverflowError, UnicodeEncodeError) for what MessagePack cannot carry."""
        return self._encoder.encode(message)

    def send_frame(self, frame: bytes) -> None:
        """Queue an encoded message for the tokenizer; never waits (the HWM is far above real
        load)."""
        self._outbox.send(frame, flags=zmq.NOBLOCK, copy=False)

    def send_nowait(self, message: msgspec.Struct) -> None:
        self.send_frame(self._encoder.encode(message))

    def close(self) -> None:
        self._inbox_monitor.close()
        self._outbox_monitor.close()
        self._inbox.close()
        _remove_ipc_file(self._bound)
        self._outbox.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.term()
        self._sync_ctx.term()
