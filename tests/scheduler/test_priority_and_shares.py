"""Priority and fair share: who is admitted, who is preempted, and what each tenant gets.

The policy runs with fake sequences and a real BlockPool (no model: milliseconds); the engine
test checks that a request preempted for a more urgent one resumes exactly.
"""

from __future__ import annotations

import itertools
from collections import Counter
from types import SimpleNamespace

import pytest
from scheduler_testkit import (
    PROMPTS,
    Drained,
    assert_blocks_conserved,
    assert_idle,
    assert_states_consistent,
    collect,
    drain,
    fake_seq,
    fake_step,
    greedy,
)

from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.policy import BatchPolicy
from tokenline.scheduler.sequence import Sequence, Status
from tokenline.scheduler.waiting import FairShare, Scheduling, parse_weights

_clock = itertools.count()


def seq_of(uid: str, prompt_len: int = 4, max_tokens: int = 8, priority=0, tenant="") -> Sequence:
    seq = fake_seq(uid, prompt_len, max_tokens)
    seq.priority, seq.tenant, seq.arrival = priority, tenant, float(next(_clock))
    return seq


def policy(scheduling: Scheduling, max_seqs: int = 8, blocks: int = 256, budget: int = 64):
    return BatchPolicy(BlockPool(blocks, 4), max_seqs, budget, scheduling=scheduling)


def admitted_order(sched: BatchPolicy, steps: int = 200) -> list[str]:
    order: list[str] = []
    for _ in range(steps):
        for chunk in fake_step(sched):
            if chunk.start == 0 and chunk.seq.uid not in order:
                order.append(chunk.seq.uid)
        assert_blocks_conserved(sched)
        assert_states_consistent(sched)
        if not sched.has_work():
            break
    return order


# ── priority ───────────────────────────────────────────────────────────────────────────────────
def test_fcfs_admits_in_arrival_order_whatever_the_priority() -> None:
    sched = policy(Scheduling("fcfs"), max_seqs=1)
    for uid, priority in (("a", 5), ("b", 0), ("c", 3)):
        sched.add(seq_of(uid, priority=priority))
    assert admitted_order(sched) == ["a", "b", "c"]


def test_priority_admits_the_lowest_first_arrival_order_within() -> None:
    sched = policy(Scheduling("priority"), max_seqs=1)
    for uid, priority in (("a", 5), ("b", 0), ("c", 3), ("d", 0), ("e", -2)):
        sched.add(seq_of(uid, priority=priority))
    assert admitted_order(sched) == ["e", "b", "d", "c", "a"]


def test_an_urgent_request_preempts_the_lowest_priority_newest_running_one() -> None:
    sched = policy(Scheduling("priority"), max_seqs=3)
    low = [seq_of(f"low{i}", max_tokens=50, priority=p) for i, p in enumerate((1, 5, 5))]
    for seq in low:
        sched.add(seq)
    fake_step(sched)
    assert all(s.status is Status.RUNNING for s in low)
    urgent = seq_of("urgent", priority=0)
    sched.add(urgent)
    chunks = fake_step(sched)  # the urgent one runs in the very next step
    assert urgent in [c.seq for c in chunks]
    assert low[2].status is Status.WAITING  # priority 5, the newer of the two
    assert low[0].status is low[1].status is Status.RUNNING
    assert sched.preempted == Counter({("", 5): 1})
    # it keeps its priority and its place: back before a newer request of its level
    newer = seq_of("newer", priority=5)
    sched.add(newer)
    assert sched.waiting.peek() is low[2]
    assert_blocks_conserved(sched)


def test_no_preemption_for_an_equal_or_lower_priority() -> None:
    sched = policy(Scheduling("priority"), max_seqs=2)
    for uid in ("a", "b"):
        sched.add(seq_of(uid, max_tokens=50, priority=1))
    fake_step(sched)
    for uid, priority in (("same", 1), ("lower", 4)):
        sched.add(seq_of(uid, priority=priority))
        fake_step(sched)
        assert sched.by_uid[uid].status is Status.WAITING
    assert sched.num_preemptions == 0


def test_when_blocks_run_out_the_lowest_priority_gives_way() -> None:
    """An urgent sequence that needs a block takes it from a lower-priority one; a low one
    that needs one gives way itself rather than take it from a more urgent one."""
    # 16 usable blocks of 4: room for one of the two whole, not both
    sched = policy(Scheduling("priority"), blocks=17, budget=64)
    urgent = seq_of("urgent", prompt_len=7, max_tokens=40, priority=0)
    low = seq_of("low", prompt_len=7, max_tokens=40, priority=9)
    sched.add(urgent)
    sched.add(low)
    for _ in range(40):
        fake_step(sched)
        assert_blocks_conserved(sched)
        assert urgent.status is not Status.WAITING, "the urgent one was preempted"
        if urgent.status is Status.FINISHED:
            break
    assert urgent.status is Status.FINISHED and len(urgent.output_ids) == 40
    assert sched.preempted[("", 9)] >= 1


# ── fair share ─────────────────────────────────────────────────────────────────────────────────
def test_weights_parse_and_refuse() -> None:
    assert parse_weights("a=1,b=3, *=0.5") == {"a": 1.0, "b": 3.0, "*": 0.5}
    assert parse_weights("") == {}
    for bad in ("a", "a=0", "a=-1", "=3", "a=x"):
        with pytest.raises(ValueError, match="TENANT=WEIGHT"):
            parse_weights(bad)
    shares = FairShare({"b": 3, "*": 2})
    assert (shares.weight("b"), shares.weight("anyone")) == (3, 2)


def flood(sched: BatchPolicy, tenants: dict[str, int], steps: int) -> Counter:
    """Keep ``tenants[t]`` requests of each tenant waiting for ``steps`` steps; the tokens each
    tenant got."""
    tokens: Counter[str] = Counter()
    n = itertools.count()
    for _ in range(steps):
        for tenant, depth in tenants.items():
            waiting = sum(1 for s in sched.waiting if s.tenant == tenant)
            for _ in range(depth - waiting):
                sched.add(seq_of(f"{tenant}{next(n)}", prompt_len=4, max_tokens=12, tenant=tenant))
        for chunk in fake_step(sched):
            tokens[chunk.seq.tenant] += chunk.num_tokens
        assert_blocks_conserved(sched)
        assert_states_consistent(sched)
    return tokens


def test_two_tenants_share_by_weight_under_saturation() -> None:
    sched = policy(Scheduling(tenant_weights={"a": 1, "b": 3}), max_seqs=8)
    tokens = flood(sched, {"a": 20, "b": 20}, steps=600)
    assert tokens["b"] / tokens["a"] == pytest.approx(3, rel=0.1)


def test_fcfs_without_weights_lets_the_flood_through() -> None:
    """The same load without --tenant-weights: whoever queued first runs first (the baseline
    fair share changes)."""
    sched = policy(Scheduling(), max_seqs=8)
    tokens = flood(sched, {"a": 60, "b": 4}, steps=300)
    assert tokens["a"] > 5 * tokens["b"]
    fair = policy(Scheduling(tenant_weights={}), max_seqs=8)
    tokens = flood(fair, {"a": 60, "b": 4}, steps=300)
    assert tokens["a"] == pytest.approx(tokens["b"], rel=0.1)


def test_an_idle_tenants_share_is_lent_and_it_comes_back_level() -> None:
    sched = policy(Scheduling(tenant_weights={"a": 1, "b": 1}), max_seqs=8)
    alone = flood(sched, {"a": 20}, steps=200)
    assert alone["a"] > 0 and not alone["b"]  # nobody else: all of it to a
    # b comes back after a long absence: it shares from now on, it is not owed a's past
    both = flood(sched, {"a": 20, "b": 20}, steps=300)
    assert both["b"] / both["a"] == pytest.approx(1, rel=0.15)
    assert both["a"] > 0.4 * (both["a"] + both["b"])


# ── the engine: a preempted request resumes exactly ───────────────────────────────────────────
def test_priority_preemption_keeps_greedy_output_exact(make_engine, encode) -> None:
    prompts = {f"p{i}": encode(text) for i, text in enumerate(PROMPTS)}
    reference = make_engine()
    for uid, ids in prompts.items():
        reference.add(uid, ids, greedy(20, ignore_eos=True))
    expected = drain(reference).tokens
    engine = make_engine(max_num_seqs=3, scheduling=Scheduling("priority"))
    out = Drained()
    for i, (uid, ids) in enumerate(prompts.items()):
        engine.add(uid, ids, greedy(20, ignore_eos=True), priority=len(prompts) - i)
        collect(engine.step(), out)  # later arrivals are more urgent: each preempts an earlier one
    drain(engine, into=out)
    assert engine.policy.num_preemptions > 0
    assert out.tokens == expected
    assert_idle(engine)


def test_tenants_clients_invent_do_not_grow_the_scheduler() -> None:
    """Tenants come from a header: a client sending a new one with every request must leave
    bounded state behind, while the most-served idle tenant keeps its debt."""
    from tokenline.scheduler.tenant_metrics import MAX_PRIORITIES, MAX_TENANTS, TenantMetrics
    from tokenline.scheduler.waiting import IDLE_TENANTS_KEPT

    shares = FairShare({})
    shares.enter("steady")
    shares.charge("steady", 10)
    shares.enter("heavy")
    shares.charge("heavy", 10**6)
    shares.leave("heavy")
    for n in range(5 * IDLE_TENANTS_KEPT):
        tenant = f"t{n}"
        shares.enter(tenant)
        shares.charge(tenant, 1 + n % 7)
        shares.leave(tenant)
        shares.charge("steady", 1)
    assert len(shares.usage) <= IDLE_TENANTS_KEPT + 2
    assert shares.owed("heavy") == 10 + 10**6  # its debt outlives the crowd
    shares.enter("heavy")
    assert shares.owed("heavy") > shares.owed("steady")

    metrics = TenantMetrics(SimpleNamespace(tenant_log=[]))
    for n in range(MAX_TENANTS + 500):
        assert metrics._labels(f"x{n}", n)[0] == (f"x{n}" if n < MAX_TENANTS else "other")
    assert len(metrics._tenants) == MAX_TENANTS
    assert len(metrics._priorities) == MAX_PRIORITIES
