"""KV-cache events in vLLM's wire format (issue 31).

The subscriber side is written only against vLLM's published schema: the structs below are
declared as vLLM declares them (its examples/online_serving/kv_events_subscriber.py, and the
current vllm/distributed/kv_events.py, whose BlockStored adds ``lora_name``), and the router's
block hashes are computed from the scheme the docs give, not with tokenline's code.
"""

from __future__ import annotations

import hashlib
import random
import time
from array import array
from typing import Any

import cbor2
import msgspec
import pytest
import zmq
from msgspec.msgpack import Decoder
from prometheus_client import REGISTRY
from scheduler_testkit import fake_seq

from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine
from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.kv_events import KVEventPublisher, attach
from tokenline.scheduler.sequence import Sequence
from tokenline.settings import Settings

ExternalBlockHash = bytes | int


# ── vLLM's schema, as its example subscriber declares it ───────────────────────────────────────
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ── current vLLM's BlockStored: lora_name required, more fields with defaults ─────────────────
class CurrentBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class CurrentKVEventBatch(EventBatch):
    events: list[CurrentBlockStored | BlockRemoved | AllBlocksCleared]


DECODE = Decoder(type=KVEventBatch)
DECODE_CURRENT = Decoder(type=CurrentKVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# ── the documented block hash schemes, written from the docs ──────────────────────────────────
def doc_blake2b(parent: bytes | None, tokens: list[int]) -> bytes:
    digest = hashlib.blake2b(parent or b"", digest_size=32)
    digest.update(array("q", tokens).tobytes())  # int64 little-endian on every machine we run
    return digest.digest()


def doc_sha256_cbor(seed: str):
    def sha(value: object) -> bytes:
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    none_hash = sha(seed)
    return lambda parent, tokens: sha((parent or none_hash, tuple(tokens), None))


def published(digest: bytes) -> int:
    """vLLM's default ExternalBlockHash: the digest as a big-endian int, low 64 bits."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def router_hashes(hasher, tokens: list[int], block_size: int) -> list[int]:
    out, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hasher(parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(published(parent))
    return out


# ── helpers ───────────────────────────────────────────────────────────────────────────────────
def computed(pool: BlockPool, seq: Sequence, num_tokens: int) -> None:
    pool.grow(seq, num_tokens)
    seq.num_computed += num_tokens
    pool.cache_full_blocks(seq)


def subscribe(ctx: zmq.Context, publisher: KVEventPublisher, topic: bytes = b"kv@") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(publisher.endpoint)
    before = publisher.subscriptions
    deadline = time.monotonic() + 5
    while publisher.poll_subscriptions() <= before:  # XPUB shows when the SUB has joined
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        time.sleep(0.005)
    return sub


def receive(sub: zmq.Socket, until_seq: int) -> list[tuple[bytes, int, bytes]]:
    got: list[tuple[bytes, int, bytes]] = []
    while not got or got[-1][1] < until_seq:
        assert sub.poll(5000), f"no message after seq {got[-1][1] if got else None}"
        topic, seq, payload = sub.recv_multipart()
        assert len(seq) == 8
        got.append((topic, int.from_bytes(seq, "big"), payload))
    return got


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol from the client side: the start seq in a REQ envelope, then
    ``[seq, payload]`` replies until ``[-1, b""]``. A DEALER, since a REQ takes only the first
    of several replies (vLLM's example subscriber's REQ has that limit against vLLM too)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while True:
        assert dealer.poll(5000), "replay never ended"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if not payload:
            assert seq == END_SEQ
            break
        out.append((int.from_bytes(seq, "big"), payload))
    dealer.close()
    return out


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


# ── wire format ───────────────────────────────────────────────────────────────────────────────
def test_a_vllm_subscriber_decodes_every_event_over_zmq(ctx):
    bs = 4
    pool = BlockPool(6, bs)  # 5 usable blocks: the third prompt evicts
    pub = KVEventPublisher(
        pool, "tcp://127.0.0.1:*", topic="kv@10.0.0.7@tiny", medium="GPU", context=ctx
    )
    sub = subscribe(ctx, pub)
    a = fake_seq("a", 9, prompt_ids=list(range(1, 10)))
    computed(pool, a, 9)  # 2 full blocks
    pub.flush()
    pool.release(a)
    b = fake_seq("b", 13, prompt_ids=[50 + i for i in range(13)])
    computed(pool, b, 13)  # 3 full blocks: one of a's is evicted
    pub.flush()
    pool.release(b)
    assert pool.clear_cache()
    pub.flush()
    msgs = receive(sub, pub.seq - 1)
    assert [seq for _, seq, _ in msgs] == list(range(pub.seq))
    assert {topic for topic, _, _ in msgs} == {b"kv@10.0.0.7@tiny"}
    batches = [DECODE.decode(payload) for _, _, payload in msgs]
    current = [DECODE_CURRENT.decode(payload) for _, _, payload in msgs]
    events = [e for batch in batches for e in batch.events]
    assert [type(e).__name__ for e in events] == [
        "AllBlocksCleared",  # the publisher's first word: this pod holds nothing yet
        "BlockStored",
        "BlockRemoved",
        "BlockStored",
        "AllBlocksCleared",
    ]
    ha = router_hashes(doc_blake2b, a.prompt_ids, bs)
    hb = router_hashes(doc_blake2b, b.prompt_ids, bs)
    assert events[1] == BlockStored(ha, None, list(range(1, 9)), bs, None, "GPU")
    assert events[2] == BlockRemoved([ha[1]], "GPU")  # a's tail went first
    assert events[3] == BlockStored(hb, None, b.prompt_ids[:12], bs, None, "GPU")
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in ha + hb)
    assert all(b.ts > 1e9 and b.data_parallel_rank is None for b in batches)
    stored = current[0].events[1]
    assert stored.lora_name is None and stored.block_hashes == ha
    pub.close()


def test_a_stored_event_names_its_parent_when_a_chain_grows(ctx):
    bs = 4
    pool = BlockPool(16, bs)
    pub = KVEventPublisher(pool, "inproc://kv-chain", topic="kv@p@m", context=ctx)
    sub = subscribe(ctx, pub)
    seq = fake_seq("a", 6, prompt_ids=[7] * 6)
    computed(pool, seq, 6)
    pub.flush()
    seq.output_ids += [8, 9, 10]
    computed(pool, seq, 3)  # decode fills the second block
    pub.flush()
    events = [e for _, _, p in receive(sub, pub.seq - 1) for e in DECODE.decode(p).events]
    h = router_hashes(doc_blake2b, seq.prompt_ids + seq.output_ids, bs)
    assert events[1:] == [
        BlockStored([h[0]], None, [7, 7, 7, 7], bs, None, "GPU"),
        BlockStored([h[1]], h[0], [7, 7, 8, 9], bs, None, "GPU"),
    ]
    pub.close()


def test_clear_is_refused_while_a_block_is_referenced():
    pool = BlockPool(8, 4)
    pool.events = []
    seq = fake_seq("a", 8, prompt_ids=list(range(8)))
    computed(pool, seq, 8)
    assert not pool.clear_cache() and pool.num_cached == 2
    pool.release(seq)
    assert pool.clear_cache() and pool.num_cached == 0 and pool.num_free == 7
    assert pool.events[-1] == ("cleared",)


def test_sha256_cbor_names_blocks_as_vllm_with_the_same_seed():
    pool = BlockPool(8, 4)
    pool.use_hash("sha256_cbor", "42")
    seq = fake_seq("a", 9, prompt_ids=list(range(100, 109)))
    computed(pool, seq, 9)
    expected = doc_sha256_cbor("42")
    first = expected(None, list(range(100, 104)))
    assert seq.block_hashes == [first, expected(first, list(range(104, 108)))]
    with pytest.raises(RuntimeError):
        pool.use_hash("blake2b")  # names already given; a second scheme would never match


def test_events_are_off_by_default():
    settings = Settings()
    pool = BlockPool(8, 4)
    assert attach(settings, pool, "cpu") is None and pool.events is None
    seq = fake_seq("a", 8, prompt_ids=list(range(8)))
    computed(pool, seq, 8)
    assert pool.events is None


# ── replay and drops ──────────────────────────────────────────────────────────────────────────
def test_replay_after_a_subscriber_restart_loses_nothing(ctx):
    pool = BlockPool(64, 4)
    pub = KVEventPublisher(
        pool, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv@p@m", context=ctx
    )
    sub = subscribe(ctx, pub)
    prompts = [[i * 100 + j for j in range(9)] for i in range(10)]
    for i, prompt in enumerate(prompts[:4]):
        computed(pool, fake_seq(f"s{i}", 9, prompt_ids=prompt), 9)
        pub.flush()
    first = receive(sub, pub.seq - 1)
    last_seq = first[-1][1]
    sub.close()  # the subscriber restarts; meanwhile the engine goes on
    for i, prompt in enumerate(prompts[4:], 4):
        computed(pool, fake_seq(f"s{i}", 9, prompt_ids=prompt), 9)
        pub.flush()
    sub = subscribe(ctx, pub)
    caught_up = replay(ctx, pub.replay_endpoint, last_seq + 1)
    assert [seq for seq, _ in caught_up] == list(range(last_seq + 1, pub.seq))
    stored = [
        e.block_hashes
        for payload in [p for _, _, p in first] + [p for _, p in caught_up]
        for e in DECODE.decode(payload).events
        if isinstance(e, BlockStored)
    ]
    assert stored == [router_hashes(doc_blake2b, p, 4) for p in prompts]
    # and live delivery carries on where the replay ended
    computed(pool, fake_seq("late", 9, prompt_ids=list(range(5000, 5009))), 9)
    pub.flush()
    assert receive(sub, pub.seq - 1)[-1][1] == pub.seq - 1
    pub.close()


def test_a_full_subscriber_queue_drops_counted_as_a_gap_that_replay_fills(ctx):
    pool = BlockPool(4096, 4)
    pub = KVEventPublisher(
        pool, "inproc://kv-hwm", "inproc://kv-hwm-replay", topic="kv@p@m", hwm=1, context=ctx
    )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    while not pub.poll_subscriptions():
        time.sleep(0.005)
    metric_before = REGISTRY.get_sample_value("tokenline_kv_events_dropped_total") or 0.0
    started = time.perf_counter()
    for i in range(50):  # nobody reads: the queue fills within a few batches
        computed(pool, fake_seq(f"s{i}", 4, prompt_ids=[i * 10 + 1] * 4), 4)
        pub.flush()
    assert time.perf_counter() - started < 1.0, "a full subscriber made the publisher block"
    assert pub.dropped > 0
    metric = REGISTRY.get_sample_value("tokenline_kv_events_dropped_total")
    assert metric - metric_before == pub.dropped
    seen = []
    while sub.poll(100):
        _, seq, _ = sub.recv_multipart()
        seen.append(int.from_bytes(seq, "big"))
    assert seen == sorted(seen) and len(seen) == pub.seq - pub.dropped
    gaps = sorted(set(range(pub.seq)) - set(seen))
    assert len(gaps) == pub.dropped  # every drop is a visible hole in the sequence
    replayed = dict(replay(ctx, pub.replay_endpoint, gaps[0]))
    assert all(seq in replayed for seq in gaps)
    pub.close()


# ── routing: 3 replicas, a router that only hears events and hashes prompts ───────────────────
class SimRouter:
    """An llm-d-style indexer: block hash -> pods, fed only by the published events."""

    def __init__(self, hasher, block_size: int) -> None:
        self.hasher = hasher
        self.block_size = block_size
        self.pods: dict[str, set[int]] = {}
        self.last_seq: dict[str, int] = {}
        self.removed = 0

    def apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        pod = topic.decode().split("@")[1]
        assert seq == self.last_seq.get(pod, -1) + 1, f"{pod}: a gap before {seq}"
        self.last_seq[pod] = seq
        blocks = self.pods.setdefault(pod, set())
        for event in DECODE.decode(payload).events:
            if isinstance(event, BlockStored):
                blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                blocks.difference_update(event.block_hashes)
                self.removed += len(event.block_hashes)
            else:
                blocks.clear()

    def predict(self, pod: str, tokens: list[int]) -> int:
        """Cached tokens the pod will report: its longest cached prefix of full blocks, short
        of the prompt's last token (which an engine always computes)."""
        usable = (len(tokens) - 1) // self.block_size
        hits = 0
        for h in router_hashes(self.hasher, tokens, self.block_size)[:usable]:
            if h not in self.pods.get(pod, ()):
                break
            hits += 1
        return hits * self.block_size


@pytest.mark.parametrize("algo", ["blake2b", "sha256_cbor"])
def test_a_router_hearing_events_predicts_each_replicas_cached_tokens(ctx, make_engine, algo):
    seed = "1234"
    engines: dict[str, Engine] = {}
    pubs: dict[str, KVEventPublisher] = {}
    for i in range(3):
        engine = make_engine(kv_blocks=24)  # small: long conversations evict
        engine.pool.use_hash(algo, seed)
        pod = f"10.0.0.{i + 1}"
        engines[pod] = engine
        pubs[pod] = KVEventPublisher(
            engine.pool, "tcp://127.0.0.1:*", topic=f"kv@{pod}@tiny", context=ctx
        )
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    for pub in pubs.values():
        sub.connect(pub.endpoint)
        while not pub.poll_subscriptions():
            time.sleep(0.005)
    block_size = next(iter(engines.values())).pool.block_size
    router = SimRouter(doc_blake2b if algo == "blake2b" else doc_sha256_cbor(seed), block_size)

    def sync() -> None:
        for pod, pub in pubs.items():
            while router.last_seq.get(pod, -1) < pub.seq - 1:
                assert sub.poll(5000)
                topic, seq, payload = sub.recv_multipart()
                router.apply(topic, int.from_bytes(seq, "big"), payload)

    rng = random.Random(31)
    vocab = next(iter(engines.values())).runner.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(40)]
    conversations = [
        (system if c % 2 == 0 else [])
        + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 30))]
        for c in range(8)
    ]
    checked = hits = 0
    for turn in range(4):
        for c in rng.sample(range(len(conversations)), len(conversations)):
            prompt = conversations[c]
            sync()
            predicted = {pod: router.predict(pod, prompt) for pod in engines}
            # each pod's own view agrees, before anything runs: a lookup changes nothing
            for pod, engine in engines.items():
                probe = Sequence(
                    uid="probe", prompt_ids=prompt, sampling=SamplingParams(), max_tokens=1
                )
                assert len(engine.pool.lookup(probe)) * block_size == predicted[pod], pod
            best = max(predicted.values())
            # route to the best pod; a quarter of requests go anywhere, so caches diverge
            if rng.random() < 0.25:
                pod = rng.choice(sorted(engines))
            else:
                pod = rng.choice(sorted(p for p in engines if predicted[p] == best))
            engine = engines[pod]
            uid = f"c{c}t{turn}"
            engine.add(uid, prompt, SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 9)))
            reported, output = None, []
            while engine.has_work():
                for out in engine.step():
                    if out.uid == uid:
                        reported = out.cached_tokens if reported is None else reported
                        output += out.token_ids
                pubs[pod].flush()  # as the stage does after every step
            assert reported == predicted[pod], (uid, pod, reported, predicted)
            checked += 1
            hits += reported > 0
            conversations[c] = (
                prompt + output + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 20))]
            )
    sync()
    # the workload exercised what matters: reuse across turns, and eviction under pressure
    assert checked == 32 and hits >= 8 and router.removed > 0
    for pub in pubs.values():
        pub.close()
