"""One prepared run on a lent GPU: the engine against the hardware's roofline and against
transformers, its exactness, and what a decode step costs the host. Nothing is downloaded.

Stages, each recorded in the JSON (``--out``) as soon as it ends, so a failure late in the run
keeps what came before; the run stops itself before ``--budget-s`` seconds:

1. the environment: versions, the device, its memory;
2. the device's copy bandwidth (a large device-to-device copy): the roofline's denominator;
3. per shape (Qwen3-0.6B's; Llama-3.1-8B's width cut to ``--layers`` layers), random weights,
   bf16:
   - the engine's logits against transformers' forward (largest error over the logits' spread);
   - for contexts of 512 and 4096 tokens and batches of 1, 32 and 128: the batch's time to
     first token (its whole prefill), decode tokens/s over ``--decode-steps`` steps, and the
     roofline: a decode step reads every weight and the batch's K/V once, at the measured
     bandwidth;
   - in one decode step: the CUDA kernels launched, and the host synchronisations (torch's
     sync debug mode); the peak memory;
   - on the Qwen3 shape, speculative decoding beside CUDA graphs (gpu_speculation.py):
     tokens/s and output against one token per step, per proposer, at batches 1 and 8;
4. transformers' ``generate_batch`` at batch 128, context 512, with the same prompts.

    python benchmarks/gpu_check.py --out gpu-check.json                          # the GPU run
    python benchmarks/gpu_check.py --small --device cpu --out /tmp/dry.json      # dry run
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
import warnings
from pathlib import Path

import torch
from gpu_speculation import speculation  # this folder's, as real_shapes
from real_shapes import SHAPES  # this folder's: the script runs as benchmarks/gpu_check.py

# Qwen/Qwen3-0.6B's config.json (the fields that shape the computation)
QWEN3_0_6B = SHAPES["qwen3-0.6b"][2]
# meta-llama/Llama-3.1-8B's width (cut to --layers layers)
LLAMA_8B_WIDE = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=500_000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# the dry run's: the same families, seconds on a CPU
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
SMALL_WIDE = dict(LLAMA_8B_WIDE, **{k: SMALL[k] for k in SMALL if k in LLAMA_8B_WIDE})


class Report:
    """The run's JSON, rewritten after every stage."""

    def __init__(self, path: Path, budget_s: float) -> None:
        self.path, self.started, self.budget_s = path, time.monotonic(), budget_s
        self.data: dict = {"stages": {}, "complete": False}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def record(self, stage: str, value) -> None:
        self.data["stages"][stage] = value
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.path.write_text(json.dumps(self.data, indent=1))
        print(json.dumps({stage: value}), flush=True)


def environment(device: torch.device) -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "capability": list(torch.cuda.get_device_capability(device)),
        }
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    return env


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read plus write counted once each)."""
    size = 2**30 if device.type == "cuda" else 2**26
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    rounds, start = 10, time.perf_counter()
    for _ in range(rounds):
        dst.copy_(src)
    _sync(device)
    return 2 * size * rounds / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(name: str, shape: dict, layers: int | None, out: str, dtype) -> None:
    import transformers

    config_type, model_type = (
        ("Qwen3Config", "Qwen3ForCausalLM")
        if "qwen" in name
        else ("LlamaConfig", "LlamaForCausalLM")
    )
    config = getattr(transformers, config_type)(
        **{**shape, "num_hidden_layers": layers or shape["num_hidden_layers"]},
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = getattr(transformers, model_type)(config).to(dtype)
    model.generation_config = transformers.GenerationConfig(eos_token_id=None)
    model.save_pretrained(out)


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (count, length), generator=generator).tolist()


def logits_error(runner, path: str, device, dtype, vocab: int) -> dict:
    """The engine's last-position logits of two prompts against transformers' forward."""
    from transformers import AutoModelForCausalLM

    from tokenline.protocol import SamplingParams
    from tokenline.scheduler.policy import Chunk
    from tokenline.scheduler.sequence import Sequence

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    worst = 0.0
    for i, ids in enumerate(prompts(2, 64, vocab, seed=7)):
        seq = Sequence(f"check-{i}", ids, SamplingParams(max_tokens=1), max_tokens=1)
        seq.block_table = list(range(1 + 8 * i, 1 + 8 * i + 8))
        got = runner.forward([Chunk(seq, 0, len(ids))])[0]
        with torch.inference_mode():
            want = reference(torch.tensor([ids], device=device)).logits[0, -1].float()
        worst = max(worst, float((got - want).abs().max() / want.std()))
    del reference
    return {"max_error_over_std": round(worst, 4), "same_argmax_bound": "bf16 rounding"}


def weight_bytes(runner) -> int:
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


def measure(runner, batch: int, context: int, steps: int, vocab: int) -> dict:
    """One batch's prefill (time to every first token) and ``steps`` decode steps."""
    from tokenline.protocol import SamplingParams
    from tokenline.scheduler.engine import Engine, EngineLimits

    limits = EngineLimits(
        runner.max_model_len, max_num_seqs=max(batch, 1), max_num_batched_tokens=2048
    )
    engine = Engine(runner, limits, eos_ids=[], prefix_caching=False)
    sampling = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts(batch, context, vocab, seed=batch * 1000 + context)):
        engine.add(f"r{i}", ids, sampling)
    first: set[str] = set()
    start = time.perf_counter()
    while len(first) < batch:
        first |= {out.uid for out in engine.step() if out.token_ids}
    _sync(runner.device)
    ttft = time.perf_counter() - start
    start, tokens = time.perf_counter(), 0
    while engine.has_work():
        tokens += sum(len(out.token_ids) for out in engine.step())
    _sync(runner.device)
    decode_s = time.perf_counter() - start
    runner.release_decode_contexts()
    return {"ttft_s": round(ttft, 4), "decode_tokens_per_s": round(tokens / decode_s, 1)}


def step_costs(runner, vocab: int) -> dict:
    """CUDA kernels launched and host synchronisations in one decode step of 32 sequences."""
    from tokenline.protocol import SamplingParams
    from tokenline.scheduler.engine import Engine, EngineLimits

    engine = Engine(runner, EngineLimits(runner.max_model_len, 32, 2048), eos_ids=[])
    for i, ids in enumerate(prompts(32, 128, vocab, seed=3)):
        engine.add(f"k{i}", ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for _ in range(4):  # the prompts, and a decode step or two
        engine.step()
    costs: dict = {"kernels": None, "kernel_launch_calls": None, "host_syncs": None}
    if runner.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
            _sync(runner.device)
        events = prof.events()
        costs["kernels"] = sum(1 for e in events if e.device_type.name == "CUDA")
        costs["kernel_launch_calls"] = sum(
            1 for e in events if e.name in ("cudaLaunchKernel", "cudaGraphLaunch", "cuLaunchKernel")
        )
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            costs["host_syncs"] = sum("synchroniz" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    while engine.has_work():
        engine.step()
    runner.release_decode_contexts()
    return costs


def transformers_rate(path: str, device, dtype, batch: int, context: int, steps: int, vocab):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    config = GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=None)
    inputs = prompts(batch, context, vocab, seed=batch * 1000 + context)
    model.generate_batch(inputs=inputs[:2], generation_config=config, progress_bar=False)
    start = time.perf_counter()
    out = model.generate_batch(inputs=inputs, generation_config=config, progress_bar=False)
    _sync(device)
    rate = sum(len(o.generated_tokens) for o in out.values()) / (time.perf_counter() - start)
    del model
    return round(rate, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="gpu-check.json")
    parser.add_argument("--budget-s", type=float, default=450, help="stop before this")
    parser.add_argument("--layers", type=int, default=4, help="of the 8B-wide shape")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--small", action="store_true", help="tiny shapes: a dry run")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = Report(Path(args.out), args.budget_s)
    report.record("environment", environment(device))
    bandwidth = copy_bandwidth(device)
    report.record("copy_bandwidth_gb_per_s", round(bandwidth / 1e9, 1))
    shapes = {"qwen3-0.6b": (QWEN3_0_6B, None), "llama-8b-wide": (LLAMA_8B_WIDE, args.layers)}
    if args.small:
        shapes = {"qwen3-small": (SMALL, None), "llama-wide-small": (SMALL_WIDE, 2)}
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    for name, (shape, layers) in shapes.items():
        if report.left() < 60 and not args.small:
            report.record(f"{name}: skipped", "the time budget ran out")
            break
        # transformers' continuous batching takes half a minute a shape on a CPU, more under
        # load: the dry run leaves it out
        compare = not args.small
        run_shape(report, name, shape, layers, device, dtype, contexts, batches, args, compare)
    report.data["complete"] = True
    report.record("done", True)


def run_shape(report, name, shape, layers, device, dtype, contexts, batches, args, compare):
    from tokenline.model_source import ModelSource
    from tokenline.scheduler.runner import ModelRunner, RunnerOptions
    from tokenline.scheduler.warm_up import warm_up

    vocab = shape["vocab_size"]
    with tempfile.TemporaryDirectory() as path:
        build_model(name, shape, layers, path, dtype)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        runner = ModelRunner(
            ModelSource(spec=name, path=path),
            RunnerOptions(
                device=str(device),
                dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                max_model_len=max(contexts) + args.decode_steps + 8,
                max_num_seqs=max(batches),
                kv_cache_memory=None if device.type == "cuda" else 2**28,
            ),
        )
        warmed = warm_up(runner, 2048)
        report.record(
            f"{name}: start",
            {
                "load_and_warm_s": round(time.perf_counter() - started, 1),
                "warm_up_s": round(warmed, 1),
                "attention": runner.attention.name,
                "decode_graphs": runner.graphs.sizes if runner.graphs else None,
                "kv_blocks": runner.num_blocks,
                "block_size": runner.block_size,
            },
        )
        report.record(f"{name}: logits", logits_error(runner, path, device, dtype, vocab))
        weights = weight_bytes(runner)
        kv_per_token = runner.bytes_per_token
        for context in contexts:
            for batch in batches:
                if report.left() < 30:
                    report.record(f"{name}: stopped", "the time budget ran out")
                    return
                needed = batch * (context + args.decode_steps + 1)
                if needed > (runner.num_blocks - 1) * runner.block_size:
                    report.record(f"{name}: {batch}x{context}", "more than the KV pool holds")
                    continue
                row = measure(runner, batch, context, args.decode_steps, vocab)
                step_bytes = weights + batch * (context + args.decode_steps / 2) * kv_per_token
                roofline = batch / (
                    step_bytes / (report.data["stages"]["copy_bandwidth_gb_per_s"] * 1e9)
                )
                row["roofline_tokens_per_s"] = round(roofline, 1)
                row["of_roofline"] = round(row["decode_tokens_per_s"] / roofline, 3)
                report.record(f"{name}: {batch}x{context}", row)
        costs = step_costs(runner, vocab)
        if device.type == "cuda":
            costs["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        report.record(f"{name}: decode step costs", costs)
        if name.startswith("qwen3") and (report.left() > 150 or args.small):
            report.record(f"{name}: speculation", speculation(runner, path, vocab))
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if compare and (report.left() > 60 or args.small):
            batch, context = max(batches), min(contexts)
            rate = transformers_rate(path, device, dtype, batch, context, args.decode_steps, vocab)
            report.record(f"{name}: transformers generate_batch {batch}x{context}", rate)


if __name__ == "__main__":
    main()
