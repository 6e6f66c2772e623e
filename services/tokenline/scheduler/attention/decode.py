"""Decode tokens (chunks of one token): each attends over its whole context in one batch.

Two paths, one per place the contexts are read from:

- ``GatherDecode`` (paged SDPA): every layer gathers each sequence's context out of the paged
  pool into a padded ``[B, 2 * kv_heads, L, D]`` batch, masked past each context's end. The
  path for GPUs, where the gather is cheap next to the memory a copy would take.
- ``DenseDecode`` (CPU): attends over the dense per-sequence rows of ``DecodeContexts``, which
  grow by one token per step, so nothing is gathered (decode_contexts.py says why).

In both, the query heads that share a KV head attend as one group of rows, so K and V are
read once per KV head instead of being repeated for every query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenline.scheduler.attention.base import AttentionLayer, AttentionPath, AttentionShape
from tokenline.scheduler.attention.decode_contexts import DecodeContexts, DecodePlan, decode_masks
from tokenline.scheduler.step_inputs import StepBatch, long_tensor, slots_of, to_device


@dataclass
class GatherMetadata:
    rows: torch.Tensor | None  # token rows of the decode tokens; None: every row, in order
    gather: torch.Tensor  # [B, Lmax] pool slots of their contexts
    mask: torch.Tensor  # [B, 1, 1, Lmax] additive: 0 inside, -inf past
    window_mask: torch.Tensor | None  # the same, also -inf before the window


@dataclass
class DenseMetadata:
    rows: torch.Tensor | None  # as GatherMetadata's
    plan: DecodePlan


def _decode_rows(step: StepBatch, device: torch.device) -> torch.Tensor | None:
    if step.decode_only:
        return None
    return to_device(long_tensor(step.decode.rows), device)


def _grouped_queries(q: torch.Tensor, rows: torch.Tensor | None, shape: AttentionShape):
    """The decode tokens' queries as ``[B, kv_heads, heads per KV head, D]``."""
    qd = q if rows is None else q.index_select(0, rows)
    kvh = shape.num_kv_heads
    return qd.view(qd.shape[0], kvh, shape.num_heads // kvh, shape.head_dim)


def _mask(layer: AttentionLayer, full: torch.Tensor, windowed: torch.Tensor | None):
    """A sliding layer's mask when its window hides anything this step; else the full one."""
    return windowed if layer.slides and windowed is not None else full


class GatherDecode(AttentionPath):
    def prepare(self, step: StepBatch) -> GatherMetadata | None:
        decode = step.decode
        if not decode.rows:
            return None
        shape, bs = self.shape, self.shape.block_size
        lmax = max(decode.lens)
        width = -(-lmax // bs)
        tables = torch.tensor(
            [t[:width] + [0] * (width - len(t[:width])) for t in decode.tables], dtype=torch.long
        )
        pos = torch.arange(lmax)
        gather = tables[:, pos // bs] * bs + pos % bs
        mask, window_mask = decode_masks(decode.lens, lmax, shape.window, shape.dtype)
        return GatherMetadata(
            rows=_decode_rows(step, shape.device),
            gather=to_device(gather, shape.device),
            mask=to_device(mask, shape.device),
            window_mask=None if window_mask is None else to_device(window_mask, shape.device),
        )

    def forward(self, q, kv, layer: AttentionLayer, metadata: GatherMetadata) -> torch.Tensor:
        shape, kvh = self.shape, self.shape.num_kv_heads
        qd = _grouped_queries(q, metadata.rows, shape)
        pool = self.kv_cache[layer.index]
        gather = metadata.gather
        ctx = pool.index_select(0, gather.view(-1)).view(*gather.shape, *pool.shape[1:])
        ctx = ctx.transpose(1, 2)  # [B, 2 * kv_heads, L, D]
        mask = _mask(layer, metadata.mask, metadata.window_mask)
        od = F.scaled_dot_product_attention(
            qd, ctx[:, :kvh], ctx[:, kvh:], attn_mask=mask, scale=layer.scale
        )
        return od.reshape(qd.shape[0], shape.num_heads, shape.head_dim)


class DenseDecode(AttentionPath):
    def __init__(self, shape: AttentionShape, kv_cache: torch.Tensor) -> None:
        super().__init__(shape, kv_cache)
        num_layers = kv_cache.shape[0]
        self.contexts = DecodeContexts(
            num_layers, 2 * shape.num_kv_heads, shape.head_dim, shape.dtype
        )

    def prepare(self, step: StepBatch) -> DenseMetadata | None:
        decode = step.decode
        if not decode.rows:
            return None
        bs, kv_cache, tables = self.shape.block_size, self.kv_cache, decode.tables
        plan = self.contexts.plan(
            decode.uids,
            [n - 1 for n in decode.lens],
            lambda i, n: kv_cache.index_select(1, slots_of(tables[i], 0, n, bs)),
            self.shape.window,
        )
        return DenseMetadata(rows=_decode_rows(step, self.shape.device), plan=plan)

    def forward(self, q, kv, layer: AttentionLayer, metadata: DenseMetadata) -> torch.Tensor:
        shape, kvh = self.shape, self.shape.num_kv_heads
        qd = _grouped_queries(q, metadata.rows, shape)
        batch, plan = qd.shape[0], metadata.plan
        dense = self.contexts.buffer[layer.index]  # [rows, 2 * kv_heads, capacity, D]
        new_kv = kv if metadata.rows is None else kv.index_select(0, metadata.rows)
        dense[plan.rows, :, plan.positions] = new_kv
        if plan.order is not None:  # attention runs in row order
            qd = qd.index_select(0, plan.order)
        rows, short = plan.num_rows, plan.short_length
        mask = _mask(layer, plan.mask, plan.window_mask)
        od = F.scaled_dot_product_attention(
            qd,
            dense[:rows, :kvh, :short],
            dense[:rows, kvh:, :short],
            attn_mask=None if mask is None else mask[..., :short],
            scale=layer.scale,
        )
        for row, length in plan.long_rows:  # their whole contexts, each alone
            windowed = plan.window_mask if layer.slides else None
            od[row : row + 1] = F.scaled_dot_product_attention(
                qd[row : row + 1],
                dense[row : row + 1, :kvh, :length],
                dense[row : row + 1, kvh:, :length],
                attn_mask=None if windowed is None else windowed[row : row + 1, ..., :length],
                scale=layer.scale,
            )
        od = od if plan.order is None else od.index_select(0, plan.rows)
        return od.reshape(batch, shape.num_heads, shape.head_dim)

    def release(self) -> None:
        if self.contexts.num_rows:
            self.contexts.clear()
