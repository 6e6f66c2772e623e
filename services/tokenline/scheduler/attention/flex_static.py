"""One decode bucket's flex attention metadata in fixed buffers, so that a captured CUDA graph
can replay the step over new contents.

A bucket of B rows holds everything a decode step reads: token ids, positions, pool slots,
context lengths and block tables in one packed int64 buffer (one non-blocking copy from the
host per step), and the block masks' lists and the rows' block maps, rebuilt from them on the
device. Rows past the step's sequences are padding: token 0 at position 0, writing its K/V into
slot 0 of block 0 (a block the pool never hands out) and attending to that slot alone. Every
bucket lives in the largest one's memory (one step runs at a time).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from tokenline.scheduler.attention.flex import (
    Q_BLOCK,
    BlockMap,
    FlexAttentionBackend,
    FlexMetadata,
    FlexRows,
    _visible,
)
from tokenline.scheduler.step_inputs import copy_into, long_tensor


class StaticDecode:
    """``shared``: the largest bucket's buffers, whose first rows this bucket uses."""

    def __init__(
        self, backend: FlexAttentionBackend, bucket: int, shared: StaticDecode | None = None
    ) -> None:
        shape, device = backend.shape, backend.shape.device
        self.bucket, self.width, self.block_size = bucket, backend.width, shape.block_size
        self.window = shape.window
        rows, width = bucket, self.width
        if shared is None:
            self.storage = torch.zeros(rows * (4 + width), dtype=torch.long, device=device)
            # as many rows as the unpadded calls' maps: the compiled kernel sees one shape
            self.block_map = BlockMap(
                shape.max_num_seqs, backend.num_blocks, shape.block_size, device
            )
            # the block lists of the whole mask and of the sliding layers' mask
            self.counts = torch.zeros(2, rows, dtype=torch.int32, device=device)
            self.lists = torch.zeros(2, rows, width, dtype=torch.int32, device=device)
        else:
            self.storage, self.block_map = shared.storage, shared.block_map
            self.counts, self.lists = shared.counts, shared.lists
        # ids, positions, slots, context lengths, then the block tables, row after row
        self.packed = self.storage[: rows * (4 + width)]
        self.input_ids, self.positions, self.slots, self.lens = self.packed[: 4 * rows].view(
            4, rows
        )
        self.tables = self.packed[4 * rows :].view(rows, width)
        self._places = torch.arange(width, device=device)
        self.sample_rows = torch.arange(rows, device=device)
        block_map = self.block_map

        def mask(window: int | None) -> BlockMask:
            which = 0 if window is None else 1
            kv_num = self.counts[which, :rows].view(rows, 1, 1)
            kv_indices = self.lists[which, :rows].view(rows, 1, 1, width)
            return BlockMask.from_kv_blocks(
                kv_num,
                kv_indices,
                full_kv_num_blocks=torch.zeros_like(kv_num),
                full_kv_indices=torch.zeros_like(kv_indices),
                BLOCK_SIZE=(Q_BLOCK, self.block_size),
                mask_mod=_visible(
                    block_map.map, block_map.starts, block_map.lens, self.block_size, window
                ),
                seq_lengths=(1, backend.num_blocks * self.block_size),
                compute_q_blocks=False,
            )

        self.metadata = FlexMetadata(
            slots=self.slots,
            parts=[
                FlexRows(
                    rows=None,
                    index=self.sample_rows,
                    valid=None,
                    shape=(rows, 1),
                    mask=mask(None),
                    window_mask=None if self.window is None else mask(self.window),
                )
            ],
            whole=True,
        )

    def update(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
    ) -> None:
        """Write a decode step's rows (up to the bucket: the rest are padding) into the
        buffers, then rebuild the masks' lists and the block maps from them on the device."""
        rows, width, real = self.bucket, self.width, len(ids)
        pad = [0] * (rows - real)
        lens = [p + 1 for p in positions]
        flat = ids + pad + positions + pad + slots + pad + lens + [1] * (rows - real)
        for table in tables:
            flat += table[:width] + [0] * (width - min(width, len(table)))
        flat += [0] * (width * (rows - real))
        copy_into(self.packed, long_tensor(flat))
        self.block_map.fill(self.tables, self.positions, torch.ones_like(self.lens))
        used = (self.lens + self.block_size - 1) // self.block_size  # blocks of each context
        listed = self._places < used.unsqueeze(1)
        self.counts[0, :rows].copy_(used)
        self.lists[0, :rows].copy_(torch.where(listed, self.tables, 0))
        if self.window is not None:
            first = (self.positions - self.window + 1).clamp(min=0) // self.block_size
            shifted = (first.unsqueeze(1) + self._places).clamp(max=width - 1)
            count = used - first
            in_window = self._places < count.unsqueeze(1)
            self.counts[1, :rows].copy_(count)
            self.lists[1, :rows].copy_(torch.where(in_window, self.tables.gather(1, shifted), 0))
