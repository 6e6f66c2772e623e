"""Tensor parallelism on GPUs: TP=1 against TP=N on the same model, in one run.

The model has Qwen3-0.6B's shape (``--shape 8b``: Qwen3-8B's, which needs ~16 GB of disk and
a few minutes to write), built from its configuration with random weights (nothing is
downloaded). The same greedy prompts go to an engine over one device and to an engine over N
ranks (NCCL; gloo on CPU), in process; it prints one JSON line per measurement: tokens/s of
each, how many requests produced identical tokens, and the largest logit difference of the
first step. In bf16 a sum split over ranks rounds differently, so a late greedy token may
flip; ``--dtype float32`` is the exactness check.

    python benchmarks/tp_gpu_check.py --tp 2                       # on a machine with 2+ GPUs
    python benchmarks/tp_gpu_check.py --tp 2 --dtype float32       # exactness
    python benchmarks/tp_gpu_check.py --small --device cpu --tp 2  # a dry run anywhere (gloo)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

# the shapes gpu_check.py measures (a sibling script: run from anywhere, benchmarks/ is on the path)
from gpu_check import QWEN3_0_6B, SMALL

QWEN3_8B = dict(
    QWEN3_0_6B,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    tie_word_embeddings=False,
)


def build_model(shape: dict, out_dir: str, dtype: torch.dtype) -> None:
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(Qwen3Config(**shape, eos_token_id=None, bos_token_id=None))
    model.to(dtype).save_pretrained(out_dir)
    GenerationConfig(eos_token_id=None).save_pretrained(out_dir)


def run(runner, prompts: list[list[int]], output_len: int) -> dict:
    from tokenline.protocol import SamplingParams
    from tokenline.scheduler.engine import Engine, EngineLimits

    engine = Engine(runner, EngineLimits(4096, 256, 2048), eos_ids=[])
    first_logits: list[torch.Tensor] = []
    execute = runner.execute

    def record(prepared, spans=()):
        out = execute(prepared, spans)
        if not first_logits:
            first_logits.append(out[0].float().cpu())
        return out

    runner.execute = record
    sampling = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add(f"r{i}", ids, sampling)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.uid, []).extend(out.token_ids)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    runner.execute = execute
    generated = sum(map(len, tokens.values()))
    return {"tokens": tokens, "tok_s": generated / seconds, "first": first_logits[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--shape", default="0.6b", choices=("0.6b", "8b"))
    parser.add_argument("--small", action="store_true", help="a tiny model (dry run)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="4GiB")
    args = parser.parse_args()

    from tokenline.model_source import resolve
    from tokenline.scheduler.parallel.worker import start
    from tokenline.scheduler.runner import ModelRunner, RunnerOptions
    from tokenline.settings import parse_bytes

    shape = SMALL if args.small else QWEN3_8B if args.shape == "8b" else QWEN3_0_6B
    dtype = getattr(torch, args.dtype)
    kv = parse_bytes(args.kv_cache_memory)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(shape, tmp, dtype)
        source = resolve(tmp)
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(5, shape["vocab_size"], (args.batch, args.prompt_len),
                                generator=generator).tolist()  # fmt: skip
        common = RunnerOptions(device=args.device, dtype=args.dtype, kv_cache_memory=kv)
        driver = start(source, common, args.tp, timeout_s=600)
        parallel = run(driver.runner, prompts, args.output_len)
        parallel = run(driver.runner, prompts, args.output_len)  # the first warmed up
        single_runner = ModelRunner(source, common)
        single = run(single_runner, prompts, args.output_len)
        single = run(single_runner, prompts, args.output_len)
        same = sum(parallel["tokens"][u] == single["tokens"][u] for u in single["tokens"])
        diff = (parallel["first"] - single["first"]).abs().max().item()
        result = {
            "device": str(single_runner.device),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "dtype": args.dtype,
            "tp": args.tp,
            "batch": args.batch,
            "tp1_tok_s": round(single["tok_s"], 1),
            f"tp{args.tp}_tok_s": round(parallel["tok_s"], 1),
            "identical_requests": f"{same}/{len(single['tokens'])}",
            "max_first_step_logit_diff": diff,
        }
        print(json.dumps(result), flush=True)
        driver.close()


if __name__ == "__main__":
    main()
