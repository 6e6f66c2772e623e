"""The side channel beside NIXL (vLLM's): a decode pod asks a prefill pod for its NIXL agent and
pool layout, claims the blocks of a request before it reads them, and tells it when it has read
them, so they can go back.

NIXL's reads are one-sided: nothing on the prefill pod sees them. The claim is what stands
between a client that forges ``kv_transfer_params`` and another request's KV: the decode pod
names the request, the blocks it will read, where they lie in the loan, and a digest of the
prompt tokens those blocks were computed from; the prefill pod grants it only for a live loan
that matches (ledger.py) and pins that loan until the reader releases it.

The prefill pod answers on a ZeroMQ ROUTER socket from a thread of its own; it reads the layout
it was given, asks the ledger about claims, and queues the releases, which the scheduler applies
between steps.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from tokenline.scheduler.kv_transfer.link import KVLayout

log = logging.getLogger(__name__)


class Hello(msgspec.Struct, tag="hello"):
    layout: KVLayout  # the reader's, checked against the owner's


class Welcome(msgspec.Struct, tag="welcome"):
    metadata: bytes  # the owner's NIXL agent
    layout: KVLayout
    engine_id: str  # the owner's, as its responses name it: a restart shows as another
    refusal: str = ""  # why the reader cannot read here; "" when it can
    claims: bool = False  # the owner checks claims (an older one neither answers nor checks)


class Claim(msgspec.Struct, tag="claim"):
    """The reader is about to read ``block_ids``, the loan's blocks from position ``first``."""

    request_id: str
    first: int
    block_ids: list[int]
    digest: bytes  # ledger.prefix_digest of the reader's prompt up to the last claimed block
    seconds: float  # how long the read may take: the pin asked for


class Grant(msgspec.Struct, tag="grant"):
    request_id: str
    refusal: str = ""  # why the claim is refused; "" when granted
    reason: str = ""  # the refusal's failures-metric label: "expired" or "claim_refused"
    token: bytes = b""  # the pin's: the reader's Release names it
    pinned_s: float = 0.0  # the pin lasts this long at most unless released sooner


class Release(msgspec.Struct, tag="release"):
    request_id: str
    bytes_read: int = 0  # 0: released unread (the reader gave up or had them cached)
    token: bytes = b""  # a granted claim's, when the reader claimed
    digest: bytes = b""  # ledger.prefix_digest of the prompt's lent blocks, when it did not


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Hello | Welcome | Claim | Grant | Release)


class SideChannelServer:
    """The owner's end: answers hellos and claims (``claims``, called on this thread), queues
    releases for ``take_releases``."""

    def __init__(
        self,
        host: str,
        port: int,
        metadata: bytes,
        layout: KVLayout,
        engine_id: str,
        claims: Callable[[Claim], Grant],
    ) -> None:
        self.metadata = metadata
        self.layout = layout
        self.engine_id = engine_id
        self.claims = claims
        self._releases: deque[Release] = deque()
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{host}:{port or '*'}")  # 0: a port of the system's choice
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart()
            try:  # nothing a peer sends may end the thread: every reader needs it
                self._answer(frames)
            except Exception as exc:
                log.warning("kv side channel: a message that is not ours (%s); ignored", exc)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            raise ValueError(f"{len(frames)} frames")
        peer, payload = frames
        message = _decoder.decode(payload)
        if isinstance(message, Hello):
            refusal = self.layout.mismatch(message.layout)
            if refusal:
                log.warning("kv side channel: a reader refused: %s", refusal)
            reply = Welcome(self.metadata, self.layout, self.engine_id, refusal, claims=True)
            self._socket.send_multipart([peer, _encoder.encode(reply)], zmq.NOBLOCK)
        elif isinstance(message, Claim):
            grant = self.claims(message)
            if grant.refusal:
                log.warning("kv side channel: a claim refused: %s", grant.refusal)
            self._socket.send_multipart([peer, _encoder.encode(grant)], zmq.NOBLOCK)
        elif isinstance(message, Release):
            self._releases.append(message)

    def take_releases(self) -> list[Release]:
        taken = []
        while self._releases:
            taken.append(self._releases.popleft())
        return taken

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close()


class SideChannelClient:
    """The reader's end, used from one worker thread: one socket per owner."""

    def __init__(self) -> None:
        self._context = zmq.Context.instance()
        self._sockets: dict[tuple[str, int], zmq.Socket] = {}

    def _socket(self, host: str, port: int) -> zmq.Socket:
        socket = self._sockets.get((host, port))
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(f"tcp://{host}:{port}")
            self._sockets[host, port] = socket
        return socket

    def hello(self, host: str, port: int, layout: KVLayout, timeout_s: float) -> Welcome:
        reply = self._ask(host, port, Hello(layout), timeout_s)
        if not isinstance(reply, Welcome):
            self.drop(host, port)
            raise RuntimeError(f"the prefill pod at {host}:{port} answered out of turn")
        return reply

    def claim(self, host: str, port: int, claim: Claim, timeout_s: float) -> Grant:
        reply = self._ask(host, port, claim, timeout_s)
        if not isinstance(reply, Grant) or reply.request_id != claim.request_id:
            self.drop(host, port)
            raise RuntimeError(f"the prefill pod at {host}:{port} answered out of turn")
        return reply

    def _ask(self, host: str, port: int, message: msgspec.Struct, timeout_s: float) -> object:
        socket = self._socket(host, port)
        socket.send(_encoder.encode(message))
        if not socket.poll(int(timeout_s * 1000)):
            self.drop(host, port)  # a late answer must not be read as the next one's
            raise TimeoutError(f"the prefill pod at {host}:{port} is silent after {timeout_s:g} s")
        try:
            return _decoder.decode(socket.recv())
        except msgspec.DecodeError:
            self.drop(host, port)
            raise

    def release(self, host: str, port: int, release: Release) -> None:
        try:  # never waits: a peer that cannot take it lets its blocks go with the lease
            self._socket(host, port).send(_encoder.encode(release), zmq.NOBLOCK)
        except zmq.Again:
            log.warning(
                "kv side channel: %s:%s takes no release now; its lease frees it", host, port
            )

    def drop(self, host: str, port: int) -> None:
        socket = self._sockets.pop((host, port), None)
        if socket is not None:
            socket.close(linger=0)

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close()
        self._sockets.clear()
