"""Prefill chunks (more than one token): the chunks that start a prompt and those that
continue one.

- ``FirstChunkPrefill``: a chunk that starts its prompt attends only to its own tokens, so
  the step's fresh K/V serve as its context (nothing is read back from the pool) and one
  causal attention call covers every such chunk, padded to one ``[S, n_max]`` batch: padding
  sits after each chunk's last token, where the causal mask hides it from the real queries,
  and the padded rows' outputs are dropped.
- ``ContinuedPrefill``: a later chunk of a prompt (chunked prefill, or what follows a prefix
  cache hit) sees every earlier token of its sequence, read from the pool, plus its own
  causal prefix; one attention call per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenline.scheduler.attention.base import AttentionLayer, AttentionPath
from tokenline.scheduler.step_inputs import StepBatch, long_tensor, slots_of, to_device


@dataclass
class FirstChunks:
    """Prefill chunks that start their prompt, padded to one ``[S, n_max]`` batch."""

    index: torch.Tensor  # [S * n_max] token row of each padded position (padding repeats a row)
    shape: tuple[int, int]  # (S, n_max)
    valid: torch.Tensor | None  # positions of real tokens in the padded layout; None: no padding
    rows: torch.Tensor  # [real tokens] their token rows, in the order of ``valid``
    window_mask: torch.Tensor | None = None  # [n_max, n_max] banded causal, for sliding layers


@dataclass
class ContinuedChunks:
    rows: torch.Tensor  # the token rows of every chunk, in chunk order
    # per chunk: (row start, n, pool slots of its context and itself, context start)
    chunks: list[tuple[int, int, torch.Tensor, int]]


class FirstChunkPrefill(AttentionPath):
    def prepare(self, step: StepBatch) -> FirstChunks | None:
        spans = step.first_spans
        if not spans:
            return None
        device, window = self.shape.device, self.shape.window
        longest = max(n for _, n in spans)
        index: list[int] = []
        valid: list[int] = []
        rows: list[int] = []
        for i, (row, n) in enumerate(spans):
            index.extend(row + min(j, n - 1) for j in range(longest))
            valid.extend(range(i * longest, i * longest + n))
            rows.extend(range(row, row + n))
        padded = len(valid) != len(index)
        window_mask = None
        if window is not None and longest > window:
            # every chunk starts at position 0, so one banded causal mask serves them all
            pos = torch.arange(longest)
            visible = (pos.unsqueeze(0) <= pos.unsqueeze(1)) & (
                pos.unsqueeze(0) > pos.unsqueeze(1) - window
            )
            window_mask = torch.zeros(visible.shape, dtype=self.shape.dtype)
            window_mask = to_device(window_mask.masked_fill_(~visible, -torch.inf), device)
        return FirstChunks(
            index=to_device(long_tensor(index), device),
            shape=(len(spans), longest),
            valid=to_device(long_tensor(valid), device) if padded else None,
            rows=to_device(long_tensor(rows), device),
            window_mask=window_mask,
        )

    def forward(self, q, kv, layer: AttentionLayer, metadata: FirstChunks) -> torch.Tensor:
        batch, longest = metadata.shape
        heads, kvh, dim = self.shape.num_heads, self.shape.num_kv_heads, self.shape.head_dim
        qf = q.index_select(0, metadata.index).view(batch, longest, heads, dim)
        kvf = kv.index_select(0, metadata.index).view(batch, longest, 2 * kvh, dim)
        qf, kvf = qf.transpose(1, 2), kvf.transpose(1, 2)  # [S, heads, n_max, D]
        if layer.slides and metadata.window_mask is not None:
            causal = {"attn_mask": metadata.window_mask}
        else:
            causal = {"is_causal": True}
        of = F.scaled_dot_product_attention(
            qf, kvf[:, :kvh], kvf[:, kvh:], scale=layer.scale, enable_gqa=True, **causal
        )
        of = of.transpose(1, 2).reshape(batch * longest, heads, dim)
        if metadata.valid is not None:
            of = of.index_select(0, metadata.valid)
        return of


class ContinuedPrefill(AttentionPath):
    def prepare(self, step: StepBatch) -> ContinuedChunks | None:
        if not step.continued:
            return None
        bs, device = self.shape.block_size, self.shape.device
        chunks = [
            (row, n, to_device(slots_of(table, 0, start + n, bs), device), start)
            for row, n, table, start in step.continued
        ]
        rows = [r for row, n, _, _ in chunks for r in range(row, row + n)]
        return ContinuedChunks(to_device(long_tensor(rows), device), chunks)

    def forward(self, q, kv, layer: AttentionLayer, metadata: ContinuedChunks) -> torch.Tensor:
        kvh, device, window = self.shape.num_kv_heads, self.shape.device, self.shape.window
        pool = self.kv_cache[layer.index]
        outs = []
        for row, n, context, start in metadata.chunks:
            qp = q[row : row + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, D]
            ctx = pool.index_select(0, context).transpose(0, 1).unsqueeze(0)  # [1, 2kvh, L, D]
            kp, vp = ctx[:, :kvh], ctx[:, kvh:]
            if start == 0:
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, is_causal=True, scale=layer.scale, enable_gqa=True
                )
            else:  # a later chunk sees every earlier token plus its own causal prefix
                q_pos = torch.arange(start, start + n, device=device).unsqueeze(1)
                k_pos = torch.arange(start + n, device=device).unsqueeze(0)
                visible = k_pos <= q_pos
                if layer.slides:
                    visible &= k_pos > q_pos - window
                op = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=visible, scale=layer.scale, enable_gqa=True
                )
            outs.append(op[0].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
