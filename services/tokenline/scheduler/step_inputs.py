"""One engine step's chunks as the tensors the forward pass reads.

The step is one flat batch of token rows from many sequences. Each row gets its token id,
position and pool slot; then each kind of chunk gets what its attention needs: decode rows (one
token) either a gather of their contexts from the pool and a padding mask, or, on CPU, a plan
over the dense decode rows; prompt-starting chunks one padded causal batch; chunks that continue
a prompt the pool slots of everything before them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenline.scheduler.decode_contexts import DecodeContexts, DecodePlan, decode_masks
from tokenline.scheduler.policy import Chunk


@dataclass
class FirstChunks:
    """Prefill chunks that start their prompt, padded to one ``[S, n_max]`` batch.

    Such a chunk attends only to its own tokens, so the step's fresh K/V serve as its context
    (nothing is read back from the pool) and one causal attention call covers them all:
    padding sits after each chunk's last token, where the causal mask hides it from the real
    queries, and the padded rows' outputs are dropped.
    """

    index: torch.Tensor  # [S * n_max] token row of each padded position (padding repeats a row)
    shape: tuple[int, int]  # (S, n_max)
    valid: torch.Tensor | None  # positions of real tokens in the padded layout; None: no padding
    rows: torch.Tensor  # [real tokens] their token rows, in the order of ``valid``
    window_mask: torch.Tensor | None = None  # [n_max, n_max] banded causal, for sliding layers


@dataclass
class StepInputs:
    """Tensors describing one step's flat batch."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    max_position: int  # the largest of them
    slots: torch.Tensor  # [T] where each token's K/V goes in the pool
    sample_rows: torch.Tensor  # the last token row of every chunk that samples
    prefills: list[
        tuple[int, int, torch.Tensor, int]
    ]  # chunks that continue a prompt: (row start, n, context slots, context start)
    first_chunks: FirstChunks | None = None  # chunks that start a prompt, attended as one batch
    decode_rows: torch.Tensor | None = None  # token rows of single-token chunks
    decode_gather: torch.Tensor | None = None  # [B, Lmax] pool slots of their contexts
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] additive: 0 inside, -inf past
    decode_window_mask: torch.Tensor | None = None  # the same, also -inf before the window
    decode_plan: DecodePlan | None = None  # instead of gather and mask with dense decode rows
    decode_only: bool = False  # every row is a decode row, in order: no gather or scatter


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Pool slots of positions ``start..end-1`` of a sequence with this block table."""
    table = torch.tensor(block_table, dtype=torch.long)
    pos = torch.arange(start, end)
    return table[pos // block_size] * block_size + pos % block_size


def build_step_inputs(
    chunks: list[Chunk],
    *,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    kv_cache: torch.Tensor,
    decode_contexts: DecodeContexts | None,
    window: int | None = None,
) -> StepInputs:
    # Built as Python ints and turned into tensors once: a decode step has one token per
    # sequence, and a tensor per sequence would cost more than the token.
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_uids: list[str] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills = []
    first_spans: list[tuple[int, int]] = []
    sample_rows = []
    row = 0
    for chunk in chunks:
        seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
        table = seq.block_table
        ids.extend(seq.token_slice(start, start + n))
        span = range(start, start + n)
        positions.extend(span)
        slots.extend(table[p // bs] * bs + p % bs for p in span)
        if n == 1:
            decode_rows.append(row)
            decode_uids.append(seq.uid)
            decode_tables.append(table)
            decode_lens.append(start + 1)
        elif start == 0:
            first_spans.append((row, n))
        else:
            context = slots_of(table, 0, start + n, bs).to(device)
            prefills.append((row, n, context, start))
        row += n
        if chunk.samples:
            sample_rows.append(row - 1)
    step = StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        max_position=max(positions),
        slots=torch.tensor(slots, dtype=torch.long, device=device),
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        prefills=prefills,
        first_chunks=_first_chunks(first_spans, device, window, dtype) if first_spans else None,
    )
    if not decode_rows:
        return step
    step.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
    step.decode_only = not (prefills or first_spans)
    if decode_contexts is not None:
        step.decode_plan = decode_contexts.plan(
            decode_uids,
            [n - 1 for n in decode_lens],
            lambda i, n: kv_cache.index_select(1, slots_of(decode_tables[i], 0, n, bs)),
            window,
        )
        return step
    lmax = max(decode_lens)
    width = -(-lmax // bs)
    tables = torch.tensor(
        [t[:width] + [0] * (width - len(t[:width])) for t in decode_tables], dtype=torch.long
    )
    pos = torch.arange(lmax)
    gather = tables[:, pos // bs] * bs + pos % bs
    mask, window_mask = decode_masks(decode_lens, lmax, window, dtype)
    step.decode_gather = gather.to(device)
    step.decode_mask = mask.to(device)
    if window_mask is not None:
        step.decode_window_mask = window_mask.to(device)
    return step


def _first_chunks(
    spans: list[tuple[int, int]], device: torch.device, window: int | None, dtype: torch.dtype
) -> FirstChunks:
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
        window_mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, -torch.inf)
        window_mask = window_mask.to(device)
    return FirstChunks(
        index=torch.tensor(index, dtype=torch.long, device=device),
        shape=(len(spans), longest),
        valid=torch.tensor(valid, dtype=torch.long, device=device) if padded else None,
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        window_mask=window_mask,
    )
