"""The dense decode rows: each decoding uid's row holds exactly its context, rows stay packed,
and a uid that stops decoding loses its row at once."""

from __future__ import annotations

import pytest
import torch

from tokenline.scheduler.attention.decode_contexts import (
    MAX_LONG_ROWS,
    MIN_CAPACITY,
    ZEROED_COLUMNS,
    DecodeContexts,
    short_length,
)

LAYERS, KV_WIDTH, HEAD_DIM = 2, 4, 3


@pytest.fixture(autouse=True)
def uninitialised_memory_is_nan(monkeypatch):
    """The rows' buffer is taken uninitialised: filled with NaN here, so that a column
    attention reads and nobody wrote shows (0 x NaN poisons a whole row of attention)."""
    real_empty = torch.empty

    def nan_filled(*shape, **kwargs):
        return real_empty(*shape, **kwargs).fill_(torch.nan)

    monkeypatch.setattr(torch, "empty", nan_filled)


def value(uid: str, pos: int) -> float:
    """What the fake pool holds for ``uid`` at ``pos``: unique per (uid, position)."""
    return 1000.0 * (int(uid.removeprefix("u")) + 1) + pos


class FakeRunner:
    """Plays the runner's part: fills new rows from a "pool" and writes each step's token."""

    def __init__(self) -> None:
        self.contexts = DecodeContexts(LAYERS, KV_WIDTH, HEAD_DIM, torch.float32)

    def step(self, lens: dict[str, int]):
        """Decode one token for each uid, whose context has ``lens[uid]`` tokens before it."""
        uids = list(lens)

        def fill(i: int, n: int) -> torch.Tensor:
            column = torch.tensor([value(uids[i], p) for p in range(n)])
            return column[None, :, None, None].expand(LAYERS, n, KV_WIDTH, HEAD_DIM).clone()

        plan = self.contexts.plan(uids, [lens[u] for u in uids], fill)
        new = torch.tensor([value(u, lens[u]) for u in uids])[:, None, None]
        for layer in range(LAYERS):
            self.contexts.buffer[layer][plan.rows, :, plan.positions] = new.expand(
                -1, KV_WIDTH, HEAD_DIM
            )
        return plan

    def row_of(self, plan, uids: list[str], uid: str) -> int:
        return int(plan.rows[uids.index(uid)])

    def assert_holds(self, plan, lens: dict[str, int]) -> None:
        """Every uid's row holds its context plus this step's token, and finite values after
        it as far as attention reads (the longest context), and the mask agrees."""
        uids = list(lens)
        assert plan.num_rows == len(uids)
        assert sorted(plan.rows.tolist()) == list(range(len(uids))), "rows are not packed"
        assert plan.length == max(lens.values()) + 1
        for uid, n in lens.items():
            row = self.row_of(plan, uids, uid)
            held = self.contexts.buffer[:, row, :, : n + 1]
            expected = torch.tensor([value(uid, p) for p in range(n + 1)])
            assert torch.equal(held, expected[None, None, :, None].expand_as(held)), uid
            # a long row reads only its own context; the others, the short call's columns
            long_rows = dict(plan.long_rows)
            assert long_rows.get(row, n + 1) == n + 1
            read = n + 1 if row in long_rows else plan.short_length
            assert read >= n + 1 or row in long_rows, f"{uid}: its context is not read whole"
            tail = self.contexts.buffer[:, row, :, n + 1 : read]
            assert bool(tail.isfinite().all()), f"{uid}: a column past its context is not finite"
            if plan.mask is None:  # nothing to hide: every context is the longest
                assert n + 1 == plan.length, uid
                continue
            mask = plan.mask[row, 0, 0]
            assert torch.all(mask[: n + 1] == 0) and torch.all(mask[n + 1 :] == -torch.inf)
        if plan.order is not None:
            assert plan.rows[plan.order].tolist() == list(range(len(uids)))


def test_rows_follow_contexts_across_steps_joins_and_leaves():
    runner = FakeRunner()
    lens = {"u0": 5, "u1": 2}
    for _ in range(3):
        runner.assert_holds(runner.step(lens), lens)
        lens = {u: n + 1 for u, n in lens.items()}
    lens["u2"] = 9  # joins after its prefill
    runner.assert_holds(runner.step(lens), lens)
    lens = {u: n + 1 for u, n in lens.items()}
    del lens["u0"]  # finished: its row is refilled by the last one
    runner.assert_holds(runner.step(lens), lens)
    assert runner.contexts.num_rows == 2


def test_a_uid_that_skips_a_step_is_filled_again_from_the_pool():
    """Paused, preempted or back in prefill: the row is dropped, never reused stale."""
    runner = FakeRunner()
    runner.step({"u0": 4, "u1": 4})
    runner.step({"u1": 5})  # u0 did not decode this step
    assert runner.contexts.num_rows == 1
    lens = {"u0": 4, "u1": 6}  # u0 resumes at the same length it had
    runner.assert_holds(runner.step(lens), lens)


def test_a_row_out_of_step_with_the_pool_is_refilled():
    """A uid whose context length is not what its row holds (recomputed after preemption)."""
    runner = FakeRunner()
    runner.step({"u0": 4})
    lens = {"u0": 2}
    runner.assert_holds(runner.step(lens), lens)


def test_the_mask_is_left_out_only_when_every_context_is_the_longest():
    runner = FakeRunner()
    runner.assert_holds(runner.step({"u0": 7}), {"u0": 7})
    assert runner.step({"u0": 8}).mask is None  # one row
    assert runner.step({"u0": 9, "u1": 8}).mask is not None
    assert runner.step({"u0": 10, "u1": 10}).mask is None
    lens = {"u0": 11, "u1": 11, "u2": 3}
    plan = runner.step(lens)
    assert plan.mask is not None
    runner.assert_holds(plan, lens)
    lens = {"u1": 12, "u2": 4}  # u0 left: its row is refilled by u2's, mask row included
    runner.assert_holds(runner.step(lens), lens)


def test_rows_in_another_order_than_the_step_are_mapped_both_ways():
    runner = FakeRunner()
    runner.step({"u0": 1, "u1": 1, "u2": 1})
    lens = {"u2": 2, "u0": 2, "u1": 2}
    plan = runner.step(lens)
    assert plan.order is not None
    runner.assert_holds(plan, lens)


@pytest.mark.parametrize("first, later", [(3, MIN_CAPACITY + 5), (MIN_CAPACITY - 1, 300)])
def test_growing_capacity_keeps_what_the_rows_hold(first, later):
    runner = FakeRunner()
    runner.step({"u0": first})
    lens = {"u0": first + 1, "u1": later}
    runner.assert_holds(runner.step(lens), lens)
    assert runner.contexts.buffer.shape[3] >= later + 1


def test_clear_gives_the_memory_back():
    runner = FakeRunner()
    runner.step({"u0": 10, "u1": 3})
    runner.contexts.clear()
    assert runner.contexts.num_rows == 0 and runner.contexts.buffer.numel() == 0
    lens = {"u1": 4}
    runner.assert_holds(runner.step(lens), lens)


def test_capacity_follows_the_load_down_while_busy():
    """Under sustained load the rows shrink without an idle moment: when the rows in use or
    the longest context fall to a quarter of what is allocated, the buffer is cut to twice the
    need, and what the rows hold survives the cut."""
    runner = FakeRunner()
    big = {f"u{i}": 300 + i for i in range(16)}
    runner.step(big)
    _, rows, _, capacity, _ = runner.contexts.buffer.shape
    assert rows >= 16 and capacity >= 316
    lens = {"u0": 301, "u1": 302, "u2": 303}  # most finished: rows fall under a quarter
    runner.assert_holds(runner.step(lens), lens)
    assert runner.contexts.buffer.shape[1] == 6
    assert runner.contexts.buffer.shape[3] == capacity  # the longest context still needs it
    lens = {"u20": 10, "u21": 3}  # long contexts gone, short ones decode
    runner.assert_holds(runner.step(lens), lens)
    assert runner.contexts.buffer.shape[1] == 6  # 2 rows of 6 is above a quarter
    assert runner.contexts.buffer.shape[3] == MIN_CAPACITY
    lens = {"u20": 11}
    runner.assert_holds(runner.step(lens), lens)
    assert runner.contexts.buffer.shape[1] == 2


def test_a_load_wavering_around_a_size_does_not_reallocate_every_step():
    """Hysteresis: after a cut the need must double or quarter again before the next one."""
    runner = FakeRunner()
    runner.step({f"u{i}": 100 for i in range(8)})
    buffers = set()
    for n in range(40):
        live = 3 if n % 2 else 4  # between a quarter and the whole of 8 rows
        runner.step({f"u{i}": 100 for i in range(live)} | {f"u{100 + n}": 1})
        buffers.add(runner.contexts.buffer.data_ptr())
    assert len(buffers) == 1


def test_rows_joining_leaving_and_growing_keep_what_attention_reads_defined():
    runner = FakeRunner()
    for lens in [
        {"u0": 3},
        {"u0": 4, "u1": 2, "u2": 7},  # rows grow
        {"u0": 5, "u1": MIN_CAPACITY + 3, "u2": 8},  # u1 back from prefill: capacity grows
        {"u1": MIN_CAPACITY + 4, "u2": 9, "u3": 1},  # u0 left, u3 takes a row used before
        {"u1": MIN_CAPACITY + 5, "u2": 10, "u3": 2, "u4": 4 * MIN_CAPACITY},  # grows again
        {"u2": 11, "u3": 3, "u4": 4 * MIN_CAPACITY + 1},
    ]:
        runner.assert_holds(runner.step(lens), lens)


def test_columns_given_back_by_a_cut_are_zeroed_again_when_the_rows_grow_back():
    runner = FakeRunner()
    runner.step({"u0": 300, "u1": 5})
    lens = {"u1": 6, "u2": 3}  # the long context left: capacity is cut
    runner.assert_holds(runner.step(lens), lens)
    assert runner.contexts.buffer.shape[3] == MIN_CAPACITY
    lens = {"u1": 7, "u2": 4, "u3": 200}  # a long one joins: capacity grows back
    runner.assert_holds(runner.step(lens), lens)


def test_steady_decoding_across_growths_reads_only_defined_columns():
    """The same rows one token on each step (no rearrangement) while the longest context
    doubles the capacity twice: every column attention reads is K/V or zero."""
    runner = FakeRunner()
    lens = {"u0": 5, "u1": MIN_CAPACITY - 20, "u2": 1}
    for _ in range(3 * MIN_CAPACITY):
        runner.assert_holds(runner.step(lens), lens)
        lens = {uid: n + 1 for uid, n in lens.items()}
    assert runner.contexts.buffer.shape[3] == 4 * MIN_CAPACITY


def test_a_growth_writes_the_columns_in_use_not_the_new_capacity():
    """Doubling the capacity copies what the rows hold and zeroes only the next few columns
    attention reads; the rest of the new capacity is left for later steps to make finite
    (under this file's fixture, untouched memory is NaN)."""
    runner = FakeRunner()
    lens = {"u0": MIN_CAPACITY - 1, "u1": 20}  # within four times: one call reads both
    runner.step(lens)
    lens = {"u0": MIN_CAPACITY, "u1": 21}
    runner.assert_holds(runner.step(lens), lens)
    buffer = runner.contexts.buffer
    assert buffer.shape[3] == 2 * MIN_CAPACITY
    zeroed = MIN_CAPACITY + ZEROED_COLUMNS
    assert bool(buffer[:, :2, :, :zeroed].isfinite().all())
    assert bool(buffer[:, :2, :, zeroed:].isnan().all())


def test_a_few_contexts_far_longer_than_the_rest_attend_apart():
    assert short_length([10, 12, 400]) == 12  # 400 is over four times 12
    assert short_length([11, 12, 40]) == 40  # 40 is not: one call reads 40 columns
    assert short_length([100] * 3) == 100
    many_long = [8] + [400] * (MAX_LONG_ROWS + 1)
    assert short_length(many_long) == 400  # so many long rows: padding is the lesser cost
    assert short_length([8] + [400] * MAX_LONG_ROWS) == 8


def test_a_long_row_joining_short_ones_keeps_its_kv_past_the_columns_made_finite():
    """A long context joins three short ones: its K/V is held whole, the short rows are made
    finite only as far as the short call reads, and growths, a cut and the long row's
    leaving keep every column read defined."""
    runner = FakeRunner()
    steps = [
        {"u0": 5, "u1": 9, "u2": 3},
        {"u0": 6, "u1": 10, "u2": 4, "u3": 2000},  # joins from a prefill elsewhere
        {"u0": 7, "u1": 11, "u2": 5, "u3": 2001},
        {"u0": 8, "u1": 12, "u3": 2002, "u4": 700},  # a second long one
        {"u0": 9, "u1": 13, "u4": 701},  # the longest left
        {"u0": 10, "u1": 14, "u4": 702, "u5": 30},
        {"u0": 11, "u1": 15, "u5": 31},  # every long one left: the capacity is cut
    ]
    for lens in steps:
        plan = runner.step(lens)
        runner.assert_holds(plan, lens)
    assert runner.contexts.buffer.shape[3] == MIN_CAPACITY


def test_a_long_row_costs_one_growth_not_one_a_step():
    runner = FakeRunner()
    runner.step({"u0": 5, "u1": 1000})
    buffer = runner.contexts.buffer
    assert buffer.shape[3] == 1024  # a power of two that holds it
    for n in range(1001, 1020):
        runner.step({"u0": 5 + n - 1000, "u1": n})
    assert runner.contexts.buffer.data_ptr() == buffer.data_ptr()
    # the short row was never made finite out to the long row's columns
    assert runner.contexts._finite_columns < 1000


def test_a_growth_beside_a_long_row_copies_only_what_each_row_holds():
    """Rows joining while a long context decodes grow the buffer: the short rows are copied
    as far as they are finite, not out to the long row's length (under this file's fixture,
    memory nobody wrote is NaN)."""
    runner = FakeRunner()
    first = {"u0": 5, "u1": 3, "u2": 1000}
    plan = runner.step(first)
    finite = runner.contexts._finite_columns
    marked = runner.row_of(plan, list(first), "u0")
    runner.contexts.buffer[:, marked, :, finite:1000] = 7.0  # past what it holds: not copied
    lens = {"u0": 6, "u1": 4, "u2": 1001, "u3": 2, "u4": 7}  # five rows: the rows double
    plan = runner.step(lens)
    runner.assert_holds(plan, lens)
    assert runner.contexts.buffer.shape[1] > 3  # it grew
    finite = runner.contexts._finite_columns
    assert finite < 1000
    short_row = runner.row_of(plan, list(lens), "u0")
    assert short_row == marked
    assert bool(runner.contexts.buffer[:, short_row, :, finite:1000].isnan().all())
