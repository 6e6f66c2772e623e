"""Step time with KV-cache events off and on, under a flood of stored and evicted blocks.

Not a test. The real engine on the tiny model (CPU, float32, one torch thread) is fed distinct
prompts only, so every prefill step registers a full token budget of new blocks and, once the
small pool is full, evicts as many: the most events a step can make. Three engines run the same
seeded workload: events off, events on with a subscriber reading everything, events on with a
subscriber that never reads (its queue at the high-water mark: every batch then hits EAGAIN and
is dropped). Rounds alternate between them, so machine noise lands on all three alike. Printed:
the median and p90 step time of each, the publisher's own time per step (``flush``), and the
events and drops counted.

    .venv/bin/python benchmarks/kv_events_step.py --rounds 5 --requests 40
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import tempfile
import time

import torch
import zmq

from tokenline import tiny_model
from tokenline.model_source import resolve
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.kv_events import KVEventPublisher
from tokenline.scheduler.runner import ModelRunner, RunnerOptions


def read_all(endpoint: str, counts: multiprocessing.Queue) -> None:
    """A subscriber that decodes everything; reports (batches, events) whenever it goes quiet."""
    from msgspec.msgpack import Decoder

    from tokenline.scheduler.kv_events import KVEventBatch

    decode = Decoder(type=KVEventBatch)
    sub = zmq.Context().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    batches = events = 0
    while True:
        if not sub.poll(500):
            counts.put((batches, events))
            continue
        _, _, payload = sub.recv_multipart()
        batches += 1
        events += len(decode.decode(payload).events)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=40, help="per engine per round")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--budget", type=int, default=512, help="tokens per step")
    parser.add_argument("--kv-cache-memory", type=int, default=4 * 2**20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache = tempfile.gettempdir() + "/tokenline-bench-tiny"
    tiny_model.ensure_cached(cache)
    source = resolve("tiny", cache_dir=cache)
    ctx = zmq.Context()

    def engine() -> Engine:
        runner = ModelRunner(
            source,
            RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=args.kv_cache_memory),
        )
        limits = EngineLimits(tiny_model.MAX_POSITIONS, 64, args.budget)
        return Engine(runner, limits, source.eos_token_ids())

    off = engine()
    read = engine()
    full = engine()
    pub_read = KVEventPublisher(read.pool, "tcp://127.0.0.1:*", topic="kv@read@tiny", context=ctx)
    pub_full = KVEventPublisher(
        full.pool, "tcp://127.0.0.1:*", topic="kv@full@tiny", hwm=1, context=ctx
    )
    stuck = ctx.socket(zmq.SUB)  # never reads
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(pub_full.endpoint)
    while not pub_full.poll_subscriptions():
        time.sleep(0.01)
    # the reading subscriber lives in another process, as a router does: in this one it would
    # take the GIL from the step it measures
    counts = multiprocessing.get_context("spawn").Queue()
    multiprocessing.get_context("spawn").Process(
        target=read_all, args=(pub_read.endpoint, counts), daemon=True
    ).start()
    while not pub_read.poll_subscriptions():
        time.sleep(0.01)

    runs = {"off": (off, None), "on, read": (read, pub_read), "on, stuck": (full, pub_full)}
    steps: dict[str, list[float]] = {name: [] for name in runs}
    flushes: dict[str, list[float]] = {name: [] for name in runs}
    vocab = off.runner.vocab_size
    for rnd in range(args.rounds):
        rng = random.Random(rnd)
        prompts = [
            [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)
        ]
        order = list(runs.items())
        for name, (eng, pub) in order[rnd % 3 :] + order[: rnd % 3]:  # each goes first in turn
            for i, prompt in enumerate(prompts):
                eng.add(f"r{rnd}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=2))
            while eng.has_work():
                t0 = time.perf_counter()
                eng.step()
                t1 = time.perf_counter()
                if pub is not None:
                    pub.flush()
                t2 = time.perf_counter()
                steps[name].append(t2 - t0)  # the step as the stage sees it, flush included
                flushes[name].append(t2 - t1)
    pub_read.flush()
    time.sleep(1.0)
    batches = events = -1
    while not counts.empty():
        batches, events = counts.get()
    print(f"block size {off.pool.block_size}, {off.pool.num_blocks} blocks, budget {args.budget}")
    for name in runs:
        s = sorted(steps[name])
        f = sorted(flushes[name])
        print(
            f"{name:10s} steps {len(s):5d}  median {statistics.median(s) * 1e3:7.3f} ms  "
            f"p90 {s[int(len(s) * 0.9)] * 1e3:7.3f} ms  "
            f"flush median {statistics.median(f) * 1e6:6.1f} us  "
            f"p99 {f[int(len(f) * 0.99)] * 1e6:6.1f} us"
        )
    print(
        f"published: read {pub_read.seq} batches ({batches} received, {events} events), "
        f"stuck {pub_full.seq} batches, {pub_full.dropped} dropped"
    )


if __name__ == "__main__":
    main()
