"""A mixed batch of LoRA adapters against the base model alone, in one engine, one process.

Eight random adapters (rank 16 on every projection, written by peft, so they load as users'
adapters do) are loaded into one LoRA engine with a device slot each. The same closed-loop
load then runs twice per round: every request on the base model, and the requests spread
round-robin over the eight adapters and the base. Rounds alternate, so each pair shares the
machine's state of that moment; the ratio is mixed / base tokens/s.

    python benchmarks/lora_mixed.py --model tiny --rounds 3 \
        > benchmarks/results/lora-mixed-$(git rev-parse --short HEAD).txt

The tiny model is so narrow (hidden size 256) that rank-16 adapters in 8 slots add most of
its arithmetic again; ``--hidden-size 1024`` runs the same on a wider random model of the
same family and vocabulary (4 layers, intermediate 2.5x, 64-wide heads), closer to the ratio
of adapter to base work of the models users serve.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tokenline.loadgen.workload import LengthDist, build_workload
from tokenline.model_source import resolve
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine
from tokenline.scheduler.engine_limits import EngineLimits, default_token_budget
from tokenline.scheduler.lora.options import LoraOptions
from tokenline.scheduler.runner import ModelRunner, RunnerOptions

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(base_path: str, out: Path, count: int, rank: int) -> dict[str, Path]:
    """``count`` random adapters with nonzero A and B, saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = {}
    for index in range(count):
        torch.manual_seed(index)
        model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False
        )
        path = out / f"adapter-{index}"
        get_peft_model(model, config).save_pretrained(path)
        adapters[f"adapter-{index}"] = path
    return adapters


def wider_model(tiny_path: str, hidden_size: int, out: Path) -> str:
    """The tiny model's family, tokenizer and vocabulary at ``hidden_size``, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_path)
    heads = hidden_size // 64
    config.update(
        dict(
            hidden_size=hidden_size,
            intermediate_size=hidden_size * 5 // 2,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            head_dim=64,
        )
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(out)
    return str(out)


def run_round(
    engine: Engine, prompts: list[list[int]], loras: list[str], args: argparse.Namespace, tag: str
) -> float:
    """Closed loop, ``--concurrency`` in flight; request i runs on ``loras[i % len(loras)]``."""
    sampling = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    pending = list(enumerate(prompts))
    in_flight = tokens = 0
    started = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < args.concurrency:
            i, prompt = pending.pop(0)
            engine.add(f"{tag}-{i}", prompt, sampling, lora=loras[i % len(loras)])
            in_flight += 1
        for out in engine.step():
            tokens += len(out.token_ids)
            if out.finish_reason:
                in_flight -= 1
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch-threads", type=int)
    parser.add_argument(
        "--hidden-size", type=int, help="a wider random model of --model's family (see above)"
    )
    args = parser.parse_args()

    scratch = tempfile.TemporaryDirectory()
    source = resolve(args.model)
    if args.hidden_size:
        source = resolve(wider_model(source.path, args.hidden_size, Path(scratch.name) / "m"))
    runner = ModelRunner(source, RunnerOptions(torch_threads=args.torch_threads))
    limits = EngineLimits(
        source.max_model_len(), max_num_batched_tokens=default_token_budget(runner.device.type)
    )
    lora = LoraOptions(max_loras=args.adapters, max_rank=args.rank, max_cpu_loras=args.adapters)
    engine = Engine(runner, limits, source.eos_token_ids(), lora=lora)
    specs = build_workload(
        args.num_requests,
        LengthDist(args.prompt_words, args.prompt_words),
        LengthDist(args.output_len, args.output_len),
        0,
    )
    tokenizer = source.load_tokenizer()
    prompts = [tokenizer(spec.prompt)["input_ids"] for spec in specs]
    with scratch:
        adapters = write_adapters(source.path, Path(scratch.name), args.adapters, args.rank)
        names = list(adapters.items())
        for name, path in names:
            engine.loras.add(name, str(path))
        mixed_loras = ["", *(name for name, _ in names)]
        print(
            f"{source.spec}, hidden size {runner.config.hidden_size}: "
            f"{args.adapters} adapters of rank {args.rank} on {TARGETS}; {args.num_requests} "
            f"requests x {args.output_len} tokens, {args.concurrency} in flight"
        )
        ratios = []
        for round_ in range(args.rounds + 1):  # round 0 warms up
            base = run_round(engine, prompts, [""], args, f"base{round_}")
            mixed = run_round(engine, prompts, mixed_loras, args, f"mixed{round_}")
            label = " (warm-up)" if round_ == 0 else ""
            print(
                f"round {round_}{label}: base {base:.0f} tokens/s, mixed {mixed:.0f} tokens/s, "
                f"mixed / base {mixed / base:.2f}"
            )
            if round_:
                ratios.append(mixed / base)
    print(f"median mixed / base over {len(ratios)} rounds: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
