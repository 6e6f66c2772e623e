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

The claim cannot stop a client that names a host of its own, though: a side channel there grants
anything, and the decode pod would cache the KV it reads under the prompt's block names, for
every later request of that prompt. With ``side_channel_keys`` (config.py) both ends speak
CurveZMQ with the service's keys, as the stage ring does (ring_security.py): the prefill pod
admits only readers holding them (ZAP), and a decode pod completes a handshake only with a pod
holding the secret, so it neither reads from nor caches anything of another. ZeroMQ drops a
failed handshake silently; the reader watches its socket's handshake events, so such a peer
fails its read at once (``Unauthenticated``) rather than after the hello's timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenline.ring_security import RingSecurity, is_local
from tokenline.scheduler.kv_transfer.link import KVLayout

log = logging.getLogger(__name__)


class Hello(msgspec.Struct, tag="hello"):
    layout: KVLayout  # the reader's, checked against the owner's


class RankKV(msgspec.Struct):
    """Another rank of a tensor-parallel owner: its NIXL agent over its share of the heads."""

    metadata: bytes
    layout: KVLayout


class Welcome(msgspec.Struct, tag="welcome"):
    metadata: bytes  # the owner's NIXL agent (rank 0's, under tensor parallelism)
    layout: KVLayout
    engine_id: str  # the owner's, as its responses name it: a restart shows as another
    refusal: str = ""  # why the reader cannot read here; "" when it can
    claims: bool = False  # the owner checks claims (an older one neither answers nor checks)
    ranks: list[RankKV] = []  # ranks 1.. of a tensor-parallel owner, read beside rank 0

    def agents(self) -> list[tuple[bytes, KVLayout]]:
        """Every rank's agent and layout, rank 0 first: a read reads each."""
        return [(self.metadata, self.layout), *((r.metadata, r.layout) for r in self.ranks)]


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


# Owners this pod keeps sockets to at once. Their addresses are clients' input (any request's
# kv_transfer_params name one, live or not, and ZeroMQ reconnects to a dead one for ever), so a
# socket to one more closes the least recently used idle owner's; a live one is connected anew
# when next asked.
MAX_PEERS = 64

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Hello | Welcome | Claim | Grant | Release)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
UNSIGNED = (
    "kv transfer: the side channel is not authenticated: any client that can reach a decode "
    "pod's API can make it read KV from a host the client names in kv_transfer_params, and "
    "cache that KV for other users' requests of the same prompt. Give every prefill and decode "
    "pod of the service the same keys: `tokenline ring-keys --out DIR`, then "
    '"kv_connector_extra_config": {"side_channel_keys": "DIR"} (%s)'
)


class Unauthenticated(ConnectionError):
    """The peer failed the side channel's handshake: it holds other keys, or none, or asks for
    keys this pod lacks. Nothing of it is read."""


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
        keys: str | None = None,
        ranks: list[RankKV] | None = None,
    ) -> None:
        self.metadata = metadata
        self.layout = layout
        self.ranks = ranks or []
        self.engine_id = engine_id
        self.claims = claims
        self._releases: deque[Release] = deque()
        # a context of its own: its ZAP handler admits the side channel's keys, not the ring's
        self._context = zmq.Context()
        security = RingSecurity(curve_keys=keys)
        self._authenticator = security.start_authenticator(self._context)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        security.serve(self._socket)
        self._socket.bind(f"tcp://{host}:{port or '*'}")  # 0: a port of the system's choice
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        if keys is None and not is_local(self.address):
            log.warning(UNSIGNED, f"the side channel binds {self.address}")
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
            layouts = [self.layout, *(r.layout for r in self.ranks)]
            refusal = next((m for m in map(message.layout.mismatch, layouts) if m), "")
            if refusal:
                log.warning("kv side channel: a reader refused: %s", refusal)
            reply = Welcome(
                self.metadata, self.layout, self.engine_id, refusal, True, list(self.ranks)
            )
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
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()


class SideChannelClient:
    """The reader's end, used from one worker thread: one socket per owner, and a monitor of
    its handshakes, for ``max_peers`` owners at most (least recently used first out)."""

    def __init__(self, keys: str | None = None, max_peers: int | None = None) -> None:
        max_peers = MAX_PEERS if max_peers is None else max_peers
        if max_peers < 1:
            raise ValueError(f"max_peers is {max_peers}: give the side channel 1 or more")
        self._context = zmq.Context.instance()
        self._security = RingSecurity(curve_keys=keys)
        # least recently used first: the next to close when another owner needs a socket
        self._sockets: OrderedDict[tuple[str, int], tuple[zmq.Socket, zmq.Socket]] = OrderedDict()
        self._max_peers = max_peers
        self._asking: set[tuple[str, int]] = set()  # a question in flight: never closed under it
        self._warned = keys is not None

    def _peer(self, host: str, port: int) -> tuple[zmq.Socket, zmq.Socket]:
        peer = self._sockets.get((host, port))
        if peer is not None:
            self._sockets.move_to_end((host, port))
            return peer
        self._make_room()
        endpoint = f"tcp://{host}:{port}"
        if not self._warned and not is_local(endpoint):
            self._warned = True
            log.warning(UNSIGNED, f"this pod reads from {host}:{port}")
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)
        self._security.connect(socket)
        monitor = socket.get_monitor_socket(_HANDSHAKE_FAILED)
        socket.connect(endpoint)
        peer = self._sockets[host, port] = (socket, monitor)
        return peer

    def _make_room(self) -> None:
        """Closes the least recently used idle owners' sockets until one more fits."""
        while len(self._sockets) >= self._max_peers:
            idle = next((peer for peer in self._sockets if peer not in self._asking), None)
            if idle is None:  # each awaits an answer: one over the cap until they end
                return
            # a release still queued there is lost: that owner's lease frees its blocks
            log.debug("kv side channel: %s:%s is closed to make room for another", *idle)
            self.drop(*idle)

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
        self._asking.add((host, port))
        try:
            return self._exchange(host, port, message, timeout_s)
        finally:
            self._asking.discard((host, port))

    def _exchange(self, host: str, port: int, message: msgspec.Struct, timeout_s: float) -> object:
        socket, monitor = self._peer(host, port)
        socket.send(_encoder.encode(message))
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while socket not in (ready := dict(poller.poll(_ms_until(deadline)))):
            # ZeroMQ drops the message, or retries the handshake for ever, silently; a stale
            # event (a peer that restarted mid-handshake) costs one read at most
            if monitor in ready:
                event = zmq.Event(recv_monitor_message(monitor)["event"]).name
                self.drop(host, port)
                raise Unauthenticated(self._unauthenticated(host, port, event))
            if time.monotonic() >= deadline:
                self.drop(host, port)  # a late answer must not be read as the next one's
                raise TimeoutError(
                    f"the prefill pod at {host}:{port} is silent after {timeout_s:g} s"
                )
        try:
            return _decoder.decode(socket.recv())
        except msgspec.DecodeError:
            self.drop(host, port)
            raise

    def _unauthenticated(self, host: str, port: int, event: str) -> str:
        if self._security.curve:
            return (
                f"the side channel at {host}:{port} failed the CurveZMQ handshake ({event}): it "
                "does not hold this service's side_channel_keys, so nothing is read from it (if "
                "it is one of the service's prefill pods, give it the same directory)"
            )
        return (
            f"the side channel at {host}:{port} refused the handshake ({event}): it asks for "
            "CurveZMQ; give this pod the service's kv_connector_extra_config.side_channel_keys"
        )

    def release(self, host: str, port: int, release: Release) -> None:
        try:  # never waits: a peer that cannot take it lets its blocks go with the lease
            self._peer(host, port)[0].send(_encoder.encode(release), zmq.NOBLOCK)
        except zmq.Again:
            log.warning(
                "kv side channel: %s:%s takes no release now; its lease frees it", host, port
            )

    def drop(self, host: str, port: int) -> None:
        peer = self._sockets.pop((host, port), None)
        if peer is not None:
            _close(*peer, linger=0)

    def close(self) -> None:
        for socket, monitor in self._sockets.values():
            _close(socket, monitor, linger=None)
        self._sockets.clear()


def _close(socket: zmq.Socket, monitor: zmq.Socket, linger: int | None) -> None:
    socket.disable_monitor()
    monitor.close(linger=0)
    socket.close(linger=linger)


def _ms_until(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000) + 1)
