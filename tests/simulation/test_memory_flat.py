"""Memory stays flat: thousands of mixed requests through the in-memory ring leave every stage
holding what it held before them (issue 34).

The ring is `ring_sim`'s (the real api ring_client, the real stage handlers under their runtimes,
the real engine with a scripted runner) with a grammar compiler added. After a warm-up, the
objects reachable from each stage are counted by type; a few thousand more requests go round
(chat and completions, ``n`` 2, never-seen JSON grammars, stop strings, logprobs, clients that
leave mid-stream, malformed frames, tokenizer calls that are abandoned); the ring settles,
every deadline passes, and the objects are counted again. Bounded caches (grammars, token
texts, the prefix cache) are left out of the count and checked against their bounds instead:
they may fill up, but nothing else may grow.
"""

from __future__ import annotations

import asyncio
import gc
import time
import types
from collections import Counter

import pytest
from ring_sim import RingSim

from tokenline import protocol
from tokenline.api.function_calling.grammars import json_grammar
from tokenline.api.ring.abort_log import AbortLog
from tokenline.bounded import ExpiringSet, LruCache
from tokenline.scheduler.grammar import CACHE_SIZE, GrammarCompiler

WARMUP_REQUESTS = 300
REQUESTS = 2_000
WORDS = ["river", "road", "old", "stone", "blue", "far", "light"]
# Objects that may differ between two idle moments without growing with traffic: the api's
# heartbeat bookkeeping and a few interpreter free lists. A leak of one object per request is
# thousands.
SLACK = 32


@pytest.fixture(scope="module")
def grammars(sim_tokenizer) -> GrammarCompiler:
    compiler = GrammarCompiler(sim_tokenizer)
    yield compiler
    compiler.close()


class MixedRing(RingSim):
    def __init__(self, tokenizer, grammars: GrammarCompiler) -> None:
        self.grammars = grammars
        super().__init__(seed=34, tokenizer=tokenizer)
        self.open: list[tuple[object, int | None]] = []  # (exchange, batches before leaving)
        self.calls: list[asyncio.Task] = []
        self.serial = 0

    def _new_runtime(self, stage: str):
        runtime = super()._new_runtime(stage)
        if stage == "scheduler":
            runtime.handler.engine.grammars = self.grammars
        return runtime

    def request(self) -> None:
        rng = self.rng
        self.serial += 1
        grammar = None
        if rng.random() < 0.5:  # a schema never seen before: a new grammar to build and cache
            name = f"f{self.serial}"
            schema = {"type": "object", "properties": {name: {"type": "integer"}}}
            grammar = json_grammar({**schema, "required": [name]})
        sampling = protocol.SamplingParams(
            max_tokens=rng.randint(1, 10),
            temperature=rng.choice([0.0, 1.0]),
            seed=rng.randint(0, 99),
            stop=[rng.choice(WORDS)] if rng.random() < 0.3 else [],
            logprobs=2 if rng.random() < 0.2 else None,
            grammar=grammar,
        )
        text = " ".join(rng.choices(WORDS, k=rng.randint(0, 12)))
        chat = rng.random() < 0.5

        def build(uid: str, index: int) -> protocol.Generate:
            if chat:
                message = protocol.ChatMessage(role="user", content=text)
                return protocol.Generate(
                    uid=uid, sampling=sampling, timeout_s=30, messages=[message]
                )
            return protocol.Generate(uid=uid, sampling=sampling, timeout_s=30, prompt=text)

        ex = self.ring_client.open([build("", i) for i in range(rng.choice([1, 2]))])
        self.open.append((ex, 0 if rng.random() < 0.1 else None))
        if rng.random() < 0.05:
            link = self.links[rng.choice(list(self.links))]
            link.append(rng.randbytes(rng.randint(0, 12)))
        if rng.random() < 0.03:
            self.calls.append(asyncio.ensure_future(self.tokenize_call(text)))

    async def tokenize_call(self, text: str) -> None:
        def build(uid: str) -> protocol.TokenizeCall:
            return protocol.TokenizeCall(uid=uid, prompt=text)

        try:
            await self.ring_client.call(build)
        except Exception:  # abandoned (cancelled) calls end here too
            pass

    async def drive(self, count: int) -> None:
        sent = 0
        while sent < count or self.open or self.in_flight():
            while sent < count and len(self.open) < 12:
                self.request()
                sent += 1
            await asyncio.sleep(0)  # tokenizer calls send their frames
            if self.calls and self.rng.random() < 0.3:
                self.calls.pop().cancel()  # its client went away before the answer
            for stage in self.links:
                self.deliver(stage, 64)
            runtime = self.runtimes["scheduler"]
            if runtime.has_work():
                runtime.step()
            elif self.scheduler_engine().compiling:
                await asyncio.sleep(0.0005)  # a grammar is being built on the worker thread
            for ex, leaves in list(self.open):
                if ex.depth or ex.done:
                    batch = await ex.next_batch()
                    del batch
                if (ex.done and not ex.depth) or leaves is not None:
                    self.ring_client.close(ex)
                    self.open.remove((ex, leaves))
        await asyncio.gather(*self.calls, return_exceptions=True)
        self.calls.clear()
        self.settle_links()

    def let_every_deadline_pass(self) -> None:
        """What time does to an idle ring: sweeps, housekeeping, histories that expire."""
        later = time.monotonic() + 3_600
        self.ring_client.check_exchanges(later)
        for runtime in self.runtimes.values():
            runtime.tick(force=True)
            runtime.handler.housekeeping(later)
        self.settle_links()

    def roots(self) -> dict[str, object]:
        return {"api": self.ring_client, **{s: r for s, r in self.runtimes.items()}}

    def bounded_caches(self) -> list[object]:
        engine = self.scheduler_engine()
        return [
            self.grammars.cache,
            engine.pool,
            self.runtimes["detokenizer"].handler.token_texts,
            self.hf_tokenizer,
            engine.runner,
        ]


_SKIPPED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)


def held_objects(root: object, excluded: set[int]) -> Counter[str]:
    """Objects reachable from ``root`` by type, not entering code, modules, classes or the
    ``excluded`` objects (by id)."""
    seen = set(excluded)
    counts: Counter[str] = Counter()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIPPED):
            continue
        seen.add(id(obj))
        counts[type(obj).__name__] += 1
        stack.extend(gc.get_referents(obj))
    return counts


def census(sim: MixedRing) -> dict[str, Counter[str]]:
    gc.collect()
    excluded = {id(o) for o in sim.bounded_caches()}
    return {stage: held_objects(root, excluded) for stage, root in sim.roots().items()}


def growth(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    return {t: after[t] - before[t] for t in after if after[t] > before[t]}


def test_every_stage_holds_after_thousands_of_requests_what_it_held_before(sim_tokenizer, grammars):
    sim = MixedRing(sim_tokenizer, grammars)

    async def scenario() -> tuple[dict, dict]:
        for _ in range(3):
            sim.heartbeat()
            sim.settle_links()
        await sim.drive(WARMUP_REQUESTS)
        sim.let_every_deadline_pass()
        before = census(sim)
        await sim.drive(REQUESTS)
        sim.let_every_deadline_pass()
        return before, census(sim)

    before, after = asyncio.run(scenario())
    assert sim.serial == WARMUP_REQUESTS + REQUESTS
    for stage in before:
        grown = growth(before[stage], after[stage])
        assert sum(grown.values()) <= SLACK, (
            f"{stage} holds {sum(grown.values())} more objects after {REQUESTS} requests: "
            f"{sorted(grown.items(), key=lambda kv: -kv[1])[:8]}"
        )
    # what was left out of the count stays within its bounds
    assert len(grammars.cache) <= CACHE_SIZE
    assert grammars.cache.bytes <= grammars.cache.max_bytes
    assert not sim.ring_client.exchanges and not len(sim.ring_client.aborts)


def test_expiring_set_forgets_by_age_and_by_count():
    now = [0.0]
    uids = ExpiringSet(capacity=3, ttl_s=10.0, clock=lambda: now[0])
    for uid in ("a", "b", "c", "d"):
        uids.add(uid)
    assert "a" not in uids and len(uids) == 3  # over capacity: the oldest went
    uids.add("long", ttl_s=100.0)
    now[0] = 10.0
    assert "b" not in uids and "long" in uids  # expired members are not members
    uids.prune()
    assert len(uids) == 1


def test_lru_cache_is_bounded_in_bytes_and_keeps_no_entry_too_large():
    cache: LruCache[str, str] = LruCache(100, 1_000, lambda key, value: len(key))
    cache.put("x" * 300, "too large: over a quarter of the budget")
    assert len(cache) == 0
    for i in range(10):
        cache.put(f"{i}" * 200, "v")
    assert cache.bytes <= 1_000 and len(cache) == 5
    assert cache.get("9" * 200) == "v" and cache.get("0" * 200) is None


def test_unsettled_aborts_are_forgotten_past_the_horizon():
    aborts = AbortLog(horizon_s=10.0)
    aborts.sent("a", "client_disconnect", now=0.0)
    aborts.sent("b", "deadline", now=5.0)
    aborts.expire(now=12.0)
    assert len(aborts) == 1 and aborts.to_resend(now=12.0) == [("b", "deadline")]
