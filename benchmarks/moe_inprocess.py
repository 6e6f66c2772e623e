"""A mixture of experts in process: tokenline's engine against transformers' ``generate_batch``.

The model has Qwen3-30B-A3B's shapes (2048 wide, 32 query and 4 KV heads of 128, 128 experts of
768 with 8 per token, a 151,936-token vocabulary) cut to ``--layers`` layers, with random
weights written here (no download). Both sides run the same prompts (random token ids) greedily
to the same number of new tokens, in the same process and dtype, with the same torch threads,
in alternating rounds (ours, theirs, ours, ...): output tokens per second of generation time,
model loading and warm-up excluded.

    python benchmarks/moe_inprocess.py --layers 2 --batch 1 32 --output-len 32 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

QWEN3_30B_A3B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def write_model(path: Path, layers: int, dtype: torch.dtype) -> None:
    import transformers

    if (path / "config.json").exists():
        return
    config = transformers.Qwen3MoeConfig(**QWEN3_30B_A3B, num_hidden_layers=layers)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.Qwen3MoeForCausalLM(config).to(dtype)
    model.save_pretrained(path)


def ours(runner, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens per second of one engine run over every prompt at once."""
    from tokenline.protocol import SamplingParams
    from tokenline.scheduler.engine import Engine, EngineLimits

    limits = EngineLimits(4096, max_num_seqs=len(prompts), max_num_batched_tokens=4096)
    engine = Engine(runner, limits, eos_ids=[], prefix_caching=False)
    for i, ids in enumerate(prompts):
        engine.add(f"r{i}", ids, SamplingParams(max_tokens=output_len, temperature=0))
    tokens = 0
    start = time.perf_counter()
    while engine.has_work():
        tokens += sum(len(out.token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - start)


def theirs(model, prompts: list[list[int]], output_len: int) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, progress_bar=False, warmup=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.generated_tokens) for o in out.values()) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="/tmp/qwen3-30b-a3b-cut")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from tokenline.model_source import ModelSource
    from tokenline.scheduler.runner import ModelRunner, RunnerOptions

    dtype = getattr(torch, args.dtype)
    path = Path(args.model_dir)
    write_model(path, args.layers, dtype)
    runner = ModelRunner(
        ModelSource(spec=str(path), path=str(path)),
        RunnerOptions(
            device="cpu", dtype=args.dtype, kv_cache_memory=2**30, torch_threads=args.torch_threads
        ),
    )
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    torch.set_num_threads(args.torch_threads)
    rng = random.Random(0)
    vocab = QWEN3_30B_A3B["vocab_size"]
    for batch in args.batch:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        ours(runner, prompts[:1], 2)  # warm-up: first allocations on both sides
        theirs(reference, prompts[:1], 2)
        rounds: dict[str, list[float]] = {"tokenline": [], "transformers": []}
        for _ in range(args.rounds):
            with torch.inference_mode():
                rounds["tokenline"].append(round(ours(runner, prompts, args.output_len), 2))
                rounds["transformers"].append(round(theirs(reference, prompts, args.output_len), 2))
        best = {side: max(values) for side, values in rounds.items()}
        print(
            json.dumps(
                {
                    "batch": batch,
                    "layers": args.layers,
                    "dtype": args.dtype,
                    "output_tokens_per_s": rounds,
                    "ratio_of_best": round(best["tokenline"] / best["transformers"], 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
