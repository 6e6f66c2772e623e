"""The scheduling policy with fake sequences and a real BlockPool: no model, milliseconds."""

from __future__ import annotations

import random

import pytest
from scheduler_testkit import (
    assert_blocks_conserved,
    assert_states_consistent,
    fake_seq,
    fake_step,
    forget_finished,
)

from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.policy import BatchPolicy
from tokenline.scheduler.refusals import KVCacheTooSmall, check_fits
from tokenline.scheduler.sequence import Status


def make_sched(
    num_blocks: int = 64,
    block_size: int = 4,
    max_seqs: int = 8,
    budget: int = 16,
    caching: bool = True,
):
    return BatchPolicy(BlockPool(num_blocks, block_size, caching=caching), max_seqs, budget)


CACHING = pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])


def assert_recomputed(chunks, seq, caching: bool) -> None:
    """The step after a preemption feeds ``seq``'s tokens again, prompt and generated alike:
    from the start without a prefix cache, else from the block boundary where what the cache
    kept of its own blocks ends."""
    [(start, n)] = fed_ranges(chunks, seq.uid)
    assert start + n == seq.num_tokens - 1, "the recompute samples the next token"
    if caching:
        assert start > 0 and start % 4 == 0, "its own blocks outlived it in the cache"
    else:
        assert start == 0


def fed_ranges(chunks, uid):
    return [(c.start, c.num_tokens) for c in chunks if c.seq.uid == uid]


# ── chunked prefill ───────────────────────────────────────────────────────────────────────────
def test_chunked_prefill_keeps_every_step_within_max_num_batched_tokens():
    sched = make_sched(budget=16)
    seqs = [fake_seq("long", 50), fake_seq("mid", 30), fake_seq("short", 3)]
    for seq in seqs:
        sched.add(seq)
    fed = {seq.uid: [] for seq in seqs}
    for _ in range(40):
        chunks = fake_step(sched)  # asserts the step's total is within the budget
        for c in chunks:
            fed[c.seq.uid].append((c.start, c.num_tokens))
        assert_blocks_conserved(sched)
        if all(len(s.output_ids) >= 3 for s in seqs):
            break
    else:
        pytest.fail("the three requests did not all reach three output tokens")

    # The long prompt is fed in budget-sized chunks, in order, each token exactly once.
    assert fed["long"][:4] == [(0, 16), (16, 16), (32, 16), (48, 2)]
    for uid, ranges in fed.items():
        position = 0
        for start, n in ranges:
            assert start == position, f"{uid}: chunk at {start}, expected {position}"
            position += n
    # The later arrivals waited for budget rather than overrunning it.
    assert fed["mid"][0] == (0, 14)  # what the long prompt's last chunk left of the step


def test_decoding_sequences_go_before_prefill_chunks():
    sched = make_sched(budget=8)
    decoder = fake_seq("decoder", 4)
    sched.add(decoder)
    fake_step(sched)  # its whole prompt in one chunk: it now decodes
    assert len(decoder.output_ids) == 1
    long = fake_seq("long", 100)
    sched.add(long)
    while long.num_computed < len(long.prompt_ids):
        before = len(decoder.output_ids)
        chunks = fake_step(sched)
        assert chunks[0].seq is decoder and chunks[0].num_tokens == 1
        assert len(decoder.output_ids) == before + 1, "the decoding request stalled"
        prefill = [c for c in chunks if c.seq is long]
        assert prefill and prefill[0].num_tokens <= 7  # what the decode token left
    assert len(decoder.output_ids) > 10


# ── admission ─────────────────────────────────────────────────────────────────────────────────
def test_admission_waits_while_the_pool_cannot_hold_the_prompt():
    sched = make_sched(num_blocks=5, block_size=4)  # 4 usable blocks, 16 tokens
    first, second = fake_seq("first", 10), fake_seq("second", 6)
    sched.add(first)
    sched.add(second)
    for _ in range(2):
        chunks = fake_step(sched)  # no exception: the second request just waits
        assert [c.seq.uid for c in chunks] == ["first"]
        assert second.status is Status.WAITING and not second.block_table
        assert_blocks_conserved(sched)


def test_admission_proceeds_once_blocks_are_freed():
    sched = make_sched(num_blocks=5, block_size=4)
    first, second = fake_seq("first", 10), fake_seq("second", 6)
    sched.add(first)
    sched.add(second)
    fake_step(sched)
    assert second.status is Status.WAITING
    sched.remove("first")
    chunks = fake_step(sched)
    assert fed_ranges(chunks, "second") == [(0, 6)]
    assert second.status is Status.RUNNING


def test_admission_keeps_arrival_order():
    sched = make_sched(num_blocks=5, block_size=4, budget=64)
    big, small = fake_seq("big", 14), fake_seq("small", 2)
    sched.add(fake_seq("holder", 6))
    fake_step(sched)
    sched.add(big)
    sched.add(small)
    chunks = fake_step(sched)
    # "big" cannot fit yet; "small" would, but does not jump the queue.
    assert {c.seq.uid for c in chunks} == {"holder"}
    assert list(sched.waiting) == [big, small]


def test_max_num_seqs_caps_the_running_set():
    sched = make_sched(max_seqs=2, budget=64)
    seqs = [fake_seq(f"s{i}", 2) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(3):
        chunks = fake_step(sched)
        assert len(chunks) == 2 and len(sched.running) == 2
        assert {c.seq.uid for c in chunks} == {"s0", "s1"}
    sched.remove("s0")
    chunks = fake_step(sched)
    assert {c.seq.uid for c in chunks} == {"s1", "s2"}  # the oldest waiting request, alone
    assert len(sched.running) == 2 and len(sched.waiting) == 2


# ── preemption ────────────────────────────────────────────────────────────────────────────────
@CACHING
def test_newest_running_sequence_is_preempted_when_blocks_run_out(caching):
    sched = make_sched(num_blocks=10, block_size=4, budget=64, caching=caching)  # 9 usable
    oldest, middle, newest = fake_seq("oldest", 8), fake_seq("middle", 8), fake_seq("newest", 8)
    for seq in (oldest, middle, newest):
        sched.add(seq)
    for _ in range(20):
        chunks = fake_step(sched)
        assert_blocks_conserved(sched)
        if sched.num_preemptions:
            break
    else:
        pytest.fail("the pool never ran out")

    assert sched.num_preemptions == 1
    assert oldest.status is Status.RUNNING and fed_ranges(chunks, "oldest")
    assert middle.status is Status.RUNNING and fed_ranges(chunks, "middle")
    assert not fed_ranges(chunks, "newest")
    assert newest.status is Status.WAITING and sched.waiting.peek() is newest
    assert newest.block_table == [] and newest.num_computed == 0
    generated = list(newest.output_ids)
    assert generated, "the preempted request keeps what it generated"

    # Once room comes back it is recomputed.
    sched.remove("oldest")
    sched.remove("middle")
    chunks = fake_step(sched)
    assert_recomputed(chunks, newest, caching)
    assert len(newest.output_ids) == len(generated) + 1, "the recompute samples the next token"
    assert newest.output_ids[: len(generated)] == generated


@CACHING
def test_paused_sequences_are_parked_before_running_ones_are_preempted(caching):
    sched = make_sched(num_blocks=7, block_size=4, budget=64, caching=caching)
    runner, parked = fake_seq("runner", 8), fake_seq("parked", 8)
    sched.add(runner)
    sched.add(parked)
    fake_step(sched)
    assert sched.pause("parked")
    assert parked.block_table, "a paused request keeps its blocks while there is room"
    for _ in range(30):
        fake_step(sched)
        assert_blocks_conserved(sched)
        assert runner.status is Status.RUNNING, "a running request was preempted first"
        if not parked.block_table:
            break
    else:
        pytest.fail("the pool never ran out")
    assert parked.status is Status.PAUSED and sched.paused["parked"] is parked
    assert parked.num_computed == 0

    # Resumed without blocks, it goes to the head of the queue to be recomputed.
    assert sched.resume("parked")
    assert parked.status is Status.WAITING and sched.waiting.peek() is parked
    sched.remove("runner")
    assert_recomputed(fake_step(sched), parked, caching)


# ── pause, resume, remove ─────────────────────────────────────────────────────────────────────
def test_pause_takes_a_sequence_out_of_running_but_keeps_its_blocks():
    sched = make_sched()
    seq = fake_seq("s", 6)
    sched.add(seq)
    fake_step(sched)
    blocks, free = list(seq.block_table), sched.pool.num_free
    assert sched.pause("s")
    assert seq not in sched.running and sched.paused["s"] is seq
    assert seq.status is Status.PAUSED
    assert seq.block_table == blocks and sched.pool.num_free == free
    assert not sched.has_work()
    assert sched.schedule() == []
    assert not sched.pause("s"), "pausing twice is a no-op"


def test_pause_of_a_waiting_sequence_holds_it_back():
    sched = make_sched()
    seq = fake_seq("s", 6)
    sched.add(seq)
    assert sched.pause("s")
    assert not sched.waiting and sched.schedule() == []
    assert sched.resume("s")
    assert fed_ranges(fake_step(sched), "s") == [(0, 6)]


def test_resume_returns_a_paused_sequence_where_it_left_off():
    sched = make_sched()
    seq = fake_seq("s", 6)
    sched.add(seq)
    fake_step(sched)
    fake_step(sched)
    computed = seq.num_computed
    sched.pause("s")
    fake_step(sched)
    assert sched.resume("s")
    assert seq.status is Status.RUNNING and seq in sched.running
    assert fed_ranges(fake_step(sched), "s") == [(computed, 1)]
    assert not sched.resume("s"), "resuming a running request is a no-op"


@pytest.mark.parametrize("where", ["waiting", "prefilling", "decoding", "paused"])
def test_remove_gives_blocks_back_immediately(where):
    sched = make_sched(num_blocks=16, block_size=4, budget=8)
    initial = sched.pool.num_free
    seq = fake_seq("s", 6 if where != "prefilling" else 20)
    sched.add(seq)
    if where != "waiting":
        fake_step(sched)
    if where == "decoding":
        fake_step(sched)
    if where == "paused":
        sched.pause("s")
    assert sched.pool.num_free < initial or where == "waiting"

    assert sched.remove("s") is seq
    assert sched.pool.num_free == initial
    assert seq.block_table == [] and seq.status is Status.FINISHED
    assert not sched.by_uid and not sched.running and not sched.waiting and not sched.paused
    assert sched.remove("s") is None, "a second remove finds nothing"
    assert sched.remove("never-added") is None


def test_a_prompt_fits_the_pool_with_the_one_token_after_it():
    pool = BlockPool(num_blocks=5, block_size=4)  # 4 usable blocks, 16 tokens
    check_fits(15, pool.capacity, "prompt")
    with pytest.raises(KVCacheTooSmall, match=r"the prompt needs 16 tokens .* holds 16"):
        check_fits(16, pool.capacity, "prompt")


# ── everything at once ────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_keeps_block_accounting_exact_and_finishes_every_request(seed):
    """Adds, pauses, resumes, aborts and steps in random order under a tight pool.

    Each request's prompt plus max_tokens fits the pool on its own, so every one must finish.
    """
    rng = random.Random(seed)
    sched = make_sched(num_blocks=13, block_size=4, max_seqs=4, budget=12)  # 48 tokens
    live: dict[str, object] = {}

    def finish_done() -> None:
        forget_finished(sched, live)

    for i in range(300):
        op = rng.random()
        if op < 0.15 and len(live) < 10:
            prompt = rng.randint(1, 30)
            seq = fake_seq(f"r{i}", prompt, max_tokens=rng.randint(1, 46 - prompt))
            sched.add(seq)
            live[seq.uid] = seq
        elif op < 0.22 and live:
            sched.pause(rng.choice(list(live)))
        elif op < 0.32 and sched.paused:
            sched.resume(rng.choice(list(sched.paused)))
        elif op < 0.36 and live:
            uid = rng.choice(list(live))
            free_before = sched.pool.num_free
            held = len(live[uid].block_table)
            assert sched.remove(uid) is live.pop(uid)
            assert sched.pool.num_free == free_before + held
        else:
            fake_step(sched)
            finish_done()
        assert_blocks_conserved(sched)
        assert_states_consistent(sched)

    for uid in list(sched.paused):
        sched.resume(uid)
    for _ in range(500):
        if not live:
            break
        fake_step(sched)
        finish_done()
        assert_blocks_conserved(sched)
        assert_states_consistent(sched)
    assert not live, f"requests never finished: {sorted(live)}"
    assert sched.pool.num_free == sched.pool.num_blocks - 1


def test_token_slice_reads_across_prompt_and_output():
    seq = fake_seq("a", prompt_len=4)
    seq.output_ids = [90, 91, 92]
    everything = seq.prompt_ids + seq.output_ids
    for start in range(len(everything)):
        for end in range(start, len(everything) + 1):
            assert seq.token_slice(start, end) == everything[start:end]
