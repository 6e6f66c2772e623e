"""One writer of sequence state: between the policy's schedule and its update_from_output,
a step (the runner's forward, prompt scoring, sampling) changes no sequence; the policy applies
the step's results in one call."""

from __future__ import annotations

import dataclasses

from scheduler_testkit import greedy

from tokenline.protocol import SamplingParams


def state(seq) -> tuple:
    fields = dataclasses.asdict(seq) | {"matcher": None, "generator": None, "sampling": None}
    return tuple(sorted((k, repr(v)) for k, v in fields.items()))


def test_a_step_changes_sequences_only_through_update_from_output(make_engine, encode):
    engine = make_engine(max_num_batched_tokens=8)
    policy = engine.policy
    engine.add("plain", encode("hello world again and again"), greedy(6, ignore_eos=True))
    engine.add(
        "scored", encode("the quick brown fox"), SamplingParams(max_tokens=3, prompt_logprobs=2)
    )
    engine.add("read-only", encode("a b c d e"), SamplingParams(max_tokens=0, prompt_logprobs=1))
    seqs = dict(policy.by_uid)
    after_schedule: dict[str, tuple] = {}
    calls = []
    schedule, update = policy.schedule, policy.update_from_output

    def scheduling():
        chunks = schedule()
        after_schedule.clear()
        after_schedule.update({uid: state(seq) for uid, seq in seqs.items()})
        return chunks

    def updating(output):
        for uid, seq in seqs.items():
            assert state(seq) == after_schedule[uid], f"{uid} changed outside the policy"
        calls.append(len(output.chunks))
        return update(output)

    policy.schedule, policy.update_from_output = scheduling, updating
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert len(calls) == steps  # one update per step that ran
    assert all(seq.num_computed == 0 and not seq.block_table for seq in seqs.values())
    assert len(seqs["plain"].output_ids) == 6 and len(seqs["scored"].output_ids) == 3
