"""Before a stage says it is ready: the KV pool sized from a measured forward, and every path
a step can take run once.

- `activation_peak`: on a GPU, what the largest prefill chunk's forward holds at its peak
  beyond the weights (vLLM's profile run), so the KV pool is sized to what is left of
  ``--gpu-memory-utilization`` after it, not to what happened to be free before any forward.
- `warm_up`: the largest prefill chunk and a decode step run once, and every decode bucket is
  run and captured (decode_graphs.py), so the first requests do not wait for kernels to be
  compiled or graphs captured, and an out-of-memory shows at start, not under load.

Both use pool blocks 1.. as scratch: at start the pool holds nothing (block 0, the padding
target, is never handed out), and nothing is cached, so no request ever reads what they wrote.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenline.protocol import SamplingParams
from tokenline.scheduler.policy import Chunk
from tokenline.scheduler.sequence import Sequence

log = logging.getLogger(__name__)


def scratch_sequence(tokens: int, block_size: int, vocab_size: int) -> Sequence:
    """A prompt of ``tokens`` ids over blocks 1.. (one block to spare for a decode token)."""
    prompt = [i % vocab_size for i in range(tokens)]
    seq = Sequence("warm-up", prompt, SamplingParams(max_tokens=1), max_tokens=1)
    seq.block_table = list(range(1, 2 + tokens // block_size))
    return seq


def prefill_tokens(runner, max_num_batched_tokens: int) -> int:
    """The largest prefill chunk a step runs, within the context limit and the pool."""
    capacity = (runner.num_blocks - 2) * runner.block_size  # blocks 1.. and one to spare
    return max(1, min(max_num_batched_tokens, runner.max_model_len - 1, capacity))


@torch.inference_mode()
def activation_peak(runner, max_num_batched_tokens: int) -> int:
    """Bytes the largest prefill chunk's forward and its logits hold at their peak, on a GPU,
    measured over a scratch pool just large enough for it (``runner`` has no pool yet)."""
    from tokenline.scheduler import attention
    from tokenline.scheduler.attention import AttentionShape
    from tokenline.scheduler.layers.context import ForwardContext
    from tokenline.scheduler.step_inputs import build_step_batch

    block = runner.block_size
    tokens = max(1, min(max_num_batched_tokens, runner.max_model_len - 1))
    blocks = 2 + tokens // block
    pool = torch.zeros(
        (runner.num_layers, blocks * block, 2 * runner.num_kv_heads, runner.head_dim),
        dtype=runner.dtype,
        device=runner.device,
    )
    shape = AttentionShape(
        runner.num_heads,
        runner.num_kv_heads,
        runner.head_dim,
        runner.dtype,
        runner.device,
        block,
        runner.window,
    )
    backend = attention.choose("sdpa", shape, pool)  # the scratch pool's own, gathered
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    before = torch.cuda.memory_allocated(runner.device)
    seq = scratch_sequence(tokens, block, runner.vocab_size)
    step = build_step_batch([Chunk(seq, 0, tokens)], block_size=block, device=runner.device)
    context = ForwardContext(step.positions, step.max_position, backend, backend.prepare(step))
    hidden = runner.model(step.input_ids, context, step.sample_rows)
    runner.model.logits(hidden)
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - before
    del pool, backend, context, hidden
    torch.cuda.empty_cache()
    log.info(
        "the largest prefill chunk (%d tokens) holds %.2f GiB at its peak", tokens, peak / 2**30
    )
    return peak


def kv_pool_bytes(total: int, free: int, utilization: float, activations: int) -> int:
    """What the KV pool may take: ``utilization`` of the device, less what is in use now
    (weights, the CUDA context, other processes) and the forward's activations."""
    return max(0, int(total * utilization) - (total - free) - activations)


@torch.inference_mode()
def warm_up(runner, max_num_batched_tokens: int) -> float:
    """Run the largest prefill chunk and a decode step once, then every decode bucket (and
    capture it, on CUDA). Returns the seconds it took."""
    start = time.perf_counter()
    tokens = prefill_tokens(runner, max_num_batched_tokens)
    seq = scratch_sequence(tokens, runner.block_size, runner.vocab_size)
    first = runner.forward([Chunk(seq, 0, tokens)])
    seq.num_computed = tokens
    seq.output_ids.append(int(first[0].argmax()))
    runner.forward([Chunk(seq, tokens, 1)])
    runner.release_decode_contexts()
    if runner.graphs is not None:
        runner.graphs.capture()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    elapsed = time.perf_counter() - start
    log.info("warmed up in %.1f s (a prefill chunk of %d tokens, decode)", elapsed, tokens)
    return elapsed
