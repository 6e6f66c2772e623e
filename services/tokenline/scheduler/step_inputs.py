"""One engine step's chunks as the flat batch the forward pass reads.

The step is one flat batch of token rows from many sequences. Each row gets its token id,
position and pool slot, and each chunk is sorted by the kind of attention it needs: a decode
token (a chunk of one), a chunk that starts its prompt, or a chunk that continues one. What
each kind's attention reads (gathers, masks, plans) is its attention path's to build
(``attention/``), from what is described here.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from tokenline.scheduler.policy import Chunk


@dataclass
class DecodeRows:
    """The step's single-token chunks, in step order."""

    rows: list[int] = field(default_factory=list)  # token row of each
    uids: list[str] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)  # block table of each
    lens: list[int] = field(default_factory=list)  # context length, this step's token included


@dataclass
class StepBatch:
    """One step's flat batch of token rows and the chunks they come from, by kind."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    max_position: int  # the largest of them
    slots: torch.Tensor  # [T] where each token's K/V goes in the pool
    sample_rows: torch.Tensor  # the last token row of every chunk that samples (and its
    # proposals' rows, speculative/verify.py)
    decode: DecodeRows
    first_spans: list[tuple[int, int]]  # chunks that start a prompt: (row start, n)
    first_tables: list[list[int]]  # their block tables, in the same order
    # chunks that continue a prompt: (row start, n, block table, context start)
    continued: list[tuple[int, int, list[int], int]]

    @property
    def decode_only(self) -> bool:
        """Every row is a decode row, in order: decode attention covers the step as is."""
        return bool(self.decode.rows) and not (self.first_spans or self.continued)


def long_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.long)`` on the CPU at a fraction of its cost: the ints
    are packed by ``array`` in C and the tensor shares that buffer (benchmarks/README.md)."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


def float_tensor(values: list[float]) -> torch.Tensor:
    """``torch.tensor(values)`` (float32, on the CPU) the way `long_tensor` builds its ints."""
    return torch.frombuffer(array("f", values), dtype=torch.float32) if values else torch.empty(0)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, without making the host wait: on CUDA it is copied from
    pinned memory, asynchronously (a copy from pageable memory first waits for every kernel
    queued before it; torch's caching host allocator keeps the pinned block until the copy is
    done); on the CPU it is the tensor itself."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def copy_into(target: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a host tensor into a device buffer that stays where it is (a captured graph reads
    it there), without making the host wait (see `to_device`)."""
    if target.device.type != "cuda":
        target.copy_(host)
    else:
        target.copy_(host.pin_memory(), non_blocking=True)


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Pool slots of positions ``start..end-1`` of a sequence with this block table."""
    table = torch.tensor(block_table, dtype=torch.long)
    pos = torch.arange(start, end)
    return table[pos // block_size] * block_size + pos % block_size


def build_step_batch(chunks: list[Chunk], *, block_size: int, device: torch.device) -> StepBatch:
    # Built as Python ints and turned into one tensor (one copy to the device), then viewed as
    # four: a decode step has one token per sequence, and a tensor per sequence, or per field,
    # would cost more than the token.
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode = DecodeRows()
    first_spans: list[tuple[int, int]] = []
    first_tables: list[list[int]] = []
    continued: list[tuple[int, int, list[int], int]] = []
    sample_rows: list[int] = []
    row = 0
    for chunk in chunks:
        seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
        table = seq.block_table
        if n == 1:  # a decode token, most rows of a busy step: no ranges, no slices
            prompt_len = len(seq.prompt_ids)
            ids.append(
                seq.prompt_ids[start] if start < prompt_len else seq.output_ids[start - prompt_len]
            )
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            decode.rows.append(row)
            decode.uids.append(seq.uid)
            decode.tables.append(table)
            decode.lens.append(start + 1)
        else:
            ids.extend(seq.token_slice(start, start + n - len(chunk.proposals)))
            ids.extend(chunk.proposals)
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            if start == 0:
                first_spans.append((row, n))
                first_tables.append(table)
            else:
                continued.append((row, n, table, start))
        row += n
        if chunk.samples:  # with proposals, every row from the last known token's samples
            sample_rows.extend(range(row - 1 - len(chunk.proposals), row))
    flat = to_device(long_tensor(ids + positions + slots + sample_rows), device)
    return StepBatch(
        input_ids=flat[:row],
        positions=flat[row : 2 * row],
        max_position=max(positions),
        slots=flat[2 * row : 3 * row],
        sample_rows=flat[3 * row :],
        decode=decode,
        first_spans=first_spans,
        first_tables=first_tables,
        continued=continued,
    )
