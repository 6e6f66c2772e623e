"""Paged attention read in place: torch's ``flex_attention`` over the KV pool itself, with a
block mask built from the step's block tables (the default on CUDA).

Every layer's K and V are views of the pool, ``[1, kv_heads, slots, D]``: nothing is gathered
or copied per step. A step's rows attend in two calls per layer, one batch row per sequence:
decode rows (one query each) and prefill chunks (padded to the longest; first chunks,
continued chunks and chunks after a prefix-cache hit alike, since each reads its context from
the pool after its own K/V are written there). Each batch row's block mask lists the pool blocks
its queries may read (the kernel skips every other block) and its ``mask_mod`` decides each
(query, slot) pair from the sequence's own mapping of pool blocks to positions (``logical``,
``[rows, pool blocks]``): a slot is visible when it holds a position of this sequence at or
before the query's (and, in a sliding layer, inside its window). The mask alone is exact; the
block lists only spare the kernel work, so eager flex_attention (which reads every slot) and
the compiled kernels (which read the listed blocks) compute the same thing.

Compiled (``--compile``, and always on CUDA) the kernels are Triton's on a GPU and inductor's
C++ on a CPU; eager flex_attention is torch's unfused reference, for tests. The page size must
fit the kernels' tiles: see ``flex_block_size``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from tokenline.scheduler.attention.base import AttentionBackend, AttentionLayer, AttentionShape
from tokenline.scheduler.step_inputs import StepBatch, long_tensor, to_device

# The query tile of a prefill block mask: a multiple of every Triton forward kernel's BLOCK_M
# (128, 64 or 32 by GPU, dtype and head size in torch's flex heuristics).
Q_BLOCK = 128
# Triton's flex kernels read a page as tiles of BLOCK_N keys: 64 for bf16 and fp16 heads up to
# 128 wide on Ampere and Hopper, forward and decoding alike (torch's flex heuristics). A page of
# 64 slots is one tile; smaller pages would force smaller, slower tiles.
CUDA_BLOCK_SIZE = 64


def flex_block_size(device: torch.device, requested: int) -> int:
    """The KV page size the flex backend runs with: a multiple of the kernels' key tile on
    CUDA (`CUDA_BLOCK_SIZE`), what was asked for elsewhere."""
    if device.type != "cuda":
        return requested
    return -(-requested // CUDA_BLOCK_SIZE) * CUDA_BLOCK_SIZE


@dataclass
class FlexRows:
    """One attention call's batch: its token rows, padded per sequence, and its block masks."""

    rows: torch.Tensor | None  # token rows, in the order of ``valid``; None: every row in order
    index: torch.Tensor  # [S * n_max] token row of each padded query (padding repeats a row)
    valid: torch.Tensor | None  # positions of real queries in the padded layout; None: all
    shape: tuple[int, int]  # (S, n_max)
    mask: BlockMask
    window_mask: BlockMask | None  # sliding layers, when the window hides anything


@dataclass
class FlexMetadata:
    slots: torch.Tensor  # [T] pool slot of each token row
    parts: list[FlexRows]
    whole: bool  # one part covers every row in order


class FlexAttentionBackend(AttentionBackend):
    name = "flex"

    def __init__(self, shape: AttentionShape, kv_cache: torch.Tensor) -> None:
        super().__init__(shape, kv_cache)
        self.num_blocks = kv_cache.shape[1] // shape.block_size
        self.compiled = shape.device.type == "cuda" or shape.compile
        self._attend = _compiled_flex() if self.compiled else _eager_flex
        # Compiled kernels on a CPU want a block list as wide as the pool (inductor's check);
        # on CUDA a sequence's longest list is enough.
        self.width = self.num_blocks
        if shape.device.type == "cuda" and shape.max_blocks_per_seq:
            self.width = min(self.num_blocks, shape.max_blocks_per_seq)
        # one map for the decode rows' call, one for the chunks'
        rows = shape.max_num_seqs
        self._maps = [BlockMap(rows, self.num_blocks, shape.block_size, shape.device) for _ in "dc"]

    # ── once per step ───────────────────────────────────────────────────────────────────────
    def prepare(self, step: StepBatch) -> FlexMetadata:
        parts = []
        decode = step.decode
        if decode.rows:
            spans = [(row, 1, n - 1) for row, n in zip(decode.rows, decode.lens, strict=True)]
            parts.append(self._rows(spans, decode.tables, step.decode_only, self._maps[0]))
        chunks = [
            (row, n, 0, t) for (row, n), t in zip(step.first_spans, step.first_tables, strict=True)
        ]
        chunks += [(row, n, start, t) for row, n, t, start in step.continued]
        if chunks:
            chunks.sort(key=lambda chunk: chunk[0])  # in row order: with no decode row, all
            spans = [(row, n, start) for row, n, start, _ in chunks]
            tables = [t for _, _, _, t in chunks]
            parts.append(self._rows(spans, tables, not decode.rows, self._maps[1]))
        whole = len(parts) == 1 and parts[0].rows is None
        return FlexMetadata(slots=step.slots, parts=parts, whole=whole)

    def _rows(self, spans, tables, every_row: bool, block_map: BlockMap) -> FlexRows:
        """One call's batch. ``spans``: (first token row, queries, position of the first
        query) per sequence; ``tables``: their block tables; ``every_row``: the spans are
        every token row of the step, in order."""
        shape, device = self.shape, self.shape.device
        count = len(spans)
        longest = max(n for _, n, _ in spans)
        index, valid, real = [], [], []
        for i, (row, n, _) in enumerate(spans):
            index.extend(row + min(j, n - 1) for j in range(longest))
            valid.extend(range(i * longest, i * longest + n))
            real.extend(range(row, row + n))
        starts = torch.tensor([start for _, _, start in spans], dtype=torch.long)
        lens = torch.tensor([n for _, n, _ in spans], dtype=torch.long)
        blocks = max(len(t) for t in tables)
        table = torch.zeros(count, blocks, dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        block_map.fill(*(to_device(t, device) for t in (table, starts, lens)))
        mask = self._mask(table, starts, lens, longest, block_map, None)
        window_mask = None
        if shape.window is not None and int((starts + lens).max()) > shape.window:
            window_mask = self._mask(table, starts, lens, longest, block_map, shape.window)
        padded = len(valid) != len(index)
        return FlexRows(
            rows=None if every_row else to_device(long_tensor(real), device),
            index=to_device(long_tensor(index), device),
            valid=to_device(long_tensor(valid), device) if padded else None,
            shape=(count, longest),
            mask=mask,
            window_mask=window_mask,
        )

    def _mask(self, table, starts, lens, longest: int, block_map, window) -> BlockMask:
        """The block mask of one batch: per sequence and query tile, the pool blocks its
        queries may read; ``mask_mod`` decides each slot exactly."""
        bs, device = self.shape.block_size, self.shape.device
        tile = torch.arange(-(-longest // Q_BLOCK))
        first_q = starts.unsqueeze(1) + tile * Q_BLOCK  # [S, tiles]
        last_q = torch.minimum(first_q + Q_BLOCK - 1, (starts + lens - 1).unsqueeze(1))
        last_block = last_q // bs
        first_block = torch.zeros_like(last_block)
        if window is not None:
            first_block = (first_q - window + 1).clamp(min=0) // bs
        counts = torch.where(first_q <= last_q, last_block - first_block + 1, 0)
        offsets = first_block.unsqueeze(-1) + torch.arange(self.width)  # [S, tiles, width]
        listed = offsets < (first_block + counts).unsqueeze(-1)
        gathered = table.gather(1, offsets.clamp(max=table.shape[1] - 1).flatten(1))
        kv_indices = torch.where(listed, gathered.view_as(offsets), 0).to(torch.int32)
        kv_num = to_device(counts.to(torch.int32).unsqueeze(1), device)
        kv_indices = to_device(kv_indices.unsqueeze(1), device)
        return BlockMask.from_kv_blocks(
            kv_num,
            kv_indices,
            # no block is marked wholly visible (each slot goes through mask_mod); given as
            # empty lists all the same, as inductor's CPU template reads them unconditionally
            full_kv_num_blocks=torch.zeros_like(kv_num),
            full_kv_indices=torch.zeros_like(kv_indices),
            BLOCK_SIZE=(Q_BLOCK, bs),
            mask_mod=_visible(block_map.map, block_map.starts, block_map.lens, bs, window),
            seq_lengths=(longest, self.num_blocks * bs),
            compute_q_blocks=False,
        )

    # ── once per layer ──────────────────────────────────────────────────────────────────────
    def forward(self, q, k, v, layer: AttentionLayer, metadata: FlexMetadata) -> torch.Tensor:
        tokens, shape = q.shape[0], self.shape
        kvh = shape.num_kv_heads
        kv = torch.cat((k, v), dim=1).to(shape.dtype)  # [T, 2 * kv_heads, D]
        pool = self.kv_cache[layer.index]
        pool.index_copy_(0, metadata.slots, kv)
        keys = pool[:, :kvh].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, slots, D]
        values = pool[:, kvh:].transpose(0, 1).unsqueeze(0)
        if metadata.whole:
            out = self._part(q, keys, values, layer, metadata.parts[0])
        else:
            out = torch.empty_like(q)
            for part in metadata.parts:
                out.index_copy_(0, part.rows, self._part(q, keys, values, layer, part))
        return out.reshape(tokens, shape.num_heads * shape.head_dim)

    def _part(self, q, keys, values, layer: AttentionLayer, part: FlexRows) -> torch.Tensor:
        count, longest = part.shape
        heads, dim = self.shape.num_heads, self.shape.head_dim
        qp = q.index_select(0, part.index).view(count, longest, heads, dim).transpose(1, 2)
        mask = part.window_mask if layer.slides and part.window_mask is not None else part.mask
        out = self._attend(qp, keys, values, mask, layer.scale)  # [S, heads, n_max, D]
        out = out.transpose(1, 2).reshape(count * longest, heads, dim)
        return out if part.valid is None else out.index_select(0, part.valid)


class BlockMap:
    """Each row's map of pool blocks to their places in its sequence (-1: not its block), with
    the rows' first query positions and query counts, in buffers of one shape for every step:
    built on the device from the block tables (a copy of [rows, pool blocks] would be far larger
    than the tables), and captured by the masks at a shape that never changes (inductor's CPU
    kernel miscompiles a mask that indexes a buffer of varying size). The last column takes the
    writes of unused table entries and is never read."""

    def __init__(self, rows: int, num_blocks: int, block_size: int, device) -> None:
        self.block_size = block_size
        self.map = torch.full((rows, num_blocks + 1), -1, dtype=torch.int32, device=device)
        self.starts = torch.zeros(rows, dtype=torch.long, device=device)
        self.lens = torch.ones(rows, dtype=torch.long, device=device)

    def fill(self, tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor) -> None:
        """``tables`` [S, blocks]; ``starts``, ``lens`` [S]: rows 0..S-1 of the map."""
        count, blocks = tables.shape
        if count > self.map.shape[0]:  # more rows than sequences run at once: grow once
            self.__init__(count, self.map.shape[1] - 1, self.block_size, self.map.device)
        places = torch.arange(blocks, device=tables.device)
        used = places < ((starts + lens + self.block_size - 1) // self.block_size).unsqueeze(1)
        trash = self.map.shape[1] - 1
        self.map[:count].fill_(-1).scatter_(
            1,
            torch.where(used, tables, trash),
            places.to(torch.int32).expand(count, blocks).contiguous(),
        )
        self.starts[:count].copy_(starts)
        self.lens[:count].copy_(lens)


def _visible(logical, q_start, q_len, block_size: int, window: int | None):
    """The exact mask: slot ``kv`` is visible to query ``q`` of sequence ``b`` when it holds a
    position of ``b`` at or before the query's (inside the window when there is one)."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = logical[b, kv_idx // block_size]
        position = block * block_size + kv_idx % block_size
        query = q_start[b] + q_idx
        visible = (block >= 0) & (position <= query) & (q_idx < q_len[b])
        if window is not None:
            visible = visible & (position > query - window)
        return visible

    return mask_mod


def _eager_flex(q, keys, values, mask: BlockMask, scale):
    with warnings.catch_warnings():  # torch's note that eager flex_attention is unfused
        warnings.simplefilter("ignore")
        return flex_attention(q, keys, values, block_mask=mask, scale=scale, enable_gqa=True)


_COMPILED = None


def _compiled_flex():
    """flex_attention compiled once per process; shapes become dynamic after the first
    recompile. Past torch's recompile limit it would quietly run eagerly, reading the whole
    pool for every query: refused instead, loudly."""
    global _COMPILED
    if _COMPILED is None:
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        compiled = torch.compile(flex_attention)

        def attend(q, keys, values, mask: BlockMask, scale):
            return compiled(q, keys, values, block_mask=mask, scale=scale, enable_gqa=True)

        _COMPILED = attend
    return _COMPILED
