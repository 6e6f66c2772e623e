"""Dense copies of the decoding sequences' K/V, so a CPU decode step reads them in place.

A decode step on CPU is bound by memory traffic, and gathering every sequence's context out of
the paged pool copies that whole context once per layer per step: about a fifth of the step for
16 sequences of the tiny model (benchmarks/README.md). Here each decoding sequence owns a row of
one dense ``[layers, rows, 2 * kv_heads, capacity, head_dim]`` tensor that grows by one token
per step, and attention reads the rows where they lie.

The paged pool stays the source of truth; this is a cache of it. A row is filled from the pool
when its sequence starts decoding and dropped in the first step the sequence does not decode
(finished, aborted, paused, preempted or back in prefill), so it can never go stale. Rows are
kept packed (a dropped row is filled by the last one), which lets one attention call cover them
all. The cost is memory: up to twice the running sequences' K/V again (rows and capacity
double as the batch and its contexts grow), on top of the pool. It follows the load down
while busy: when the rows in use or the longest context fall to a quarter of what is
allocated, the buffer is cut to twice the need (the gap between doubling and quartering keeps
a wavering load from reallocating every step), and all of it is given back whenever nothing
runs. On a GPU the gather is cheap next to the memory this copy would take, so only CPU uses
it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenline.scheduler.step_inputs import long_tensor

MIN_CAPACITY = 64  # tokens per row; capacity doubles (to a power of two that holds the
# context) when a context outgrows it, and halves back to twice the longest context when that
# falls to a quarter of it
MAX_LONG_ROWS = 4  # rows attending apart from the others, each over its own context alone
ZEROED_COLUMNS = 16  # columns made finite at a time as the longest context reaches them: 16
# fp32 columns of a 64-wide head are one 4 KiB page, so each page is first touched by the
# step that needs it, not all at once when the capacity doubles


@dataclass
class DecodePlan:
    """Where this step's decode tokens sit in the dense rows."""

    rows: torch.Tensor  # [B] the row of each decode token, in step order
    positions: torch.Tensor  # [B] where its K/V goes in that row
    order: torch.Tensor | None  # [B] step index of each row; None when rows are in step order
    num_rows: int
    length: int  # the longest context including this step's token
    # [rows, 1, 1, length] additive: 0 inside a row's context, -inf past it; None when every
    # row's context is ``length`` long (nothing to hide: always so for a single row)
    mask: torch.Tensor | None
    window_mask: torch.Tensor | None = None  # the same, also -inf before a sliding window
    # Columns one attention call over every row reads: ``length``, or less when a few rows'
    # contexts are far longer than the rest (``long_rows``): padding every row to those would
    # multiply the call's work by the rows, so those few attend again, each over its own
    # context alone, and their results replace what the short call gave them.
    short_length: int = 0
    long_rows: list[tuple[int, int]] = field(default_factory=list)  # (row, its context)


def decode_masks(
    lens: list[int], length: int, window: int | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Additive ``[rows, 1, 1, length]`` masks for decode rows holding ``lens`` tokens: 0
    inside a row's context, -inf past it; and, when a sliding ``window`` hides anything, the
    same with -inf before the window too. Additive and in the model's dtype: SDPA would
    convert a boolean mask in every layer."""
    columns = torch.arange(length).unsqueeze(0)
    held = long_tensor(lens).unsqueeze(1)
    mask = torch.zeros(len(lens), length, dtype=dtype).masked_fill_(columns >= held, -torch.inf)
    window_mask = None
    if window is not None and length > window:
        window_mask = hide_before_window(mask, lens, window)
    return mask[:, None, None, :], window_mask


def hide_before_window(mask: torch.Tensor, lens: list[int], window: int) -> torch.Tensor:
    """``mask`` ([rows, length], additive) with -inf also before each row's sliding window,
    as ``[rows, 1, 1, length]``."""
    columns = torch.arange(mask.shape[1]).unsqueeze(0)
    held = long_tensor(lens).unsqueeze(1)
    return mask.masked_fill(columns < held - window, -torch.inf)[:, None, None, :]


class DecodeContexts:
    def __init__(self, num_layers: int, kv_width: int, head_dim: int, dtype: torch.dtype) -> None:
        self._shape = (num_layers, kv_width, head_dim)
        self.dtype = dtype
        self.buffer = torch.empty(num_layers, 0, kv_width, 0, head_dim, dtype=dtype)
        # [rows, capacity] additive mask of what each row holds, kept step by step like the
        # rows themselves: built afresh it was a quarter of a batch-1 step's host work
        self._mask = torch.empty(0, 0, dtype=dtype)
        # Attention reads a row's masked columns too, where a weight of 0 times NaN would
        # poison the whole row: rows below _finite_rows hold K/V, zeros or a former row's
        # K/V in every column below _finite_columns. The buffer is taken uninitialised (see
        # _reserve), so a row past them is zeroed when first taken (once per row per
        # buffer), and columns are zeroed ZEROED_COLUMNS at a time as attention comes to
        # read them (once per column per buffer): never the whole buffer in one step.
        self._finite_rows = 0
        self._finite_columns = 0
        self._row_of: dict[str, int] = {}
        self._uids: list[str] = []  # by row
        self._lens: list[int] = []  # tokens held, by row

    @property
    def num_rows(self) -> int:
        return len(self._uids)

    def clear(self) -> None:
        """Drop every row and the memory behind them (the engine has gone idle)."""
        num_layers, kv_width, head_dim = self._shape
        self.buffer = torch.empty(num_layers, 0, kv_width, 0, head_dim, dtype=self.dtype)
        self._mask = torch.empty(0, 0, dtype=self.dtype)
        self._finite_rows = 0
        self._finite_columns = 0
        self._row_of.clear()
        self._uids.clear()
        self._lens.clear()

    def plan(
        self,
        uids: list[str],
        starts: list[int],
        fill: Callable[[int, int], torch.Tensor],
        window: int | None = None,
    ) -> DecodePlan:
        """Rows for this step's decode tokens: ``uids[i]`` feeds position ``starts[i]``.

        ``fill(i, n)`` returns the first ``n`` tokens of decode token ``i``'s context from the
        pool as ``[layers, n, kv_width, head_dim]``; it is called only for new rows.
        ``window``: the model's sliding attention window, if any of its layers slide.
        """
        lens, row_of = self._lens, self._row_of
        longest = max(starts) + 1
        short = short_length([n + 1 for n in starts])
        if uids != self._uids or lens != starts:
            self._rearrange(uids, starts, fill, short)
        else:  # the same sequences, one token on: only capacity may need to grow
            self._reserve(len(uids), longest, short)
        rows = [row_of[uid] for uid in uids]
        for row in rows:
            lens[row] += 1
        num_rows = len(self._uids)
        long_rows = [(row, n) for row, n in enumerate(lens) if n > short]
        row_index, positions = long_tensor(rows), long_tensor(starts)
        self._mask.index_put_((row_index, positions), torch.zeros((), dtype=self.dtype))
        mask = None
        if min(lens) < longest:
            mask = self._mask[:num_rows, None, None, :longest]
        window_mask = None
        if window is not None and longest > window:
            window_mask = hide_before_window(self._mask[:num_rows, :longest], lens, window)
        order = None
        if rows != list(range(num_rows)):  # attention runs in row order
            by_row = [0] * num_rows
            for i, row in enumerate(rows):
                by_row[row] = i
            order = long_tensor(by_row)
        return DecodePlan(
            rows=row_index,
            positions=positions,
            order=order,
            num_rows=num_rows,
            length=longest,
            mask=mask,
            window_mask=window_mask,
            short_length=short,
            long_rows=long_rows,
        )

    def _rearrange(
        self,
        uids: list[str],
        starts: list[int],
        fill: Callable[[int, int], torch.Tensor],
        short_columns: int,
    ) -> None:
        """Rows for a step whose decoding sequences are not those of the last step, one token
        on (steady decoding skips this): rows out of step dropped, new ones filled."""
        wanted = dict(zip(uids, starts, strict=True))
        for row in range(len(self._uids) - 1, -1, -1):
            uid = self._uids[row]
            if wanted.get(uid) != self._lens[row]:  # not decoding now, or out of step
                self._drop(row)
        self._reserve(len(uids), max(starts) + 1, short_columns)  # before new rows are filled
        for i, (uid, start) in enumerate(zip(uids, starts, strict=True)):
            if uid not in self._row_of:
                row = len(self._uids)
                self._row_of[uid] = row
                self._uids.append(uid)
                self._lens.append(start)
                self._mask[row, :start] = 0
                self._mask[row, start:] = -torch.inf
                if row >= self._finite_rows:  # rows are taken in order: row == _finite_rows
                    self.buffer[:, row, :, : self._finite_columns] = 0
                    self._finite_rows = row + 1
                if start:
                    self.buffer[:, row, :, :start] = fill(i, start).transpose(1, 2)

    def _drop(self, row: int) -> None:
        last = len(self._uids) - 1
        del self._row_of[self._uids[row]]
        if row != last:
            moved, held = self._uids[last], self._lens[last]
            # only what the moved row holds: past that, the row's former K/V is finite
            self.buffer[:, row, :, :held] = self.buffer[:, last, :, :held]
            self._mask[row] = self._mask[last]
            self._uids[row], self._lens[row] = moved, self._lens[last]
            self._row_of[moved] = row
        self._uids.pop()
        self._lens.pop()

    def _reserve(self, rows: int, length: int, short_columns: int) -> None:
        """Room for ``rows`` rows of ``length`` tokens, finite as far as the call over every
        row reads (``short_columns``; a long row reads only its own K/V).
        Each dimension doubles when outgrown and halves back to twice the need when the need
        falls to a quarter of it, so memory follows the load down while busy and a load that
        wavers around a size does not reallocate every step (it must double or quarter again
        first)."""
        _, have_rows, _, capacity, _ = self.buffer.shape
        new_rows = _resize(have_rows, rows, floor=1)
        new_capacity = _resize(capacity, length, floor=MIN_CAPACITY)
        if new_rows != have_rows or new_capacity != capacity:
            self._reallocate(new_rows, new_capacity)
        self._make_finite(short_columns)

    def _reallocate(self, new_rows: int, new_capacity: int) -> None:
        num_layers, _, kv_width, _, head_dim = self.buffer.shape
        # Uninitialised: only the rows in use are copied, and only as far as they are finite;
        # the new columns are zeroed later, as attention reaches them (_make_finite). Zeroing
        # the whole buffer made a growth fault in and write every page of it, seconds at
        # hundreds of rows, and zeroing the new columns of the rows in use was still about
        # half of a growth (benchmarks/README.md).
        resized = torch.empty(
            num_layers, new_rows, kv_width, new_capacity, head_dim, dtype=self.dtype
        )
        used, kept = len(self._uids), min(self._finite_columns, new_capacity)
        resized[:, :used, :, :kept] = self.buffer[:, :used, :, :kept]
        for row, held in enumerate(self._lens):  # a long row's K/V past them, its own only
            if held > kept:
                resized[:, row, :, kept:held] = self.buffer[:, row, :, kept:held]
        self.buffer = resized
        self._finite_rows = used
        self._finite_columns = kept
        mask = torch.full((new_rows, new_capacity), -torch.inf, dtype=self.dtype)
        copied = min(max(kept, *self._lens, 0), new_capacity)
        mask[:used, :copied] = self._mask[:used, :copied]
        self._mask = mask

    def _make_finite(self, length: int) -> None:
        """Every row taken from this buffer finite in its first ``length`` columns; a long
        row's K/V past the finite columns is kept."""
        if length <= self._finite_columns:
            return
        start, capacity = self._finite_columns, self.buffer.shape[3]
        end = min(capacity, -(-length // ZEROED_COLUMNS) * ZEROED_COLUMNS)
        held = self._lens
        if all(n <= start for n in held):
            self.buffer[:, : self._finite_rows, :, start:end] = 0
        else:
            for row in range(self._finite_rows):
                first = max(start, held[row] if row < len(held) else 0)
                if first < end:
                    self.buffer[:, row, :, first:end] = 0
        self._finite_columns = end


def short_length(lengths: list[int]) -> int:
    """The columns one attention call over every row reads: the longest of ``lengths``; or,
    when some row is at most a quarter of the longest and at most MAX_LONG_ROWS rows are
    longer than that, the longest of those short rows (the longer ones attend apart, each
    over its own context)."""
    longest = max(lengths)
    short = [n for n in lengths if 4 * n <= longest]
    if not short or len(lengths) - len(short) > MAX_LONG_ROWS:
        return longest
    return max(short)


def _resize(have: int, need: int, floor: int) -> int:
    """A dimension's new size: doubled, or to the power of two that holds ``need`` (a long
    context joining must not grow it again a step later), when outgrown; cut to twice the
    need when the need is a quarter of it or less, else kept; never under ``floor``."""
    if need > have:
        return max(1 << (need - 1).bit_length(), 2 * have, floor)
    if 4 * need <= have and have > floor:
        return max(2 * need, floor)
    return have
