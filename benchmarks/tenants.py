"""Interactive requests under a batch flood, in one process: time to first token of the
interactive ones with first come, first served, with priority, and with fair share.

A batch tenant keeps ``--flood`` long requests queued; an interactive tenant sends a short
request every ``--every-ms``. FCFS: the interactive request waits behind the queue. Priority:
it runs at priority -1 and preempts a batch request when the sequence slots are full. Fair
share (weights batch=1, interactive=1): it is admitted ahead of the batch tenant's queue, which
has had more than its share, but waits for a free slot. Modes alternate within each round.

    python benchmarks/real_shapes.py --shape smollm2-135m --out /tmp/smollm2-shape
    python benchmarks/tenants.py --model /tmp/smollm2-shape --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenline.loadgen.workload import LengthDist, build_workload
from tokenline.model_source import resolve
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner, RunnerOptions
from tokenline.scheduler.waiting import Scheduling

MODES = {
    "fcfs": (Scheduling("fcfs"), 0),
    "priority": (Scheduling("priority"), -1),
    "fair share": (Scheduling(tenant_weights={"batch": 1, "interactive": 1}), 0),
}


def run(engine: Engine, prompts: list[list[int]], args, urgent_priority: int, tag: str):
    """TTFTs of the interactive requests (s) and the batch tokens generated per second."""
    batch = SamplingParams(max_tokens=args.batch_tokens, temperature=0, ignore_eos=True)
    interactive = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    sent: dict[str, float] = {}  # interactive requests before their first token
    interactive_uids: set[str] = set()
    ttft: list[float] = []
    batch_tokens = 0
    n = 0
    started = time.perf_counter()
    next_interactive = started + args.every_ms / 1000
    while len(ttft) < args.interactive or engine.has_work():
        queued = engine.counts()["waiting"]
        while len(ttft) + len(sent) < args.interactive and queued < args.flood:
            engine.add(f"{tag}b{n}", prompts[n % len(prompts)], batch, tenant="batch")
            n += 1
            queued += 1
        now = time.perf_counter()
        if now >= next_interactive and len(ttft) + len(sent) < args.interactive:
            uid = f"{tag}i{n}"
            n += 1
            engine.add(
                uid,
                prompts[n % len(prompts)][:16],
                interactive,
                priority=urgent_priority,
                tenant="interactive",
            )
            sent[uid] = now
            interactive_uids.add(uid)
            next_interactive = now + args.every_ms / 1000
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.uid in sent and out.token_ids:
                ttft.append(now - sent.pop(out.uid))
            elif out.uid not in interactive_uids:
                batch_tokens += len(out.token_ids)
        if len(ttft) >= args.interactive and not sent:
            for uid in list(engine.policy.by_uid):
                engine.abort(uid)
            engine.step()
            break
    return ttft, batch_tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--flood", type=int, default=32, help="batch requests kept waiting")
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--interactive", type=int, default=10)
    parser.add_argument("--every-ms", type=float, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    source = resolve(args.model)
    tokenizer = source.load_tokenizer()
    specs = build_workload(16, LengthDist(64, 64), LengthDist(8, 8), seed=0)
    prompts = [tokenizer(s.prompt)["input_ids"] for s in specs]
    runner = ModelRunner(source, RunnerOptions(max_num_seqs=args.max_num_seqs))
    limits = EngineLimits(source.max_model_len(), args.max_num_seqs, 512)
    # one runner, so one KV pool's memory: no prefix caching, which would trust blocks another
    # mode's engine has since overwritten
    engines = {
        m: Engine(runner, limits, [], prefix_caching=False, scheduling=s)
        for m, (s, _) in MODES.items()
    }
    results = {m: {"ttft": [], "batch": []} for m in MODES}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for mode, (_, priority) in MODES.items():
            ttft, batch_rate = run(engines[mode], prompts, args, priority, f"{round_}{mode}")
            if round_:
                results[mode]["ttft"] += ttft
                results[mode]["batch"].append(batch_rate)
    for mode, r in results.items():
        ttft = sorted(r["ttft"])
        print(
            json.dumps(
                {
                    "mode": mode,
                    "interactive_ttft_p50_ms": round(1000 * ttft[len(ttft) // 2], 1),
                    "interactive_ttft_p99_ms": round(1000 * ttft[int(len(ttft) * 0.99)], 1),
                    "batch_tokens_per_s": round(statistics.median(r["batch"]), 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
