"""Greedy decoding on the tiny model: the engine's own forward matches transformers exactly,
whatever the batch, the prefill chunking, preemption or pauses do to the schedule."""

from __future__ import annotations

import pytest
from scheduler_testkit import PROMPTS, Drained, assert_idle, collect, drain, greedy

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompt_ids(encode) -> dict[str, list[int]]:
    return {f"p{i}": encode(text) for i, text in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def reference(prompt_ids, hf_greedy) -> dict[str, list[int]]:
    return {uid: hf_greedy(ids, MAX_TOKENS) for uid, ids in prompt_ids.items()}


@pytest.fixture(scope="module")
def ignore_eos_reference(make_engine, prompt_ids) -> dict[str, list[int]]:
    """The engine's greedy tokens with a roomy pool, one request at a time, EOS ignored."""
    tokens = {}
    for uid, ids in prompt_ids.items():
        engine = make_engine()
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True))
        tokens[uid] = drain(engine).tokens[uid]
    return tokens


def test_reference_prompts_cover_eos_and_full_length(reference, eos_ids):
    """Guards the next tests: some prompts stop at EOS, some run to max_tokens."""
    ends = {ref[-1] in eos_ids for ref in reference.values()}
    assert ends == {True, False}


DECODE_PATHS = pytest.mark.parametrize("dense_decode", [True, False], ids=["dense", "gather"])


@DECODE_PATHS
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7, 3], ids=["whole", "chunk7", "chunk3"])
def test_greedy_batch_matches_transformers_generate_token_for_token(
    make_engine, prompt_ids, reference, eos_ids, max_num_batched_tokens, dense_decode
):
    engine = make_engine(max_num_batched_tokens=max_num_batched_tokens, dense_decode=dense_decode)
    if max_num_batched_tokens < 2048:
        assert max(map(len, prompt_ids.values())) > max_num_batched_tokens  # prefill is chunked
    for uid, ids in prompt_ids.items():
        engine.add(uid, ids, greedy(MAX_TOKENS))
    run = drain(engine)
    assert run.tokens == reference
    for uid, tokens in run.tokens.items():
        expected = "stop" if tokens[-1] in eos_ids else "length"
        assert run.reasons[uid] == expected, uid
    assert_idle(engine)


@DECODE_PATHS
def test_preemption_under_a_tiny_kv_budget_keeps_greedy_tokens(
    make_engine, prompt_ids, ignore_eos_reference, dense_decode
):
    # 5 usable blocks of 16 tokens: each request fits alone (at most 38 tokens, 3 blocks),
    # all six together need about 16 blocks.
    engine = make_engine(kv_blocks=6, dense_decode=dense_decode)
    for uid, ids in prompt_ids.items():
        assert len(ids) + MAX_TOKENS <= 5 * 16
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True))
    run = drain(engine)
    assert engine.policy.num_preemptions > 0, "the budget was meant to force preemption"
    assert run.tokens == ignore_eos_reference
    assert set(run.reasons.values()) == {"length"}
    assert_idle(engine)


def test_preemption_with_chunked_prefill_keeps_greedy_tokens(
    make_engine, prompt_ids, ignore_eos_reference
):
    engine = make_engine(kv_blocks=5, max_num_batched_tokens=5)
    for uid, ids in prompt_ids.items():
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True))
    run = drain(engine)
    assert engine.policy.num_preemptions > 0
    assert run.tokens == ignore_eos_reference
    assert_idle(engine)


@DECODE_PATHS
def test_pause_and_resume_under_kv_pressure_keep_greedy_tokens(
    make_engine, prompt_ids, ignore_eos_reference, dense_decode
):
    """A paused request is parked when others need its blocks, and recomputed on resume."""
    engine = make_engine(kv_blocks=6, dense_decode=dense_decode)
    for uid, ids in prompt_ids.items():
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True))
    paused = engine.policy.by_uid["p0"]
    run = collect(engine.step(), Drained())
    collect(engine.step(), run)
    assert engine.pause("p0")
    held_while_paused = len(run.tokens["p0"])
    parked = False
    for _ in range(200):
        if not engine.policy.has_work():
            break
        collect(engine.step(), run)
        assert len(run.tokens["p0"]) == held_while_paused, "a paused request kept decoding"
        parked = parked or not paused.block_table
    assert parked, "the pool was meant to park the paused request"
    assert engine.resume("p0")
    drain(engine, into=run)
    assert run.tokens == ignore_eos_reference
    assert_idle(engine)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
def test_never_written_kv_slots_cannot_poison_batched_decode(
    make_engine, prompt_ids, ignore_eos_reference, monkeypatch, garbage
):
    """Fresh memory may hold any bit pattern: the pool must not depend on it."""
    import torch

    from tokenline.scheduler import runner as runner_module
    from tokenline.scheduler.attention import decode_contexts

    class PoisonedTorch:  # torch, except that torch.empty hands back garbage
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            return torch.empty(*args, **kwargs).fill_(garbage)

    with monkeypatch.context() as patch:
        patch.setattr(runner_module, "torch", PoisonedTorch())
        engine = make_engine()
    # The dense decode rows are allocated (and grown) while the engine runs.
    monkeypatch.setattr(decode_contexts, "torch", PoisonedTorch())
    for uid, ids in prompt_ids.items():
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True))
    assert drain(engine).tokens == ignore_eos_reference
    assert engine.runner.decode_contexts is not None
