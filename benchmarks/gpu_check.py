"""The engine against transformers' own continuous batching on one GPU, same model, same run.

The model has Qwen3-0.6B's shape, built from its configuration with random weights (nothing
is downloaded), in bf16. For each batch size the same prompts go to the tokenline engine
(in process) and to ``model.generate_batch``; both generate exactly ``--output-len`` tokens.
Prints one JSON line per measurement and a summary table.

    python benchmarks/gpu_check.py                      # on the GPU machine
    python benchmarks/gpu_check.py --compile            # also the engine with --compile
    python benchmarks/gpu_check.py --small --device cpu # a seconds-long dry run anywhere
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

# Qwen/Qwen3-0.6B's config.json (the fields that shape the computation)
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SMALL = dict(
    QWEN3_0_6B,
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def build_model(shape: dict, out_dir: str) -> None:
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**shape, eos_token_id=None, bos_token_id=None))
    model.generation_config = GenerationConfig(eos_token_id=None)
    model.save_pretrained(out_dir)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(n)
    return torch.randint(5, vocab, (n, length), generator=generator).tolist()


def run_engine(
    path: str, device: str, batch: list[list[int]], output_len: int, compile_layers: bool = False
) -> tuple[float, dict[str, float]]:
    """Tokens/s, and the mean ms of each step phase over the measured run's steps (on a GPU,
    ``forward`` is the time to queue the kernels; waiting for them shows in ``sample``)."""
    from tokenline.model_source import ModelSource
    from tokenline.protocol import SamplingParams
    from tokenline.scheduler.engine import Engine, EngineLimits, default_token_budget
    from tokenline.scheduler.runner import ModelRunner
    from tokenline.scheduler.step_times import STEP_PHASES

    source = ModelSource(spec="qwen3-shape", path=path)
    runner = ModelRunner(source, device=device, compile_layers=compile_layers)
    limits = EngineLimits(
        4096,
        max_num_seqs=max(256, len(batch)),
        max_num_batched_tokens=default_token_budget(runner.device.type),
    )
    engine = Engine(runner, limits, eos_ids=[])
    sampling = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)

    phases = dict.fromkeys(STEP_PHASES, 0.0)
    steps = 0

    def once() -> float:
        nonlocal steps
        for i, ids in enumerate(batch):
            engine.add(f"r{i}", ids, sampling)
        tokens, started = 0, time.perf_counter()
        steps = 0
        for phase in phases:
            phases[phase] = 0.0
        while engine.has_work():
            tokens += sum(len(o.token_ids) for o in engine.step())
            times = engine.last_step_times
            steps += 1
            for phase in phases:
                phases[phase] += getattr(times, phase)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        return tokens / (time.perf_counter() - started)

    once()  # warm-up (and, with compile_layers, compilation)
    rate = once()
    return rate, {phase: round(spent / steps * 1e3, 3) for phase, spent in phases.items()}


def run_transformers(path: str, device: str, batch: list[list[int]], output_len: int) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None)
    model.generate_batch(inputs=batch[:2], generation_config=config)  # warm-up
    started = time.perf_counter()
    outputs = model.generate_batch(inputs=batch, generation_config=config)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return tokens / elapsed


def _release_memory(device: str) -> None:
    """The engine's KV pool takes most of the GPU; free it before the next contender loads."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--small", action="store_true", help="a tiny model of the same family")
    parser.add_argument(
        "--compile", action="store_true", help="also measure the engine with compiled layers"
    )
    args = parser.parse_args()
    shape = SMALL if args.small else QWEN3_0_6B
    rows = []
    with tempfile.TemporaryDirectory() as path:
        build_model(shape, path)
        for size in (int(b) for b in args.batches.split(",")):
            batch = prompts(size, args.prompt_len, shape["vocab_size"])
            ours, step_ms = run_engine(path, args.device, batch, args.output_len)
            _release_memory(args.device)
            compiled = None
            if args.compile:
                compiled, _ = run_engine(path, args.device, batch, args.output_len, True)
                _release_memory(args.device)
            theirs = run_transformers(path, args.device, batch, args.output_len)
            _release_memory(args.device)
            row = {
                "batch": size,
                "tokenline_tokens_per_s": round(ours, 1),
                "transformers_generate_batch_tokens_per_s": round(theirs, 1),
                "ratio": round(ours / theirs, 2),
                "step_ms": step_ms,
            }
            if compiled is not None:
                row["tokenline_compiled_tokens_per_s"] = round(compiled, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    compiled_column = args.compile
    print(
        "| batch | tokenline engine tokens/s | transformers generate_batch tokens/s | ratio |"
        + (" tokenline --compile tokens/s |" if compiled_column else "")
    )
    print("|---|---|---|---|" + ("---|" if compiled_column else ""))
    for r in rows:
        print(
            f"| {r['batch']} | {r['tokenline_tokens_per_s']} | "
            f"{r['transformers_generate_batch_tokens_per_s']} | {r['ratio']} |"
            + (f" {r['tokenline_compiled_tokens_per_s']} |" if compiled_column else "")
        )


if __name__ == "__main__":
    main()
