"""The scheduler stage alone, in one process, on the real engine and the tiny model: where its
native memory goes under a few thousand requests of one kind of traffic.

Not a test: it runs for minutes. The handler (`SchedulerStage`) is driven directly, the way
`stage_runtime` drives it (messages in, steps, housekeeping every second, an idle moment now
and then), with ``--concurrency`` requests in flight. ``--traffic`` picks what they are, so
each suspect can be bisected on its own:

- ``plain``: free text, varied prompt and output lengths;
- ``fixed``: a JSON schema out of three (grammar cache hits: deep copies of kept matchers);
- ``novel``: a JSON schema never seen before (a matcher built on the worker thread each time);
- ``abort``: plain, a third of them aborted after their first token;
- ``mixed``: issue 34's proportions (half schemas, half of those new; 10 % aborted).

Every ``--every`` requests it prints RSS, the anonymous memory of /proc/self/smaps_rollup,
glibc's ``mallinfo2`` (bytes in use, free bytes held in arenas, mmapped chunks), the number
of threads and the live llguidance matchers, and at the end the slope of each after the
warm-up, per 10,000 requests.

    MALLOC_ARENA_MAX=2 .venv/bin/python benchmarks/scheduler_memory.py --traffic mixed \
        --requests 6000 --warmup 1000

``--waves N`` swings the load every N requests (many long decodes, then a few short ones) with
no idle moment, as the soak's clients did: the dense decode rows' high-water mark.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time

import llguidance
import torch

from tokenline import protocol, tiny_model
from tokenline.model_source import resolve
from tokenline.scheduler.engine import Engine
from tokenline.scheduler.engine_limits import EngineLimits, default_token_budget
from tokenline.scheduler.grammar import GrammarCompiler
from tokenline.scheduler.runner import ModelRunner, RunnerOptions
from tokenline.scheduler.stage import SchedulerStage


def json_grammar(schema: dict) -> str:
    """A JSON schema as the llguidance grammar the api sends (without its whitespace options)."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema)


MiB = 2**20
WORDS = "river mountain road old the stone light a blue far green north wind sea".split()
FIXED = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}},
    {
        "type": "object",
        "properties": {"qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["qty"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
]


class Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = Mallinfo2


def memory() -> dict[str, float]:
    """RSS, anonymous memory and glibc's heap counters, in MiB."""
    rollup = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                rollup[parts[0].rstrip(":")] = int(parts[1]) / 1024
    info = _libc.mallinfo2()
    return {
        "rss": rollup["Rss"],
        "anon": rollup["Anonymous"],
        "heap_used": info.uordblks / MiB,  # allocated from arenas (main + thread arenas)
        "heap_free": info.fordblks / MiB,  # free but held by the arenas: fragmentation
        "arena": info.arena / MiB,  # bytes the arenas hold from the system
        "mmapped": info.hblkhd / MiB,
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "py_blocks": sys.getallocatedblocks(),
        "py_objects": len(gc.get_objects()),
    }


def grammar_for(rng: random.Random, traffic: str, serial: int) -> str | None:
    if traffic == "fixed":
        return json_grammar(rng.choice(FIXED))
    if traffic == "novel":
        name = f"field_{serial}_{rng.randrange(1 << 30):x}"
        return json_grammar(
            {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
        )
    if traffic == "mixed" and rng.random() < 0.5:
        return grammar_for(rng, "novel" if rng.random() < 0.5 else "fixed", serial)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--traffic", choices=["plain", "fixed", "novel", "abort", "mixed"], default="mixed"
    )
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, default=64 * MiB)
    parser.add_argument("--idle-every", type=int, default=200, help="requests between idles")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) at each idle")
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument(
        "--waves",
        type=int,
        default=0,
        help="requests per wave of load (0: none): a wave of 3 x --concurrency in flight with "
        "one request in 8 generating 600 tokens, then one of --concurrency / 4 short ones, as "
        "the soak's clients swing; what the dense decode rows follow",
    )
    parser.add_argument("--json", help="write the samples here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    cache = os.path.join(tempfile.gettempdir(), "tokenline-tiny-soak")
    tiny_model.ensure_cached(cache)
    source = resolve("tiny", cache_dir=cache)
    tokenizer = source.load_tokenizer()
    runner = ModelRunner(
        source, RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=args.kv_cache_memory)
    )
    limits = EngineLimits(source.max_model_len(None), 256, default_token_budget("cpu"))
    engine = Engine(runner, limits, source.eos_token_ids(), grammars=GrammarCompiler(tokenizer))
    stage = SchedulerStage(engine, "tiny")
    rng = random.Random(args.seed)

    serial = 0
    done = 0
    in_flight: dict[str, bool] = {}  # uid -> abort after its first token
    samples: list[dict] = []
    last_house = time.monotonic()
    next_idle = args.idle_every
    started = time.monotonic()

    def admit() -> None:
        nonlocal serial
        serial += 1
        uid = f"soak-{serial}"
        text = " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))
        grammar = grammar_for(rng, args.traffic, serial)
        long = in_wave() and not grammar and rng.random() < 1 / 8
        sampling = protocol.SamplingParams(
            max_tokens=600 if long else 48 if grammar else rng.randint(4, 24),
            ignore_eos=long,
            temperature=1.0,
            grammar=grammar,
            seed=rng.randrange(1 << 20) if rng.random() < 0.2 else None,
            logprobs=2 if rng.random() < 0.1 else None,
        )
        request = protocol.Tokenized(
            uid=uid, prompt_ids=tokenizer(text)["input_ids"], sampling=sampling, timeout_s=60
        )
        abort = args.traffic == "abort" and rng.random() < 1 / 3
        abort = abort or (args.traffic == "mixed" and rng.random() < 0.1)
        for out in stage.handle(request, time.monotonic()):
            if isinstance(out, protocol.Failed):
                return
        in_flight[uid] = abort

    def in_wave() -> bool:
        return bool(args.waves) and (serial // args.waves) % 2 == 0

    def concurrency() -> int:
        if not args.waves:
            return args.concurrency
        return 3 * args.concurrency if in_wave() else max(1, args.concurrency // 4)

    def finish(outputs) -> None:
        nonlocal done
        for message in outputs:
            if isinstance(message, protocol.Failed):
                in_flight.pop(message.uid, None)
                done += 1
            if not isinstance(message, protocol.TokenBatch):
                continue
            for out in message.outputs:
                if out.finish_reason is not None:
                    if in_flight.pop(out.uid, None) is not None:
                        done += 1
                elif in_flight.get(out.uid):
                    in_flight[out.uid] = False
                    stage.handle(protocol.Abort(uid=out.uid, reason="client_disconnect"), 0)

    def sample() -> None:
        gc.collect()
        row = {"requests": done, "seconds": round(time.monotonic() - started, 1), **memory()}
        samples.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))
        sys.stdout.flush()

    sample()
    next_sample = args.every
    while done < args.requests:
        while len(in_flight) < concurrency() and serial < args.requests:
            admit()
        if stage.has_work():
            finish(stage.step())
        else:
            time.sleep(0.002)  # a grammar on the worker thread
        now = time.monotonic()
        if now - last_house > 1.0:
            finish(stage.housekeeping(now))
            last_house = now
        if done >= next_idle:  # let every request end: the engine goes idle
            next_idle += args.idle_every
            while in_flight:
                if stage.has_work():
                    finish(stage.step())
                else:
                    time.sleep(0.002)
            finish(stage.step())
            if args.trim:
                _libc.malloc_trim(0)
        if done >= next_sample:
            next_sample += args.every
            sample()
    while in_flight:
        finish(stage.step()) if stage.has_work() else time.sleep(0.002)
    finish(stage.step())
    sample()

    after = [s for s in samples if s["requests"] >= args.warmup]
    print(f"traffic {args.traffic}, {done} requests, slope after {args.warmup} per 10,000:")
    for key in ("rss", "anon", "heap_used", "heap_free", "arena", "mmapped"):
        print(f"  {key:10} {slope(after, key) * 10_000:+8.2f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "samples": samples}, f, indent=1)


def slope(samples: list[dict], key: str) -> float:
    xs = [s["requests"] for s in samples]
    ys = [s[key] for s in samples]
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0


if __name__ == "__main__":
    main()
