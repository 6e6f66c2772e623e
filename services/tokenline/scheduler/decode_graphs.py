"""Decode steps over fixed buffers, padded up to a bucket, replayed as captured CUDA graphs.

Batch-1 decode on a GPU launches a few hundred small kernels per step, and launching them takes
the CPU longer than the GPU takes to run them. A CUDA graph records a step's kernels once and
replays them with one launch, over the same memory: so a decode step of S sequences is padded up
to the smallest bucket B >= S (``--cuda-graph-sizes``, vLLM's flag and default shape), its inputs
are written into that bucket's buffers (`StaticDecode`), and the bucket's graph is replayed.
Steps that mix in prefill chunks, use LoRA adapters, or outgrow the largest bucket run eagerly.

The eager path and the captured path run the same module code over the same buffers: on a CPU
(no capture) the padded path runs eagerly and is tested to give the unpadded path's tokens.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenline.scheduler.attention.flex_static import StaticDecode
from tokenline.scheduler.layers.context import ForwardContext
from tokenline.scheduler.policy import Chunk

log = logging.getLogger(__name__)


def capture_sizes(sizes: list[int] | None, max_num_seqs: int) -> list[int]:
    """vLLM's ``--cuda-graph-sizes``: none given, up to ``min(2 * max_num_seqs, 512)``; one
    value N: 1, 2, 4, then every multiple of 8 up to N; several: those sizes."""
    if not sizes:
        sizes = [min(2 * max_num_seqs, 512)]
    if len(sizes) == 1:
        largest = sizes[0]
        sizes = [s for s in (1, 2, 4) if s <= largest] + list(range(8, largest + 1, 8))
    return sorted({s for s in sizes if s > 0})


class DecodeGraphs:
    """The buckets of one runner: their buffers, and their graphs once captured."""

    def __init__(self, runner, sizes: list[int], capture: bool) -> None:
        self.runner = runner
        # a decode step never holds more sequences than the scheduler runs at once
        largest = runner.attention.shape.max_num_seqs
        self.sizes = sizes = sorted({min(s, largest) for s in sizes})
        self.capture_graphs = capture
        largest = StaticDecode(runner.attention, max(sizes))
        self.buffers = {
            bucket: StaticDecode(runner.attention, bucket, shared=largest) for bucket in sizes[:-1]
        }
        self.buffers[max(sizes)] = largest
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # the rotary tables cover every position from the start, so no step regrows them
        self.max_position = runner.max_model_len - 1

    def bucket_for(self, chunks: list[Chunk]) -> int | None:
        """The bucket a step runs in, or None: it runs eagerly, unpadded."""
        if not chunks or any(c.num_tokens != 1 for c in chunks):
            return None
        return next((b for b in self.sizes if b >= len(chunks)), None)

    def write(self, chunks: list[Chunk], bucket: int) -> None:
        """Write a decode step into its bucket's buffers."""
        bs = self.runner.block_size
        ids, positions, slots, tables = [], [], [], []
        for chunk in chunks:
            seq, position = chunk.seq, chunk.start
            prompt = len(seq.prompt_ids)
            ids.append(
                seq.prompt_ids[position] if position < prompt else seq.output_ids[position - prompt]
            )
            positions.append(position)
            slots.append(seq.block_table[position // bs] * bs + position % bs)
            tables.append(seq.block_table)
        self.buffers[bucket].update(ids, positions, slots, tables)

    def run(self, bucket: int) -> torch.Tensor:
        """The bucket's logits [bucket, vocab]: its graph replayed, or its forward run eagerly
        over its buffers."""
        if bucket in self.graphs:
            graph, logits = self.graphs[bucket]
            graph.replay()
            return logits
        return self._forward(bucket)

    def _forward(self, bucket: int) -> torch.Tensor:
        buffers, runner = self.buffers[bucket], self.runner
        context = ForwardContext(
            buffers.positions, self.max_position, runner.attention, buffers.metadata
        )
        hidden = runner.model(buffers.input_ids, context, buffers.sample_rows)
        return runner.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Run every bucket once, then capture it, largest first (the smaller buckets' graphs
        share the largest one's memory pool). Padding-only contents: token 0 at slot 0."""
        if not self.capture_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        for bucket in sorted(self.sizes, reverse=True):
            self.buffers[bucket].update([], [], [], [])
            self._forward(bucket)  # compiles what the forward compiles, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(bucket)
            self.graphs[bucket] = (graph, logits)
        torch.cuda.synchronize()
        log.info(
            "captured %d decode graphs (batch %d to %d) in %.1f s",
            len(self.graphs),
            min(self.sizes),
            max(self.sizes),
            time.perf_counter() - start,
        )
