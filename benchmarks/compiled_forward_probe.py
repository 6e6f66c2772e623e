"""Would a whole compiled forward beat the eager one on CPU? A probe, not a serving path.

The dense Llama layers are written out as one function of tensors and compiled whole by
inductor with frozen weights (inductor packs the projections for oneDNN itself and fuses the
norms, rotary, SiLU and residual adds); attention is an opaque custom op that reads the step's
metadata from a global (as vLLM's forward context does). ``--mode eager`` runs the engine as it
serves. Both run the engine's decode steps over ``--batch`` sequences of 128-token prompts.

    python benchmarks/compiled_forward_probe.py --model-dir /tmp/smollm2-shape --mode compiled
    python benchmarks/compiled_forward_probe.py --model-dir /tmp/smollm2-shape --mode compiled \\
        --cpp-wrapper
    python benchmarks/compiled_forward_probe.py --model-dir /tmp/smollm2-shape --mode eager
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

STEP: dict = {}  # the running step's context and model, for the custom op


@torch.library.custom_op("tokenline_probe::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    context, model = STEP["context"], STEP["model"]
    attention = model.model.layers[layer].self_attn.layer
    return context.attention.forward(q, k, v, attention, context.metadata)


@attend.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def norm(module, h: torch.Tensor) -> torch.Tensor:
    normed = F.rms_norm(h.float(), module.shape, None, module.eps)
    return module.weight * normed.to(h.dtype)


def layers_forward(model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    for i, layer in enumerate(model.model.layers):
        att = layer.self_attn
        heads, kv_heads, dim = att.num_heads, att.num_kv_heads, att.head_dim
        qkv = F.linear(norm(layer.input_layernorm, h), att.qkv_proj.weight)
        qk = qkv[:, : (heads + kv_heads) * dim].view(qkv.shape[0], heads + kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim :].view(qkv.shape[0], kv_heads, dim)
        qk = qk * cos + qk.roll(dim // 2, dims=-1) * sin
        o = attend(qk[:, :heads].contiguous(), qk[:, heads:].contiguous(), v.contiguous(), i)
        h = h + F.linear(o, att.o_proj.weight)
        gate_up = F.linear(norm(layer.post_attention_layernorm, h), layer.mlp.gate_up_proj.weight)
        gate, up = gate_up.chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
    return h


def compile_whole(model, cpp_wrapper: bool = False) -> None:
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    inductor_config.cpp_wrapper = cpp_wrapper  # the generated code's calls made from C++
    compiled = torch.compile(lambda h, cos, sin: layers_forward(model, h, cos, sin), dynamic=True)

    def forward(input_ids, context, rows):
        STEP["context"], STEP["model"] = context, model
        h = model.model.embed_tokens(input_ids)
        cos, sin = model.rotary_emb.at(context.positions, context.max_position)
        return model.model.norm(compiled(h, cos, sin).index_select(0, rows))

    model.forward = forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cpp-wrapper", action="store_true", help="inductor's C++ wrapper")
    args = parser.parse_args()

    from tokenline.model_source import ModelSource
    from tokenline.protocol import SamplingParams
    from tokenline.scheduler import runner as runner_module
    from tokenline.scheduler.engine import Engine, EngineLimits

    if args.mode == "compiled":  # inductor packs the frozen plain weights itself
        runner_module.packs_weights = lambda place: False
    runner = runner_module.ModelRunner(
        ModelSource(spec=args.model_dir, path=args.model_dir),
        runner_module.RunnerOptions(
            device="cpu", dtype="bfloat16", kv_cache_memory=2**30, torch_threads=args.torch_threads
        ),
    )
    if args.mode == "compiled":
        compile_whole(runner.model, args.cpp_wrapper)
    for batch in args.batch:
        limits = EngineLimits(4096, max_num_seqs=batch, max_num_batched_tokens=4096)
        engine = Engine(runner, limits, eos_ids=[], prefix_caching=False)
        rng = random.Random(batch)
        for i in range(batch):
            ids = [rng.randrange(runner.vocab_size) for _ in range(128)]
            engine.add(f"r{i}", ids, SamplingParams(max_tokens=10_000, temperature=0))
        with torch.inference_mode():
            start = time.perf_counter()
            for _ in range(8):  # the prefill, compilation, and a few decode steps
                engine.step()
            warm = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
        step_ms = (time.perf_counter() - start) / args.steps * 1e3
        print(f"{args.mode}, batch {batch}: {step_ms:.2f} ms a decode step (warm-up {warm:.1f} s)")
        for uid in engine.held_uids():
            engine.abort(uid)


if __name__ == "__main__":
    main()
