"""The SDPA backends: a step's rows routed to one attention path per kind of row.

Per layer, the step's new K/V are packed and written into the pool once, then decode tokens
share one attention call (``decode.py``), chunks that start a prompt share another, and chunks
that continue a prompt get one each (``prefill.py``). The backends differ only in their decode
path: ``sdpa`` gathers contexts from the paged pool (the GPU path), ``dense-cpu`` reads the
dense decode rows (the CPU path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenline.scheduler.attention.base import (
    AttentionBackend,
    AttentionLayer,
    AttentionPath,
    AttentionShape,
)
from tokenline.scheduler.attention.decode import DenseDecode, GatherDecode
from tokenline.scheduler.attention.prefill import ContinuedPrefill, FirstChunkPrefill
from tokenline.scheduler.step_inputs import StepBatch


@dataclass
class StepMetadata:
    slots: torch.Tensor  # [T] pool slot of each token row
    parts: list[tuple[AttentionPath, object]]  # the paths this step uses, with their metadata
    whole: bool  # one path covers every row in order: its output is the step's


class SdpaBackend(AttentionBackend):
    """Paged SDPA: decode tokens gather their contexts from the pool."""

    name = "sdpa"
    decode_path: type[AttentionPath] = GatherDecode

    def __init__(self, shape: AttentionShape, kv_cache: torch.Tensor) -> None:
        super().__init__(shape, kv_cache)
        self.decode = self.decode_path(shape, kv_cache)
        self.paths: list[AttentionPath] = [
            self.decode,
            FirstChunkPrefill(shape, kv_cache),
            ContinuedPrefill(shape, kv_cache),
        ]

    def prepare(self, step: StepBatch) -> StepMetadata:
        parts = []
        for path in self.paths:
            metadata = path.prepare(step)
            if metadata is not None:
                parts.append((path, metadata))
        whole = len(parts) == 1 and parts[0][1].rows is None
        return StepMetadata(slots=step.slots, parts=parts, whole=whole)

    def forward(self, q, k, v, layer: AttentionLayer, metadata: StepMetadata) -> torch.Tensor:
        tokens = q.shape[0]
        kv = torch.cat((k, v), dim=1).to(self.shape.dtype)  # [T, 2 * kv_heads, D]
        self.kv_cache[layer.index].index_copy_(0, metadata.slots, kv)
        if metadata.whole:
            ((path, part),) = metadata.parts
            out = path.forward(q, kv, layer, part)
        else:
            out = torch.empty_like(q)
            for path, part in metadata.parts:
                out.index_copy_(0, part.rows, path.forward(q, kv, layer, part))
        return out.reshape(tokens, self.shape.num_heads * self.shape.head_dim)

    def release(self) -> None:
        for path in self.paths:
            path.release()


class DenseCpuBackend(SdpaBackend):
    """Paged SDPA for prefill; decode tokens read dense copies of their contexts (CPU)."""

    name = "dense-cpu"
    decode_path = DenseDecode
