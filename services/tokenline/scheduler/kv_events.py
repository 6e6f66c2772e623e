"""KV-cache events in vLLM's wire format, so cache-aware routers (llm-d's precise prefix-cache
scorer, Dynamo-style KV routers) can route to the replica that holds a prompt's prefix.

Wire format, as vLLM's ``ZmqEventPublisher`` sends it: each batch is one multipart message
``[topic, sequence number as 8-byte big-endian, msgpack(KVEventBatch)]``; the batch and its
events are msgspec structs encoded array-like and tagged by class name, so a subscriber that
declares vLLM's structs decodes them unchanged. Block hashes go out as vLLM sends them by
default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the low 64 bits of the block's name, an
unsigned int, which is what llm-d's indexer keys on.

Publishing never holds up a step: the pool records events as tuples, ``flush`` (after each
step) turns them into one batch, encodes it and sends it with NOBLOCK. The socket is an XPUB
with ``XPUB_NODROP``, a PUB to every subscriber, except that a subscriber whose queue is at the
high-water mark makes the send fail with EAGAIN instead of dropping silently as a PUB does: the
batch is then counted in ``tokenline_kv_events_dropped_total`` and skipped, and its sequence
number stays used, so the subscriber sees a gap and asks the replay socket for it.

Replay (vLLM's protocol): a ROUTER answers a request ``[start sequence, 8-byte big-endian]``
(from a REQ or DEALER) with ``[seq, payload]`` for each kept batch from ``start`` on, then
``[-1 as signed 8-byte big-endian, b""]``. The last ``buffer_steps`` batches are kept, dropped
ones included, so a drop is recovered while it is in the window. A thread of its own answers,
so a subscriber's catch-up never lengthens a step.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from tokenline.metrics import KV_EVENTS_DROPPED
from tokenline.scheduler.kv_cache import CLEARED, REMOVED, STORED, BlockPool

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MASK64 = (1 << 64) - 1


# ── vLLM's schema (vllm/distributed/kv_events.py), field for field ──────────────────────────────
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag is the class name, as vLLM's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    # Current vLLM declares it without a default, so its decoder needs it; older decoders
    # (vLLM's example subscriber) ignore trailing fields.
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(name: bytes) -> int:
    """A block name as vLLM publishes it by default: ``int.from_bytes(name, "big")`` masked to
    64 bits, which is its last 8 bytes read big-endian."""
    return int.from_bytes(name[-8:], "big")


def default_topic(model: str) -> str:
    """``kv@<pod>@<model>``, the topic llm-d parses; the pod is its IP when the pod is told it
    (``POD_IP``, from the downward API), as llm-d's guides name pods, else the host name."""
    pod = os.environ.get("POD_IP") or socket.gethostname()
    return f"kv@{pod}@{model}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: an endpoint with a wildcard host, or an ipc/inproc one, is bound; any other
    is connected to (llm-d's central mode: every pod connects to the picker's SUB)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes ``pool``'s events; ``flush`` after every step sends what the step did."""

    def __init__(
        self,
        pool: BlockPool,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        hwm: int = 100_000,
        buffer_steps: int = 10_000,
        medium: str = "GPU",
        data_parallel_rank: int | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self.topic = topic.encode()
        self.seq = 0  # the next batch's sequence number
        self.dropped = 0
        self.subscriptions = 0  # subscribe messages seen, ever
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()  # the buffer, shared with the replay thread
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        # every subscribe is passed up, not only a topic's first: each one joining is seen
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.LINGER, 0)
        if binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self.replay_endpoint: str | None = None
        self._closed = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(router,), name="kv-events-replay", daemon=True
            )
            self._replay_thread.start()
        pool.events = []
        # A restarted scheduler holds nothing; an indexer still holding this pod's blocks from
        # the previous process learns that first.
        pool.events.append((CLEARED,))

    # ── the step's side ────────────────────────────────────────────────────────────────────────
    def flush(self) -> None:
        """Send the events recorded since the last flush as one batch; never blocks."""
        events = self.pool.events
        if not events:
            return
        self.pool.events = []
        batch = KVEventBatch(
            ts=time.time(),  # vLLM stamps wall-clock time; subscribers only log it
            events=self._convert(events),
            data_parallel_rank=self.data_parallel_rank,
        )
        payload = self._encoder.encode(batch)
        seq = self.seq
        self.seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        self.poll_subscriptions()
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            # a subscriber is at the high-water mark: its sequence gap says so, and replay
            # still has the batch
            self.dropped += 1
            KV_EVENTS_DROPPED.inc()

    def _convert(self, events: list[tuple]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        removed: list[int] = []  # consecutive removals share one event
        for event in events:
            kind = event[0]
            if kind == REMOVED:
                removed.append(external_hash(event[1]))
                continue
            if removed:
                out.append(BlockRemoved(block_hashes=removed, medium=self.medium))
                removed = []
            if kind == STORED:
                _, names, parent, token_ids, lora = event
                out.append(
                    BlockStored(
                        block_hashes=[external_hash(n) for n in names],
                        parent_block_hash=None if parent is None else external_hash(parent),
                        token_ids=token_ids,
                        block_size=self.block_size,
                        lora_id=None,
                        medium=self.medium,
                        lora_name=lora,
                    )
                )
            elif kind == CLEARED:
                out.append(AllBlocksCleared())
        if removed:
            out.append(BlockRemoved(block_hashes=removed, medium=self.medium))
        return out

    def poll_subscriptions(self) -> int:
        """Read the XPUB's (un)subscribe messages, so they never pile up; returns how many
        subscribes it has seen (a test waits for one before it expects live delivery)."""
        while self._pub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            if self._pub.recv(zmq.NOBLOCK)[:1] == b"\x01":
                self.subscriptions += 1
        return self.subscriptions

    # ── replay ─────────────────────────────────────────────────────────────────────────────────
    def _serve_replay(self, router: zmq.Socket) -> None:
        try:
            while not self._closed.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                # [identity, empty delimiter (REQ), start seq]; a DEALER may omit the delimiter
                if len(frames) == 3 and not frames[1]:
                    identity, start_bytes = frames[0], frames[2]
                elif len(frames) == 2:
                    identity, start_bytes = frames
                else:
                    log.warning("kv events: malformed replay request of %d frames", len(frames))
                    continue
                start = int.from_bytes(start_bytes, "big")
                with self._lock:
                    kept = [item for item in self._buffer if item[0] >= start]
                for seq, payload in kept:
                    router.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
                router.send_multipart((identity, b"", END_SEQ, b""))
        except zmq.ZMQError:  # the context went away under us: the process is ending
            return
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._closed.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=1.0)
        self._pub.close(linger=0)
        if self.pool.events is not None:
            self.pool.events = None


def attach(settings: Any, pool: BlockPool, device: str) -> KVEventPublisher | None:
    """Configure the scheduler's pool from its settings: the block hash scheme, and a publisher
    when ``--kv-events-endpoint`` is set (returned; None when off)."""
    pool.use_hash(settings.prefix_caching_hash_algo, os.environ.get("PYTHONHASHSEED"))
    if not settings.kv_events_endpoint:
        return None
    publisher = KVEventPublisher(
        pool,
        settings.kv_events_endpoint,
        settings.kv_events_replay_endpoint,
        settings.kv_events_topic or default_topic(settings.model_name),
        settings.kv_events_hwm,
        settings.kv_events_buffer_steps,
        medium="GPU" if device == "cuda" else "CPU",
    )
    log.info(
        "KV-cache events on %s (replay %s), topic %r, block hashes %s",
        publisher.endpoint,
        publisher.replay_endpoint or "off",
        publisher.topic.decode(),
        pool.hash_algo,
    )
    return publisher
