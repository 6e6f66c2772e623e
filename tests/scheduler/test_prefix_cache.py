"""Prefix caching: a prompt prefix is computed once, shared by reference count, kept cached
after its requests end and evicted least recently used first, and never changes an output.

The pool and the policy are tested without a model (a fake KV that records which token each
slot holds); the engine is tested against itself with the cache off, on the tiny model and on
every model family's small random model.
"""

from __future__ import annotations

import random

import pytest
from scheduler_testkit import (
    FAMILIES,
    SLIDING,
    assert_blocks_conserved,
    assert_idle,
    assert_states_consistent,
    drain,
    fake_seq,
    family_runner,
    forget_finished,
    greedy,
    saved_family_model,
)

from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.kv_cache import BlockPool, block_hash
from tokenline.scheduler.policy import BatchPolicy, StepOutput
from tokenline.scheduler.sequence import Sequence, Status

BS = 4  # block size of the model-free tests


def computed(pool: BlockPool, seq: Sequence, num_tokens: int) -> None:
    """Give ``seq`` blocks for ``num_tokens`` more tokens and "compute" them."""
    pool.grow(seq, num_tokens)
    seq.num_computed += num_tokens
    pool.cache_full_blocks(seq)


def admitted(pool: BlockPool, seq: Sequence) -> list[int]:
    hits = pool.lookup(seq)
    seq.num_computed = pool.share(seq, hits)  # as the policy does
    return hits


# ── the pool alone ────────────────────────────────────────────────────────────────────────────
def test_a_block_name_chains_its_parent_and_its_tokens():
    root = block_hash(b"", [1, 2, 3, 4])
    assert root == block_hash(b"", [1, 2, 3, 4])
    assert root != block_hash(b"", [1, 2, 3, 5])
    # The same tokens after another prefix are another block: their K/V differ.
    assert block_hash(root, [5, 6, 7, 8]) != block_hash(block_hash(b"", [9, 9, 9, 9]), [5, 6, 7, 8])


def test_full_computed_blocks_are_shared_and_reference_counted():
    pool = BlockPool(16, BS)
    a = fake_seq("a", 10, prompt_ids=list(range(10)))
    computed(pool, a, 10)  # blocks 0-3, 4-7 full; 8-9 partial
    assert pool.num_cached == 2
    b = fake_seq("b", 9, prompt_ids=[*list(range(8)), 99])
    hits = admitted(pool, b)
    assert hits == a.block_table[:2]
    assert b.num_computed == 8
    assert [pool.refs(block) for block in a.block_table] == [2, 2, 1]
    assert pool.num_referenced == 3

    pool.release(a)
    assert [pool.refs(block) for block in hits] == [1, 1]
    assert pool.num_referenced == 2
    pool.release(b)
    assert pool.num_referenced == 0 and pool.usage == 0.0
    assert pool.num_free == pool.num_blocks - 1, "cached, unreferenced blocks count as free"
    assert pool.num_cached == 2, "an ended request's full blocks stay cached"
    c = fake_seq("c", 12, prompt_ids=list(range(12)))
    assert admitted(pool, c) == hits


def test_a_different_token_ends_the_shared_prefix():
    pool = BlockPool(16, BS)
    a = fake_seq("a", 12, prompt_ids=list(range(12)))
    computed(pool, a, 12)
    b = fake_seq("b", 13, prompt_ids=[0, 1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 11, 12])
    assert pool.lookup(b) == a.block_table[:1]


@pytest.mark.parametrize("prompt_len", [8, 9, 12])
def test_the_last_known_token_is_always_computed(prompt_len):
    """A whole prompt in the cache still leaves its last block to compute: its last token's
    logits are what the next token is sampled from, and no write lands in a shared block."""
    pool = BlockPool(16, BS)
    first = fake_seq("a", 12, prompt_ids=list(range(12)))
    computed(pool, first, 12)
    again = fake_seq("b", prompt_len, prompt_ids=list(range(prompt_len)))
    admitted(pool, again)
    assert again.num_computed == (prompt_len - 1) // BS * BS
    assert again.num_computed < prompt_len


def test_partial_and_duplicate_blocks_are_not_named():
    pool = BlockPool(16, BS)
    a, b = (fake_seq(uid, 6, prompt_ids=list(range(6))) for uid in "ab")
    computed(pool, a, 6)
    computed(pool, b, 6)  # missed together: b's first block duplicates a's
    assert pool.num_cached == 1
    pool.release(b)
    pool.release(a)
    assert len(pool._evictable) == 1, "only the named block stays cached"


def test_eviction_takes_unnamed_blocks_first_then_the_least_recently_released():
    pool = BlockPool(7, BS)  # 6 usable blocks
    old = fake_seq("old", 9, prompt_ids=[1] * 9)
    new = fake_seq("new", 9, prompt_ids=[2] * 9)
    computed(pool, old, 8)
    computed(pool, new, 8)
    pool.release(old)
    pool.release(new)
    assert pool.num_cached == 4 and pool.num_free == 6
    filler = fake_seq("filler", 12)
    pool.grow(filler, 8)  # the two never-named blocks: nothing evicted
    assert pool.num_cached == 4
    pool.grow(filler, 12)  # one more: the oldest chain's tail goes first
    assert pool.num_cached == 3
    assert len(pool.lookup(fake_seq("o", 9, prompt_ids=[1] * 9))) == 1
    assert len(pool.lookup(fake_seq("n", 9, prompt_ids=[2] * 9))) == 2


def test_reusing_a_cached_block_refreshes_it():
    pool = BlockPool(4, BS)  # 3 usable blocks
    seqs = {}
    for token in (1, 2, 3):
        seqs[token] = fake_seq(f"s{token}", 5, prompt_ids=[token] * 5)
        computed(pool, seqs[token], 4)
        pool.release(seqs[token])
    reader = fake_seq("r", 5, prompt_ids=[1] * 5)
    admitted(pool, reader)  # block of [1]*4, the least recently released, is used again
    pool.release(reader)
    pool.grow(fake_seq("filler", 4), 4)
    assert pool.lookup(fake_seq("one", 5, prompt_ids=[1] * 5)), "a fresh use kept it"
    assert not pool.lookup(fake_seq("two", 5, prompt_ids=[2] * 5)), "the oldest went"


def test_caching_off_names_nothing():
    pool = BlockPool(16, BS, caching=False)
    a = fake_seq("a", 10, prompt_ids=list(range(10)))
    computed(pool, a, 10)
    pool.release(a)
    assert pool.num_cached == 0
    assert pool.lookup(fake_seq("b", 10, prompt_ids=list(range(10)))) == []
    assert len(pool._free) == 15 and not pool._evictable


# ── the policy ────────────────────────────────────────────────────────────────────────────────
def step(sched: BatchPolicy, kv: dict[int, tuple[int, int]] | None = None) -> list:
    """A fake engine step: schedule, "compute", sample a token that depends on the whole
    context (so sequences that share a prefix diverge after it).

    With ``kv`` (pool slot -> the (token, position) computed into it) it also checks what
    attention would read: no chunk writes into a block someone else holds, and every position
    a chunk attends to holds its own sequence's token, computed or found in the cache."""
    chunks = sched.schedule()
    bs = sched.pool.block_size
    for c in chunks:
        assert c.start == c.seq.num_computed and c.num_tokens >= 1
        assert len(c.seq.block_table) * bs >= c.start + c.num_tokens
    if kv is not None:
        for c in chunks:
            for pos in range(c.start, c.start + c.num_tokens):
                block = c.seq.block_table[pos // bs]
                assert sched.pool.refs(block) == 1, "a write into a shared block"
                kv[block * bs + pos % bs] = (c.seq.token_slice(pos, pos + 1)[0], pos)
        for c in chunks:
            for pos in range(c.start + c.num_tokens):
                slot = c.seq.block_table[pos // bs] * bs + pos % bs
                assert kv.get(slot) == (c.seq.token_slice(pos, pos + 1)[0], pos), c.seq.uid
    sampled = [
        (c.seq, [sum(c.seq.token_slice(0, c.seq.num_tokens)) % 5]) for c in chunks if c.samples
    ]
    sched.update_from_output(StepOutput(chunks, sampled))
    return chunks


def test_admission_counts_only_the_blocks_a_request_must_newly_get():
    sched = BatchPolicy(BlockPool(7, BS), max_num_seqs=8, max_num_batched_tokens=64)  # 6 usable
    holder = fake_seq("holder", 16, prompt_ids=list(range(16)))
    sched.add(holder)
    step(sched)  # 16 prompt tokens: 4 full blocks, named
    assert sched.pool.num_free == 2
    sharer = fake_seq("sharer", 14, prompt_ids=[*list(range(13)), 77])
    assert sched.pool.blocks_for(sharer.num_tokens + 1) > sched.pool.num_free
    sched.add(sharer)
    chunks = step(sched)  # the holder's decode token takes a block, one is left
    assert sharer.status is Status.RUNNING, "three cached blocks and one new one fit"
    assert [(c.start, c.num_tokens) for c in chunks if c.seq is sharer] == [(12, 2)]
    assert_blocks_conserved(sched)


def test_admission_counts_cached_unreferenced_blocks_as_free():
    sched = BatchPolicy(BlockPool(5, BS), max_num_seqs=8, max_num_batched_tokens=64)  # 4 usable
    ended = fake_seq("ended", 12)
    sched.add(ended)
    step(sched)
    sched.remove("ended")
    assert sched.pool.num_free == 4 and sched.pool.num_cached == 3
    distinct = fake_seq("distinct", 15)  # 16 tokens with the sampled one: every block
    sched.add(distinct)
    step(sched)
    assert distinct.status is Status.RUNNING, "admitted by evicting the cached blocks"
    assert sched.pool.lookup(fake_seq("probe", 0, prompt_ids=[*ended.prompt_ids, 0])) == []
    assert_blocks_conserved(sched)


def test_a_prompt_whose_blocks_revive_must_still_fit_beside_them():
    sched = BatchPolicy(BlockPool(5, BS), max_num_seqs=8, max_num_batched_tokens=64)  # 4 usable
    first = fake_seq("first", 12, prompt_ids=list(range(12)))
    sched.add(first)
    step(sched)
    sched.remove("first")
    holder = fake_seq("holder", 3)
    sched.add(holder)
    step(sched)  # holds 1 block; 3 free, all of them the cached chain
    assert sched.pool.num_free == 3 and sched.pool.num_cached == 3
    big = fake_seq("big", 15, prompt_ids=list(range(15)))  # 16 with the sampled token
    sched.add(big)
    assert len(sched.pool.lookup(big)) == 3
    step(sched)
    # 3 cached blocks revived + 1 new = 4 blocks, but only 3 are unreferenced.
    assert big.status is Status.WAITING and not big.block_table
    assert_blocks_conserved(sched)
    sched.remove("holder")
    step(sched)
    assert big.status is Status.RUNNING and big.cached_tokens == 12
    assert_blocks_conserved(sched)


def test_counters_count_each_request_once_at_its_first_admission():
    sched = BatchPolicy(BlockPool(32, BS), max_num_seqs=8, max_num_batched_tokens=64)
    a = fake_seq("a", 10, prompt_ids=list(range(10)))
    sched.add(a)
    step(sched)
    b = fake_seq("b", 11, prompt_ids=list(range(11)))
    sched.add(b)
    step(sched)
    assert (a.cached_tokens, b.cached_tokens) == (0, 8)
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (21, 8)
    sched._preempt(b)
    chunks = step(sched)
    assert [(c.start, c.num_tokens) for c in chunks if c.seq is b] == [(8, 4)]
    assert b.cached_tokens == 8, "cached_tokens is the first admission's"
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (21, 8)


@pytest.mark.parametrize("seed", range(6))
def test_random_shared_prefix_traffic_reads_only_its_own_tokens(seed):
    """Adds, pauses, resumes, aborts and steps at random under a tight pool, with prompts
    drawn from a few shared prefixes: every chunk reads exactly its own tokens' K/V, block
    accounting stays exact, every request finishes and nothing stays referenced."""
    rng = random.Random(seed)
    sched = BatchPolicy(BlockPool(13, BS), max_num_seqs=4, max_num_batched_tokens=12)
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    kv: dict[int, tuple[int, int]] = {}
    live: dict[str, Sequence] = {}
    for i in range(300):
        op = rng.random()
        if op < 0.15 and len(live) < 10:
            prompt = rng.choice(prefixes)[: rng.randint(1, 20)]
            prompt = prompt + [rng.randrange(5) for _ in range(rng.randint(0, 8))]
            prompt = prompt[:28] or [1]
            seq = fake_seq(f"r{i}", 0, rng.randint(1, 46 - len(prompt)), prompt_ids=prompt)
            sched.add(seq)
            live[seq.uid] = seq
        elif op < 0.22 and live:
            sched.pause(rng.choice(list(live)))
        elif op < 0.32 and sched.paused:
            sched.resume(rng.choice(list(sched.paused)))
        elif op < 0.36 and live:
            assert sched.remove(rng.choice(list(live))) is not None
            live = {uid: s for uid, s in live.items() if uid in sched.by_uid}
        else:
            step(sched, kv)
            forget_finished(sched, live)
        assert_blocks_conserved(sched)
        assert_states_consistent(sched)
    for uid in list(sched.paused):
        sched.resume(uid)
    for _ in range(500):
        if not live:
            break
        step(sched, kv)
        forget_finished(sched, live)
        assert_blocks_conserved(sched)
    assert not live
    assert sched.pool.num_referenced == 0 and sched.pool.num_free == sched.pool.num_blocks - 1
    assert sched.prefix_cache_hits > 0, "the traffic was meant to share prefixes"


# ── the engine on the tiny model ──────────────────────────────────────────────────────────────
N = 12


@pytest.fixture(scope="module")
def prefix(encode) -> list[int]:
    text = "You are a helpful assistant. Answer briefly and cite the river in the morning light."
    ids = encode(text * 2)
    assert len(ids) >= 40
    return ids


def logprob_run(engine: Engine, prompts: dict[str, list[int]], sampling: SamplingParams):
    """Tokens, logprobs and first outputs of each uid, the prompts added all at once."""
    for uid, ids in prompts.items():
        engine.add(uid, ids, sampling)
    return run_all(engine)


def run_all(engine: Engine):
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    first: dict[str, object] = {}
    for _ in range(2_000):
        if not engine.has_work():
            break
        for out in engine.step():
            first.setdefault(out.uid, out)
            tokens.setdefault(out.uid, []).extend(out.token_ids)
            logprobs.setdefault(out.uid, []).extend(e.logprob for e in out.logprobs or [])
    assert not engine.has_work()
    return tokens, logprobs, first


def assert_same_outputs(got, want) -> None:
    tokens, logprobs, _ = got
    want_tokens, want_logprobs, _ = want
    assert tokens == want_tokens
    for uid, values in want_logprobs.items():
        assert logprobs[uid] == pytest.approx(values, abs=1e-4), uid


def test_shared_prefix_outputs_and_cached_tokens(make_engine, prefix):
    """A request after another with the same prefix computes only the rest, reports the
    cached tokens on its first output, and gets the tokens and logprobs of the uncached run."""
    sampling = greedy(N, ignore_eos=True, logprobs=2)
    prompts = {"a": [*prefix, 5, 6, 7], "b": [*prefix, 8, 9], "c": [*prefix, 5, 6, 7]}
    want = {}
    for uid, ids in prompts.items():  # alone, without the cache
        want[uid] = logprob_run(make_engine(prefix_caching=False), {uid: ids}, sampling)
    engine = make_engine()
    got = [logprob_run(engine, {uid: ids}, sampling) for uid, ids in prompts.items()]
    full = len(prefix) // 16 * 16
    whole = (len(prefix) + 2) // 16 * 16  # "c" repeats "a": all its full blocks but the last
    for uid, run in zip(prompts, got, strict=True):
        assert_same_outputs(run, want[uid])
        assert run[2][uid].cached_tokens == {"a": 0, "b": full, "c": whole}[uid]
    assert engine.prefix_cache_queries == sum(map(len, prompts.values()))
    assert engine.prefix_cache_hits == full + whole
    assert_idle(engine)
    assert engine.pool.num_cached > 0, "the prefix stays cached once idle"


@pytest.mark.parametrize("dense_decode", [True, False], ids=["dense", "gather"])
def test_requests_sharing_a_prefix_at_the_same_time(make_engine, prefix, dense_decode):
    """One request is decoding when others with its prefix arrive: they share its blocks
    (reference count above one) while all of them run, in chunked prefill too."""
    sampling = greedy(N, ignore_eos=True, logprobs=1)
    prompts = {f"s{i}": prefix + [10 + i] * (i + 1) for i in range(4)}
    want = logprob_run(
        make_engine(prefix_caching=False, dense_decode=dense_decode), prompts, sampling
    )
    engine = make_engine(dense_decode=dense_decode, max_num_batched_tokens=24)
    engine.add("s0", prompts["s0"], sampling)
    while not engine.policy.by_uid["s0"].output_ids:
        run = engine.step()
    seen = {out.uid: out for out in run}
    for uid in ("s1", "s2", "s3"):
        engine.add(uid, prompts[uid], sampling)
    shared = engine.policy.by_uid["s0"].block_table[0]
    tokens, logprobs, first = {"s0": list(seen["s0"].token_ids)}, {}, {"s0": seen["s0"]}
    logprobs["s0"] = [e.logprob for e in seen["s0"].logprobs]
    most_refs = 0
    while engine.has_work():
        for out in engine.step():
            first.setdefault(out.uid, out)
            tokens.setdefault(out.uid, []).extend(out.token_ids)
            logprobs.setdefault(out.uid, []).extend(e.logprob for e in out.logprobs)
        most_refs = max(most_refs, engine.pool.refs(shared))
    assert most_refs == 4, "all four requests held the prefix's first block at once"
    assert_same_outputs((tokens, logprobs, first), want)
    for uid in ("s1", "s2", "s3"):
        assert first[uid].cached_tokens == len(prefix) // 16 * 16
    assert_idle(engine)


def test_preempted_requests_resume_exactly_under_a_tiny_pool(make_engine, prefix):
    """Requests sharing a prefix in a pool too small for them all: preempted ones resume from
    what the cache kept (their own blocks, or others'), with the uncached run's outputs."""
    sampling = greedy(N, ignore_eos=True, logprobs=1)
    prompts = {f"q{i}": [*prefix[: 20 + 3 * i], 40 + i] for i in range(5)}
    blocks = 8  # 7 usable blocks of 16; each request alone needs at most 3
    want = logprob_run(make_engine(kv_blocks=blocks, prefix_caching=False), prompts, sampling)
    engine = make_engine(kv_blocks=blocks)
    got = logprob_run(engine, prompts, sampling)
    assert engine.policy.num_preemptions > 0, "the pool was meant to force preemption"
    assert engine.prefix_cache_hits > 0
    assert_same_outputs(got, want)
    assert_idle(engine)


def test_an_evicted_prefix_is_computed_again(make_engine, prefix):
    sampling = greedy(N, ignore_eos=True, logprobs=1)
    prompt = [*prefix, 3, 4]
    want = logprob_run(make_engine(prefix_caching=False), {"p": prompt}, sampling)
    engine = make_engine(kv_blocks=8)  # 7 usable blocks of 16 tokens
    assert_same_outputs(logprob_run(engine, {"p": prompt}, sampling), want)
    kept = logprob_run(engine, {"p": prompt}, sampling)
    assert kept[2]["p"].cached_tokens > 0
    assert_same_outputs(kept, want)
    # A distinct request that needs every block of the pool pushes the prefix out.
    logprob_run(engine, {"filler": [1] * 60}, greedy(7 * 16 - 60, ignore_eos=True))
    assert engine.pool.lookup(fake_seq("probe", 0, prompt_ids=prompt)) == []
    evicted = logprob_run(engine, {"p": prompt}, sampling)
    assert evicted[2]["p"].cached_tokens == 0
    assert_same_outputs(evicted, want)
    assert_idle(engine)


def test_prefix_caching_off_reports_nothing(make_engine, prefix):
    engine = make_engine(prefix_caching=False)
    assert not engine.prefix_caching
    for uid in "ab":
        _, _, first = logprob_run(engine, {uid: [*prefix, 1]}, greedy(2))
        assert first[uid].cached_tokens == 0
    assert (engine.prefix_cache_queries, engine.prefix_cache_hits) == (0, 0)
    assert engine.pool.num_cached == 0
    assert_idle(engine)


def test_an_aborted_request_leaves_its_computed_prefix_cached(make_engine, prefix):
    engine = make_engine(max_num_batched_tokens=16)
    engine.add("x", [*prefix, 1], greedy(N))
    engine.step()
    engine.step()  # two 16-token chunks computed
    engine.abort("x")
    drain(engine)
    assert_idle(engine)
    engine.add("y", [*prefix, 2], greedy(2))
    assert drain(engine).reasons == {"y": "length"}
    assert engine.prefix_cache_hits == 32
    assert_idle(engine)


# ── every family, sliding windows included ────────────────────────────────────────────────────
@pytest.mark.parametrize("family", list(FAMILIES) + list(SLIDING))
def test_cached_prefixes_change_no_output_in_any_family(family, tmp_path):
    spec = FAMILIES.get(family) or SLIDING[family]
    saved_family_model(spec, tmp_path)
    # Decode attention gathered from the pool (as on a GPU) for two of them, dense for the rest.
    dense = family not in ("llama", "mistral-window-8")
    runner = family_runner(family, tmp_path, dense_decode=dense)
    base = [(11 * j) % 290 + 5 for j in range(37)]  # 2 full blocks of 16 and a partial one
    prompts = {
        "a": [*base, 7],
        "b": [*base, 8, 9],  # shares a's full blocks
        "c": [*base[:20], 1, 2, 3],  # shares one
        "d": [*base, 7],  # a again: all but its last block
        "e": [*base[:32], 9],  # one token left to compute: it takes the decode path
        "f": base[:32],  # ends on a block boundary: its last block is computed again
        "g": [*base[:15], 1, *base[16:]],  # the first block's last token differs: no hit
    }
    cached = {"a": 0, "b": 32, "c": 16, "d": 32, "e": 32, "f": 16, "g": 0}
    sampling = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
    results = {}
    for caching in (False, True):
        engine = Engine(runner, EngineLimits(256, max_num_batched_tokens=24), [], caching)
        tokens, logprobs, first = {}, {}, {}
        for uid, ids in prompts.items():  # one after another: each finds the earlier ones
            run = logprob_run(engine, {uid: ids}, sampling)
            for part, into in zip(run, (tokens, logprobs, first), strict=True):
                into.update(part)
        assert_idle(engine)
        results[caching] = (tokens, logprobs, first)
    assert_same_outputs(results[True], results[False])
    assert {uid: out.cached_tokens for uid, out in results[True][2].items()} == cached
    block_zero = runner.kv_cache[:, : runner.block_size]
    assert not block_zero.any(), "block 0, the padding target, was handed out"
