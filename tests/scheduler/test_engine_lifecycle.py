"""How requests end: stop ids, EOS, min_tokens, length, abort, and what an idle engine holds."""

from __future__ import annotations

import pytest
from scheduler_testkit import Drained, assert_idle, collect, drain, greedy

from tokenline.protocol import SamplingParams
from tokenline.scheduler.refusals import InvalidRequest, KVCacheTooSmall

N = 24
EOS_PROMPTS = ["<|assistant|>", "hello please", "request queue world"]


@pytest.fixture(scope="module")
def eos_case(make_engine, encode, eos_ids) -> tuple[list[int], list[int], int]:
    """A prompt whose greedy output hits a model EOS id: (prompt ids, tokens, EOS index)."""
    for text in EOS_PROMPTS:
        ids = encode(text)
        engine = make_engine()
        engine.add("x", ids, greedy(N, ignore_eos=True))
        tokens = drain(engine).tokens["x"]
        hits = [i for i, t in enumerate(tokens) if t in eos_ids]
        if hits and hits[0] >= 2 and hits[0] + 4 < N:
            return ids, tokens, hits[0]
    pytest.fail(f"none of {EOS_PROMPTS} makes the tiny model emit EOS early; pick others")


def run_one(make_engine, ids, sampling, **engine_kw) -> tuple[list[int], str]:
    engine = make_engine(**engine_kw)
    engine.add("x", ids, sampling)
    run = drain(engine)
    assert run.terminals == {"x": 1}
    assert_idle(engine)
    return run.tokens["x"], run.reasons["x"]


# ── stop ids and EOS ──────────────────────────────────────────────────────────────────────────
def test_stop_token_id_ends_the_request_with_stop(make_engine, eos_case):
    ids, tokens, _ = eos_case
    stop_at = next(i for i in range(1, N) if tokens[i] not in tokens[:i])
    out, reason = run_one(
        make_engine, ids, greedy(N, ignore_eos=True, stop_token_ids=[tokens[stop_at]])
    )
    assert (out, reason) == (tokens[: stop_at + 1], "stop")


def test_eos_ids_come_from_the_generation_config(tiny_source, eos_ids):
    from transformers import GenerationConfig

    declared = GenerationConfig.from_pretrained(tiny_source.path).eos_token_id
    assert isinstance(declared, list) and len(declared) == 2  # <|end|> and <|endoftext|>
    assert set(declared) <= set(eos_ids)


def test_model_eos_ends_a_request_with_stop(make_engine, eos_case):
    ids, tokens, at = eos_case
    assert run_one(make_engine, ids, greedy(N)) == (tokens[: at + 1], "stop")


def test_every_eos_id_ends_a_request(make_engine, eos_case, eos_ids):
    ids, tokens, _ = eos_case
    extra = tokens[1]  # stands for a second EOS id the model declares
    out, reason = run_one(make_engine, ids, greedy(N), eos=[*eos_ids, extra])
    assert (out, reason) == (tokens[:2], "stop")


def test_ignore_eos_runs_past_eos_to_max_tokens(make_engine, eos_case, eos_ids):
    ids, tokens, at = eos_case
    out, reason = run_one(make_engine, ids, greedy(N, ignore_eos=True))
    assert (out, reason) == (tokens, "length")
    assert out[at] in eos_ids


def test_min_tokens_suppresses_eos(make_engine, eos_case, eos_ids):
    ids, tokens, at = eos_case
    floor = at + 3
    out, _ = run_one(make_engine, ids, greedy(N, min_tokens=floor))
    assert len(out) >= floor
    assert not set(out[:floor]) & set(eos_ids)
    assert out[:at] == tokens[:at]


def test_min_tokens_suppresses_stop_token_ids(make_engine, eos_case):
    ids, tokens, _ = eos_case
    out, _ = run_one(
        make_engine, ids, greedy(N, ignore_eos=True, stop_token_ids=[tokens[0]], min_tokens=1)
    )
    assert out[0] != tokens[0]


def test_out_of_vocabulary_stop_token_id_cannot_break_the_batch(make_engine, encode):
    engine = make_engine()
    engine.add("neighbour", encode("hello please"), greedy(4, ignore_eos=True))
    try:
        engine.add("x", encode("a"), greedy(4, stop_token_ids=[10**6], min_tokens=2))
    except ValueError:
        pass  # refusing the request up front is a fine answer too
    run = drain(engine)
    assert run.reasons["neighbour"] == "length"


def test_a_prompt_id_past_the_models_embedding_is_refused_not_run(make_engine, encode):
    """A tokenizer may hold more ids than the model has embedding rows: such an id is a 400
    naming the prompt, and the batch beside it runs (on a GPU it would fail the device)."""
    engine = make_engine()
    engine.add("neighbour", encode("hello please"), greedy(4, ignore_eos=True))
    vocab = engine.runner.vocab_size
    for bad in ([*encode("a"), vocab], [-1]):
        with pytest.raises(InvalidRequest) as refused:
            engine.add("x", bad, greedy(4))
        assert refused.value.param == "prompt" and str(vocab) in str(refused.value)
    engine.add("edge", [vocab - 1], greedy(2, ignore_eos=True))
    run = drain(engine)
    assert run.reasons == {"neighbour": "length", "edge": "length"}


# ── length ────────────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_ends_with_length(make_engine, encode, max_tokens):
    out, reason = run_one(make_engine, encode("a"), greedy(max_tokens, ignore_eos=True))
    assert (len(out), reason) == (max_tokens, "length")


@pytest.mark.parametrize("max_tokens", [None, N], ids=["unset", "past-the-context"])
def test_max_model_len_ends_with_length(make_engine, encode, max_tokens):
    """The tokenizer stage fills max_tokens in and holds it to the context; a caller in
    process skips it, and the sequence still ends where the context does."""
    ids = encode("hello please")
    sampling = greedy(N, ignore_eos=True)
    sampling.max_tokens = max_tokens
    out, reason = run_one(make_engine, ids, sampling, max_model_len=len(ids) + 5)
    assert (len(out), reason) == (5, "length")


# ── abort and idleness ────────────────────────────────────────────────────────────────────────
def test_abort_returns_kv_blocks_at_once_and_ends_each_uid_once(make_engine, encode):
    engine = make_engine(max_num_seqs=3, max_num_batched_tokens=8)
    prompts = {  # admitted in this order; "waiting" finds max_num_seqs taken
        "paused": encode("a"),
        "decoding": encode("hello please"),
        "prefilling": list(range(5, 25)),
        "waiting": encode("request queue world"),
    }
    for uid, ids in prompts.items():
        engine.add(uid, ids, greedy(N, ignore_eos=True))
    run = Drained()
    for _ in range(2):
        collect(engine.step(), run)
    engine.pause("paused")
    sched = engine.policy
    assert [s.uid for s in sched.running] == ["decoding", "prefilling"]
    assert [s.uid for s in sched.waiting] == ["waiting"]
    assert sched.paused["paused"].block_table, "paused with its blocks"
    assert 0 < sched.by_uid["prefilling"].num_computed < len(prompts["prefilling"])
    assert engine.pool.usage > 0

    for uid in prompts:
        assert engine.abort(uid) is not None
    assert engine.pool.usage == 0.0, "aborted requests must hand their blocks back at once"
    assert engine.pool.num_free == engine.pool.num_blocks - 1
    assert engine.abort("decoding") is None, "a second abort finds nothing"

    drain(engine, into=run)
    assert run.terminals == dict.fromkeys(prompts, 1)
    assert set(run.reasons.values()) == {"abort"}
    assert_idle(engine)


def test_abort_after_the_end_emits_nothing(make_engine, encode):
    engine = make_engine()
    engine.add("x", encode("a"), greedy(3, ignore_eos=True))
    run = drain(engine)
    assert engine.abort("x") is None
    assert engine.step() == []
    assert run.terminals == {"x": 1} and run.reasons == {"x": "length"}


def test_aborted_blocks_admit_the_next_request(make_engine, encode):
    engine = make_engine(kv_blocks=4)  # 3 usable blocks, 48 tokens
    engine.add("hog", encode("a"), greedy(40, ignore_eos=True))
    engine.step()
    engine.add("next", list(range(5, 40)), greedy(4, ignore_eos=True))  # needs all 3 blocks
    engine.step()
    assert not engine.policy.by_uid["next"].block_table
    engine.abort("hog")
    run = drain(engine)
    assert run.reasons == {"hog": "abort", "next": "length"}
    assert_idle(engine)


def test_idle_engine_holds_no_kv_blocks(make_engine, encode, eos_case):
    engine = make_engine(kv_blocks=6, max_num_batched_tokens=6)
    ids, tokens, _ = eos_case
    engine.add("eos", ids, greedy(N))
    engine.add("stop-id", encode("hello please"), greedy(N, stop_token_ids=[tokens[3]]))
    engine.add("length", encode("The quick brown fox jumps over the lazy dog."), greedy(N))
    engine.add("sampled", encode("a"), SamplingParams(max_tokens=N, temperature=1.0, seed=1))
    engine.add("aborted", encode("request queue world"), greedy(N, ignore_eos=True))
    engine.step()
    engine.abort("aborted")
    run = drain(engine)
    assert len(run.terminals) == 5 and set(run.terminals.values()) == {1}
    assert_idle(engine)


def test_an_empty_prompt_is_a_callers_bug_not_a_step_failure(make_engine):
    """The tokenizer stage refuses empty prompts with the request's error; the engine only
    keeps one that skipped it out of a step (where it would fail its neighbours too)."""
    engine = make_engine()
    with pytest.raises(ValueError, match="empty prompt") as refused:
        engine.add("e", [], greedy(4))
    assert not isinstance(refused.value, InvalidRequest)
    assert_idle(engine)


# ── a prompt the pool can never hold ──────────────────────────────────────────────────────────
def test_prompt_bigger_than_the_pool_raises_kv_cache_too_small(make_engine):
    engine = make_engine(kv_blocks=3)  # 2 usable blocks, 32 tokens
    with pytest.raises(KVCacheTooSmall, match="kv-cache-memory"):
        engine.add("huge", list(range(5, 45)), greedy(4))
    with pytest.raises(KVCacheTooSmall):
        engine.add("exact", list(range(5, 37)), greedy(4))  # 32 + the first sampled token
    assert_idle(engine)
    engine.add("fits", list(range(5, 36)), greedy(1, ignore_eos=True))
    run = drain(engine)
    assert run.reasons == {"fits": "length"}
    assert_idle(engine)


def test_request_outgrowing_the_whole_pool_ends_instead_of_stalling_the_queue(make_engine, encode):
    engine = make_engine(kv_blocks=5)  # 4 usable blocks, 64 tokens
    engine.add("greedy-giant", list(range(5, 15)), greedy(100, ignore_eos=True))
    engine.add("behind", encode("a"), greedy(4, ignore_eos=True))
    run = drain(engine, max_steps=150)
    assert run.terminals == {"greedy-giant": 1, "behind": 1}
    assert run.reasons["behind"] == "length"
    assert_idle(engine)
