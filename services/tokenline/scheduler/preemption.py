"""Who gives up its KV blocks when a sequence needs room the pool no longer has.

A paused sequence still holding blocks goes first: they serve no step until it resumes. Then a
running one: the newest (vLLM's recompute preemption), or with priorities and fair share the
lowest priority, then the tenant most over its share, then the newest (waiting.py's
``preemption_order``); none when every other outranks the one in need, which then goes itself.

It lives alone because the choice is one rule that reads the sequences and nothing else: the
policy (policy.py) does the preempting, and a test can ask who would go without a pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from tokenline.scheduler.sequence import Sequence
from tokenline.scheduler.waiting import FairShare, preemption_order


def victim_for(
    needing: Sequence,
    paused: Iterable[Sequence],
    running: list[Sequence],
    by_priority: bool,
    shares: FairShare | None,
) -> Sequence | None:
    """The sequence to preempt for ``needing`` (``running`` in the order they joined it); None:
    ``needing`` itself should go."""
    for seq in paused:
        if seq.block_table:
            return seq
    if not by_priority and shares is None:
        newest = running[-1] if running else None
        return newest if newest is not None and newest is not needing else None
    others = [s for s in running if s is not needing]
    if not others:
        return None
    order = partial(preemption_order, by_priority=by_priority, shares=shares)
    victim = max(others, key=order)
    return None if order(victim) < order(needing) else victim  # None: all outrank it
