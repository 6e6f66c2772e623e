"""Speculative decoding in one process: what the machinery gives when every guess is right,
what it costs when every guess is wrong, and what n-gram proposals give on a workload whose
output repeats its prompt. Random weights guess nothing on their own, so the first two use
proposers of known quality (the known greedy continuation, or a wrong token in its place) and
separate the machinery from the luck; the third reports the acceptance actually seen.

Each mode runs ``--streams`` greedy requests at once (closed loop, each replaced as it ends)
and reports output tokens/s and the time between a request's tokens (ITL: a step that emits
several tokens counts its time once per token, as a client sees the stream). Modes alternate
within each round, so a drift of the machine's speed hits them alike.

Every speculating mode's tokens are compared with one token per step's: ``same_output`` is the
share of requests whose tokens are identical (float32 must give 1.0, or the run stops; in bf16
a verified chunk and a decode token run through kernels of other shapes, whose rounding can
differ where logits tie).

    python benchmarks/real_shapes.py --shape smollm2-135m --out /tmp/smollm2-shape
    python benchmarks/speculative.py --model /tmp/smollm2-shape --streams 1 --rounds 3
    python benchmarks/speculative.py --model /tmp/smollm2-shape --streams 8 --rounds 3
    python benchmarks/speculative.py --model /tmp/smollm2-shape --streams 1 --draft self
    python benchmarks/speculative.py --model /tmp/smollm2-shape --streams 1 --eagle3 random

``--eagle3 random`` writes a random EAGLE-3 head for the model (the tests' writer): it guesses
nothing right, so it measures what the head and the target's kept hidden states cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tokenline.loadgen.workload import LengthDist, build_workload
from tokenline.model_source import resolve
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner, RunnerOptions
from tokenline.scheduler.speculative.build import proposer_for
from tokenline.scheduler.speculative.config import SpeculativeConfig


class Known:
    """Proposes each request's known greedy continuation (``wrong``: another token instead)."""

    def __init__(self, continuations: dict[str, list[int]], count: int, wrong: bool) -> None:
        self.continuations, self.count, self.wrong = continuations, count, wrong

    def propose(self, seq, limit: int) -> list[int]:
        done = len(seq.output_ids)
        guess = self.continuations[seq.uid.split("/")[1]][done : done + min(limit, self.count)]
        return [t - 1 if t else 1 for t in guess] if self.wrong else guess


def run(engine: Engine, prompts: dict[str, list[int]], streams: int, tokens: int, tag: str):
    """Closed loop over ``prompts``; (output tokens/s, ITL samples in s, tokens per step,
    each request's tokens)."""
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    pending = list(prompts.items())
    last: dict[str, float] = {}
    itl: list[float] = []
    emitted = steps = 0
    outputs_of: dict[str, list[int]] = {}
    started = time.perf_counter()
    while pending or engine.has_work():
        while pending and len(last) < streams:
            uid, ids = pending.pop(0)
            engine.add(f"{tag}/{uid}", ids, sampling)
            last[f"{tag}/{uid}"] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            n = len(out.token_ids)
            if n and out.uid in last:
                itl += [(now - last[out.uid]) / n] * n
                last[out.uid] = now
            emitted += n
            outputs_of.setdefault(out.uid.split("/")[1], []).extend(out.token_ids)
            if out.finish_reason:
                last.pop(out.uid, None)
    return emitted / (time.perf_counter() - started), itl, emitted / steps, outputs_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft", help="a draft model's path, or self: the target as its draft")
    parser.add_argument("--eagle3", help="an EAGLE-3 head's path, or random: a random head")
    parser.add_argument("--torch-threads", type=int)
    parser.add_argument("--dtype", default="auto", help="as the scheduler's --dtype")
    parser.add_argument(
        "--attention-backend",
        default="auto",
        help="as the scheduler's --attention-backend",
    )
    args = parser.parse_args()

    source = resolve(args.model)
    limits = EngineLimits(source.max_model_len(), max_num_batched_tokens=512)
    options = RunnerOptions(
        torch_threads=args.torch_threads, dtype=args.dtype, attention_backend=args.attention_backend
    )
    engine = Engine(ModelRunner(source, options), limits, source.eos_token_ids())
    tokenizer = source.load_tokenizer()
    specs = build_workload(
        args.requests,
        LengthDist(args.prompt_words, args.prompt_words),
        LengthDist(args.output_len, args.output_len),
        seed=0,
    )
    prompts = {f"r{i}": tokenizer(s.prompt)["input_ids"] for i, s in enumerate(specs)}
    k = args.num_speculative_tokens
    # the greedy continuations, without speculation: the oracle's guesses
    sampling = SamplingParams(max_tokens=args.output_len * 3, temperature=0, ignore_eos=True)
    for uid, ids in prompts.items():
        engine.add(f"ref/{uid}", ids, sampling)
    reference: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            reference.setdefault(out.uid.split("/")[1], []).extend(out.token_ids)
    # n-gram workload: the prompt, its continuation, and the prompt again; a model that
    # repeats itself quotes its own continuation, which n-gram proposals find
    repeats = {u: ids + reference[u][: args.output_len] + ids for u, ids in prompts.items()}
    runner = engine.runner
    ngram = proposer_for(SpeculativeConfig("ngram", k, 2, 4), runner)
    # mode: (proposer, workload, the mode whose output it must equal)
    modes = {
        "off": (None, prompts, None),
        "every guess right": (Known(reference, k, False), prompts, "off"),
        "every guess wrong": (Known(reference, k, True), prompts, "off"),
        "off, repeating": (None, repeats, None),
        "ngram, repeating": (ngram, repeats, "off, repeating"),
    }
    if args.draft:  # the target itself as its draft: every guess right, a draft's costs paid
        draft = "target" if args.draft == "self" else args.draft
        config = SpeculativeConfig(
            "draft_model", k, 0, 0, model=args.model if draft == "target" else draft
        )
        modes[f"draft model ({draft})"] = (proposer_for(config, runner), prompts, "off")
    keeps_hidden = None  # the target's kept hidden states: on in the EAGLE-3 mode only
    if args.eagle3:
        head = random_head(source) if args.eagle3 == "random" else args.eagle3
        proposer = proposer_for(SpeculativeConfig("eagle3", k, 0, 0, model=head), runner)
        keeps_hidden = (runner.model.aux_layers, runner.aux_sink)
        modes[f"eagle3 ({args.eagle3})"] = (proposer, prompts, "off")
    results: dict[str, dict] = {m: {"rates": [], "itl": [], "per_step": []} for m in modes}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for mode, (proposer, workload, same_as) in modes.items():
            engine.policy.proposer = proposer
            if keeps_hidden is not None:
                on = mode.startswith("eagle3")
                runner.model.aux_layers, runner.aux_sink = keeps_hidden if on else ((), None)
            engine.acceptance.take()
            rate, itl, per_step, outputs = run(
                engine, workload, args.streams, args.output_len, f"{round_}{mode}"
            )
            acceptance = engine.acceptance.take()
            if same_as is not None:  # requests whose tokens equal one token per step's
                expected = results[same_as]["tokens"]
                same = sum(outputs[u] == expected[u] for u in outputs) / len(outputs)
                if same < 1 and args.dtype == "float32":
                    raise SystemExit(f"{mode}: the output differs from one token per step")
                results[mode]["same_output"] = same
            results[mode]["tokens"] = outputs
            if round_:
                results[mode]["rates"].append(rate)
                results[mode]["itl"] += itl
                results[mode]["per_step"].append(per_step)
                if acceptance.draft_tokens:
                    results[mode]["acceptance"] = round(
                        acceptance.accepted_tokens / acceptance.draft_tokens, 3
                    )
    if not args.rounds:
        return  # the outputs were checked; nothing was timed
    base = statistics.median(results["off"]["rates"])
    base_repeat = statistics.median(results["off, repeating"]["rates"])
    for mode, r in results.items():
        rate = statistics.median(r["rates"])
        itl = sorted(r["itl"])
        line = {
            "mode": mode,
            "streams": args.streams,
            "tokens_per_s": round(rate, 1),
            "vs_off": round(rate / (base_repeat if "repeating" in mode else base), 2),
            "tokens_per_step": round(statistics.mean(r["per_step"]), 2),
            "itl_p50_ms": round(1000 * itl[len(itl) // 2], 1),
            "itl_p99_ms": round(1000 * itl[int(len(itl) * 0.99)], 1),
        }
        for key in ("acceptance", "same_output"):
            if key in r:
                line[key] = r[key]
        print(json.dumps(line), flush=True)


def random_head(source) -> str:
    """A random EAGLE-3 head for ``source``'s model, written by the tests' writer."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "scheduler"))
    from eagle3_oracle import write_head

    config = json.loads((Path(source.path) / "config.json").read_text())
    out = Path(tempfile.mkdtemp(prefix="eagle3-head-"))
    return str(write_head(out, config, draft_vocab=config["vocab_size"]))


if __name__ == "__main__":
    main()
