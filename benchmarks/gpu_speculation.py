"""Speculative decoding on the lent GPU: the device half of issue 48, one stage of gpu_check.py.

On CUDA a decode step replays a captured graph while a verified chunk (several rows of one
sequence) runs eagerly through the attention backend (flex there); this stage checks that the
two together keep one token per step's output, and what they give. For batches of 1 and 8,
greedy, random prompts, the modes of speculative.py in one engine: off; the known greedy
continuation proposed (every guess right: the ceiling of the machinery); a wrong token in its
place (every guess wrong: its cost); the target as its own draft model; a random EAGLE-3 head
(the tests' writer; decode steps run without graphs while it is on, as in serving). Each mode
runs once to warm up (graph captures, flex compilations of new shapes), then once timed.

``same_output`` is the share of requests whose tokens equal one token per step's: 1.0 in
float32; in bf16 a verified chunk's kernels round otherwise than a decode step's, so a near-tie
may part (the CPU measurement says how often).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent / "tests" / "scheduler"))  # the EAGLE-3 head writer


def speculation(runner, path: str, vocab: int, batches=(1, 8), tokens: int = 48, k: int = 4):
    """One row per (batch, mode): tokens/s, tokens a step, acceptance, same output."""
    from eagle3_oracle import write_head
    from gpu_check import prompts
    from speculative import Known, run

    from tokenline.scheduler.engine import Engine, EngineLimits
    from tokenline.scheduler.speculative.build import proposer_for
    from tokenline.scheduler.speculative.config import SpeculativeConfig

    rows = []
    graphs = runner.graphs
    draft = proposer_for(SpeculativeConfig("draft_model", k, 0, 0, model=path), runner)
    eagle3 = _eagle3(runner, path, k, write_head)  # wires itself into the runner: undone here
    runner.graphs, runner.aux_sink, runner.model.aux_layers = graphs, None, ()
    for batch in batches:
        limits = EngineLimits(runner.max_model_len, max(batch, 1), 2048)
        engine = Engine(runner, limits, eos_ids=[], prefix_caching=False)
        length = min(256, runner.max_model_len // 2)  # the dry run's model is short
        tokens = min(tokens, runner.max_model_len - length - k - 1)
        workload = {f"p{i}": ids for i, ids in enumerate(prompts(batch, length, vocab, seed=11))}
        _, _, _, reference = run(engine, workload, batch, tokens, "ref")
        modes = {
            "off": None,
            "every guess right": Known(reference, k, wrong=False),
            "every guess wrong": Known(reference, k, wrong=True),
            "draft model (the target)": draft,
            "eagle3 (random head)": eagle3,
        }
        for mode, proposer in modes.items():
            engine.policy.proposer = proposer
            if proposer is eagle3:  # as serving runs it: hidden states kept, no graphs
                runner.graphs, runner.aux_sink = None, eagle3.observe
                runner.model.aux_layers = eagle3.head.aux_layers
            try:
                for round_ in ("warm", "timed"):
                    engine.acceptance.take()
                    rate, _, per_step, outputs = run(engine, workload, batch, tokens, round_)
                    taken = engine.acceptance.take()
            finally:
                runner.graphs, runner.aux_sink, runner.model.aux_layers = graphs, None, ()
            same = sum(outputs[u] == reference[u] for u in outputs) / len(outputs)
            rows.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "tokens_per_s": round(rate, 1),
                    "tokens_per_step": round(per_step, 2),
                    "acceptance": (
                        round(taken.accepted_tokens / taken.draft_tokens, 3)
                        if taken.draft_tokens
                        else None
                    ),
                    "same_output": same,
                }
            )
        runner.release_decode_contexts()
    return rows


def _eagle3(runner, path: str, k: int, write_head):
    from tokenline.scheduler.speculative.build import proposer_for
    from tokenline.scheduler.speculative.config import SpeculativeConfig

    config = json.loads((Path(path) / "config.json").read_text())
    layers = config["num_hidden_layers"]
    aux = (1, 2, 3) if layers > 3 else tuple(range(layers))  # the dry run's model: 2 layers
    out = Path(tempfile.mkdtemp(prefix="eagle3-head-"))
    head = write_head(out, config, draft_vocab=config["vocab_size"], aux=aux, fc_inputs=len(aux))
    return proposer_for(SpeculativeConfig("eagle3", k, 0, 0, model=str(head)), runner)
