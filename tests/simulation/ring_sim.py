"""The four stages chained into a ring in one process, driven by a seeded random scenario.

The real api `RingClient` (admission, routing, aborts, ring health), the real tokenizer and
detokenizer handlers, and the real scheduler handler over the real `Engine` (its policy, KV
pool and prefix cache) with a scripted runner in place of the model: the next token is a
function of the last one, so a scenario runs in milliseconds. Every message crosses each hop
encoded and decoded as on the wire, in order per link. A scenario injects client
disconnects, deadlines, unread streams (pauses), stop strings, over-long and empty prompts,
malformed frames, a handler that raises, and a stage restarted mid-flight with its state and
its inbox lost; a third of the scenarios schedule first come, first served, a third by
priority, and a third by priority with two weighted tenants (preempting for urgent
requests). Then it lets the ring settle and checks DESIGN.md's invariants.

A failure names its seed; ``python -m pytest tests/simulation -k replay --seed N`` replays it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import torch

from tokenline import protocol
from tokenline.api.ring.client import RingClient
from tokenline.api.ring.exchange import Exchange
from tokenline.detokenizer.stage import DetokenizerStage
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.stage import SchedulerStage
from tokenline.scheduler.waiting import Scheduling
from tokenline.settings import Settings
from tokenline.stage_runtime import StageRuntime
from tokenline.tokenizer.stage import PromptEncoder, TokenizerStage
from tokenline.transport import INBOX_UNION, NEXT_STAGE

STAGES = ("tokenizer", "scheduler", "detokenizer")
WORDS = ["river", "mountain", "road", "old", "the", "stone", "light", "a", "blue", "far"]


class ScriptedRunner:
    """The runner's interface without a model: logits that make the next token a fixed
    function of the previous one (one in 40 tokens is an end token)."""

    device = torch.device("cpu")

    def __init__(self, vocab_size: int, end_ids: list[int], num_blocks: int, block_size: int):
        self.vocab_size = vocab_size
        self.end_ids = end_ids
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.fail_next = False  # the next forward raises, as a kernel bug would

    def forward(self, chunks) -> torch.Tensor:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("scripted runner failure")
        rows = [c.seq for c in chunks if c.samples]
        logits = torch.zeros(len(rows), self.vocab_size)
        for row, seq in enumerate(rows):
            last = seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]
            nxt = (last * 31 + 7) % self.vocab_size
            if nxt % 40 == 0:
                nxt = self.end_ids[0]
            logits[row, nxt] = 30.0
        return logits

    def step_inputs(self, chunks) -> list:
        """What `execute` takes, as `ModelRunner.step_inputs` builds it: here the chunks."""
        return chunks

    def execute(self, chunks, spans=()) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and a stand-in hidden state per kept row (prompt logprobs)."""
        return self.forward(chunks), torch.zeros(sum(n for _, _, n in spans), 1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], self.vocab_size)  # a uniform prompt distribution

    def release_decode_contexts(self) -> None:
        pass

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)


class ListRing:
    """What `RingClient` needs of `AsyncRing`: an outbox, here the api → tokenizer link."""

    def __init__(self, link: deque) -> None:
        self._link = link
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def send_frame(self, frame: bytes) -> None:
        self._link.append(frame)

    def send_nowait(self, message: msgspec.Struct) -> None:
        self._link.append(self.encode(message))

    def close(self) -> None:
        pass


@dataclass
class Client:
    """One request as its client sees it."""

    exchange: Exchange
    reads: bool  # False: never reads (a slow client)
    leaves_after: int | None  # reads this many batches, then disconnects
    ends: list[str] = field(default_factory=list)  # what ended it, once: "done" or an error
    batches: int = 0
    echo: bool = False  # asked for its prompt back
    prompt_logprobs: bool = False  # asked for its prompt's logprobs
    replies: dict[int, int] = field(default_factory=dict)  # replies read per choice
    prompt_texts: dict[int, str] = field(default_factory=dict)  # per choice, from replies
    prompt_scores: dict[int, int] = field(default_factory=dict)  # prompt logprob entries
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # from terminal replies
    finishes: dict[int, str] = field(default_factory=dict)
    misplaced: list[str] = field(default_factory=list)  # prompt fields on a later reply


class RingSim:
    def __init__(self, seed: int, tokenizer, max_model_len: int = 96) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.hf_tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.links: dict[str, deque] = {s: deque() for s in ("api", *STAGES)}  # inboxes
        self.codecs = {s: protocol.Codec(INBOX_UNION[s]) for s in self.links}
        self.malformed = 0
        settings = Settings(request_timeout=30.0, slow_client_timeout=5.0, max_waiting=10_000)
        self.ring_client = RingClient(settings, ListRing(self.links["tokenizer"]))
        # who runs first, drawn apart too: fcfs, priority, or priority with tenant weights;
        # each request gets a priority and one of three tenants
        self.tenant_rng = random.Random(seed + 2_000_003)
        mode = seed % 3
        self.scheduling = Scheduling(
            "fcfs" if mode == 0 else "priority", {"a": 1, "b": 3} if mode == 2 else None
        )
        self.runtimes: dict[str, StageRuntime] = {}
        for stage in STAGES:
            self.runtimes[stage] = self._new_runtime(stage)
        self.clients: list[Client] = []
        # echo and prompt logprobs are drawn apart, so every seed's scenario is otherwise the
        # one it was before they existed
        self.echo_rng = random.Random(seed + 1_000_003)
        self.restarts = 0
        self.clock_offset = 0.0  # simulated time the api's watchdog sees beyond the real one

    # ── stages ─────────────────────────────────────────────────────────────────────────────────
    def _new_runtime(self, stage: str) -> StageRuntime:
        if stage == "tokenizer":
            handler = TokenizerStage(PromptEncoder(self.hf_tokenizer, self.max_model_len))
        elif stage == "detokenizer":
            handler = DetokenizerStage(self.hf_tokenizer.backend_tokenizer)
        else:
            end = self.hf_tokenizer.convert_tokens_to_ids("<|end|>")
            runner = ScriptedRunner(len(self.hf_tokenizer), [end], num_blocks=40, block_size=4)
            limits = EngineLimits(self.max_model_len, max_num_seqs=6, max_num_batched_tokens=32)
            engine = Engine(runner, limits, [end], scheduling=self.scheduling)
            handler = SchedulerStage(engine, "sim")
        target = self.links[NEXT_STAGE[stage]]
        encoder = msgspec.msgpack.Encoder()
        return StageRuntime(handler, lambda m: target.append(encoder.encode(m)))

    def scheduler_engine(self) -> Engine:
        return self.runtimes["scheduler"].handler.engine

    def restart(self, stage: str) -> None:
        """The stage dies with its state and whatever waited in its inbox; a new one starts."""
        self.links[stage].clear()
        self.restarts += 1
        self.ring_client.route(protocol.Link(reporter="sim", peer=stage, up=False))
        self.runtimes[stage] = self._new_runtime(stage)
        self.ring_client.route(protocol.Link(reporter="sim", peer=stage, up=True))

    def _detokenizer_fails_once(self) -> None:
        """The detokenizer's next decode raises, as a tokenizer bug would on one uid."""
        handler = self.runtimes["detokenizer"].handler
        decode = handler._decode

        def failing(*args, **kwargs):
            handler._decode = decode
            raise ValueError("scripted detokenizer failure")

        handler._decode = failing

    # ── delivery ───────────────────────────────────────────────────────────────────────────────
    def _decode(self, stage: str, frame: bytes):
        try:
            return self.codecs[stage].decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.malformed += 1
            return None

    def deliver(self, stage: str, limit: int) -> int:
        link = self.links[stage]
        batch = []
        while link and len(batch) < limit:
            message = self._decode(stage, link.popleft())
            if message is not None:
                batch.append((time.monotonic(), message))
        if stage == "api":
            for _, message in batch:
                self.ring_client.route(message)
        elif batch:
            self.runtimes[stage].process(batch)
        return len(batch)

    def heartbeat(self) -> None:
        seq = self.ring_client.health.heartbeat_sent(time.monotonic())
        self.ring_client.ring.send_nowait(
            protocol.Heartbeat(seq=seq, origin=self.ring_client._origin)
        )

    def in_flight(self) -> int:
        return sum(len(link) for link in self.links.values())

    # ── clients ────────────────────────────────────────────────────────────────────────────────
    def _prompt(self) -> str:
        kind = self.rng.random()
        if kind < 0.05:
            return ""  # tokenizes to nothing
        if kind < 0.1:
            return " ".join(self.rng.choices(WORDS, k=200))  # longer than the context
        shared = "the old river road " * self.rng.randint(0, 3)  # prefixes to cache
        return shared + " ".join(self.rng.choices(WORDS, k=self.rng.randint(1, 12)))

    def submit(self) -> None:
        rng = self.rng
        n = rng.choice([1, 1, 1, 2, 3])
        chat = rng.random() < 0.3
        prompt = self._prompt()
        sampling = protocol.SamplingParams(
            max_tokens=rng.randint(1, 24),
            temperature=rng.choice([0.0, 1.0]),
            seed=rng.randint(0, 1000),
            ignore_eos=rng.random() < 0.3,
            stop=rng.sample(WORDS, k=rng.randint(1, 2)) if rng.random() < 0.3 else [],
        )
        echo = not chat and self.echo_rng.random() < 0.3
        scored = self.echo_rng.random() < 0.3
        if echo or scored:
            sampling = msgspec.structs.replace(
                sampling,
                echo=echo,
                prompt_logprobs=self.echo_rng.randint(0, 3) if scored else None,
                max_tokens=self.echo_rng.choice([0, sampling.max_tokens]),
            )

        tenant = self.tenant_rng.choice(["", "a", "b"])
        priority = self.tenant_rng.randint(-2, 3) if self.scheduling.policy == "priority" else 0

        def build(uid: str, index: int) -> protocol.Generate:
            if chat:
                messages = [protocol.ChatMessage(role="user", content=prompt)]
                return protocol.Generate(
                    uid=uid,
                    sampling=sampling,
                    timeout_s=30,
                    messages=messages,
                    priority=priority,
                    tenant=tenant,
                )
            return protocol.Generate(
                uid=uid,
                sampling=sampling,
                timeout_s=30,
                prompt=prompt,
                priority=priority,
                tenant=tenant,
            )

        try:
            ex = self.ring_client.open([build("", i) for i in range(n)], tenant)
        except Exception as exc:  # refused at admission: nothing may be held for it
            assert getattr(exc, "status", None) in (429, 503), exc
            return
        leaves = rng.randint(0, 3) if rng.random() < 0.15 else None
        client = Client(ex, reads=rng.random() > 0.05, leaves_after=leaves)
        client.echo, client.prompt_logprobs = echo, scored
        self.clients.append(client)

    async def read(self, client: Client) -> None:
        ex = client.exchange
        if ex.closed or not client.reads:
            return
        if ex.depth == 0 and not ex.done:
            return
        batch = await ex.next_batch()
        client.batches += 1
        for index, reply in batch:
            self._saw(client, index, reply)
        if ex.done and not ex.depth:
            self._end(client, "done" if ex.error is None else ex.error.code)
        elif client.leaves_after is not None and client.batches > client.leaves_after:
            self._end(client, "left")
        del batch

    @staticmethod
    def _saw(client: Client, index: int, reply: protocol.Reply) -> None:
        seen = client.replies.get(index, 0)
        client.replies[index] = seen + 1
        if reply.prompt_text is not None or reply.prompt_logprobs is not None:
            if seen:
                client.misplaced.append(f"choice {index}'s reply {seen}")
            if reply.prompt_text is not None:
                client.prompt_texts[index] = reply.prompt_text
            if reply.prompt_logprobs is not None:
                entries = reply.prompt_logprobs
                if entries[0] is not None or None in entries[1:]:
                    client.misplaced.append(f"choice {index}'s entries misplace None")
                client.prompt_scores[index] = len(entries)
        if reply.finish_reason is not None:
            client.finishes[index] = reply.finish_reason
            client.prompt_tokens[index] = reply.prompt_tokens

    def _end(self, client: Client, how: str) -> None:
        client.ends.append(how)
        self.ring_client.close(client.exchange)

    # ── one scenario ───────────────────────────────────────────────────────────────────────────
    async def run(self, ticks: int = 60) -> None:
        for _ in range(3):  # the ring answers before the first request
            self.heartbeat()
            self.settle_links()
        rng = self.rng
        for _ in range(ticks):
            roll = rng.random()
            if roll < 0.35:
                self.submit()
            elif roll < 0.37:
                self.restart(rng.choice(STAGES))
                self.heartbeat()
            elif roll < 0.39:
                self.links[rng.choice(list(self.links))].append(rng.randbytes(rng.randint(0, 12)))
            elif roll < 0.40:
                self.scheduler_engine().runner.fail_next = True
            elif roll < 0.41:
                self._detokenizer_fails_once()
            elif roll < 0.42:
                self.clock_offset += 40.0  # time passes: deadlines and slow clients
                self.ring_client.check_exchanges(time.monotonic() + self.clock_offset)
            elif roll < 0.47:
                self.heartbeat()
            for stage in rng.sample(list(self.links), k=len(self.links)):
                self.deliver(stage, rng.randint(0, 6))
            if rng.random() < 0.7:
                self.runtimes["scheduler"].step()
            for client in list(self.clients):
                if rng.random() < 0.6:
                    await self.read(client)
        await self.finish()

    def settle_links(self) -> None:
        while self.in_flight():
            for stage in self.links:
                self.deliver(stage, 1_000)

    async def finish(self, max_rounds: int = 5_000) -> None:
        """Let every request end: slow clients go, time passes, the ring drains."""
        for client in self.clients:
            client.reads = True
        for _ in range(max_rounds):
            self.settle_links()
            runtime = self.runtimes["scheduler"]
            if runtime.has_work():
                runtime.step()
            for client in self.clients:
                await self.read(client)
            open_clients = [c for c in self.clients if not c.exchange.closed]
            if not open_clients and not runtime.has_work() and not self.in_flight():
                break
        # what a stage restart or a lost message left: the periodic sweeps and the deadline
        self.heartbeat()
        self.settle_links()
        for runtime in self.runtimes.values():
            runtime.tick(force=True)
        self.settle_links()

    # ── invariants ─────────────────────────────────────────────────────────────────────────────
    def violations(self) -> list[str]:
        found = []
        for client in self.clients:
            uid = client.exchange.uids[0]
            if len(client.ends) != 1:
                found.append(f"request {uid} ended {len(client.ends)} times: {client.ends}")
            if not client.exchange.closed:
                found.append(f"request {uid} never ended")
            found += [f"request {uid}: prompt fields on {where}" for where in client.misplaced]
            found += self._echo_violations(client)
        if self.ring_client.exchanges:
            found.append(f"api holds {sorted(self.ring_client.exchanges)}")
        if len(self.ring_client.ledger):
            found.append(f"api ledger holds {len(self.ring_client.ledger)} uid(s)")
        for stage, runtime in self.runtimes.items():
            held = list(runtime.handler.held())
            if held:
                found.append(f"{stage} holds {held}")
            if len(runtime.ledger):
                found.append(f"{stage} ledger holds {len(runtime.ledger)} uid(s)")
        pool = self.scheduler_engine().pool
        if pool.num_referenced:
            found.append(f"{pool.num_referenced} KV block(s) referenced once idle")
        return found

    def _echo_violations(self, client: Client) -> list[str]:
        """A choice that asked for its prompt back and ended normally got it, whole, on its
        first reply (a stage restart may lose the Begin that carries it: then nothing is
        promised but an end)."""
        found = []
        uid = client.exchange.uids[0]
        for index, finish in client.finishes.items():
            scores = client.prompt_scores.get(index)
            if scores is not None and scores != client.prompt_tokens[index]:
                found.append(f"{uid}: {scores} prompt logprobs for {client.prompt_tokens[index]}")
            if finish not in ("stop", "length") or self.restarts:
                continue
            if client.echo and index not in client.prompt_texts:
                found.append(f"{uid} choice {index} asked for echo and got no prompt text")
            if client.prompt_logprobs and scores is None:
                found.append(f"{uid} choice {index} asked for prompt logprobs and got none")
        return found


def run_scenario(seed: int, tokenizer, ticks: int = 60) -> RingSim:
    sim = RingSim(seed, tokenizer)
    asyncio.run(sim.run(ticks))
    return sim
