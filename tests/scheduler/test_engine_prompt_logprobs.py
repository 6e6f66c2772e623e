"""Prompt logprobs (echo with logprobs) from the engine: each prompt token's log-probability
under transformers' own logits for the tokens before it, with the top alternatives, complete
whatever chunked prefill, the prefix cache or preemption did, and without changing the output."""

from __future__ import annotations

import pytest
import torch
from scheduler_testkit import assert_idle, greedy

from tokenline.protocol import TokenLogprobs
from tokenline.scheduler import prompt_logprobs
from tokenline.scheduler.engine import InvalidRequest

TOL = 1e-4
LONG = (
    "The quick brown fox jumps over the lazy dog near the river in the morning light, "
    "and the old stone road runs far into the blue mountains beyond the town."
)


@pytest.fixture(scope="module")
def hf_model(tiny_source):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_source.path, dtype=torch.float32)
    return model.eval()


def _reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over the whole prompt in one pass: row i scores
    prompt token i + 1."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check(entries: list[TokenLogprobs | None], prompt: list[int], ref: torch.Tensor, n: int):
    assert len(entries) == len(prompt), "one entry per prompt token"
    assert entries[0] is None, "the first prompt token has nothing to be scored against"
    for i in range(1, len(prompt)):
        entry, row = entries[i], ref[i - 1]
        assert entry.token_id == prompt[i], f"entry {i} names the wrong token"
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=TOL), i
        assert len(entry.top_ids) == len(entry.top_logprobs) == n
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
        for top_id, value in zip(entry.top_ids, entry.top_logprobs, strict=True):
            assert value == pytest.approx(row[top_id].item(), abs=TOL)
        if n:  # they are the top n: nothing outside them beats the last one
            assert entry.top_logprobs[-1] >= row.topk(n).values[-1].item() - TOL


def _run(engine, max_steps: int = 2_000):
    """Drain the engine: each uid's tokens, sampled logprobs and first output."""
    tokens, logprobs, first = {}, {}, {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step():
            if out.uid in first:
                assert out.prompt_logprobs is None, "prompt logprobs come once, first"
            first.setdefault(out.uid, out)
            tokens.setdefault(out.uid, []).extend(out.token_ids)
            logprobs.setdefault(out.uid, []).extend(e.logprob for e in out.logprobs or [])
    assert not engine.has_work()
    return tokens, logprobs, first


@pytest.mark.parametrize(
    "max_num_batched_tokens", [2048, 5, 24], ids=["whole", "chunked", "chunks-shared"]
)
def test_prompt_logprobs_equal_log_softmax_of_a_full_forward_pass(
    make_engine, encode, hf_model, max_num_batched_tokens
):
    """Alone in a step, in 5-token chunks, and sharing steps with other prompts' chunks and
    with decoding sequences (so the scored rows sit at offsets inside the step's batch)."""
    engine = make_engine(max_num_batched_tokens=max_num_batched_tokens)
    long, short = encode(LONG), encode("hello world, how are you")
    engine.add("plain", encode("request queue world"), greedy(8, ignore_eos=True))
    engine.add("long", long, greedy(4, ignore_eos=True, prompt_logprobs=3))
    engine.add("short", short, greedy(4, ignore_eos=True, prompt_logprobs=0, logprobs=1))
    engine.add("one", long[:1], greedy(2, ignore_eos=True, prompt_logprobs=2))
    _, _, first = _run(engine)
    assert_idle(engine)
    assert first["plain"].prompt_logprobs is None
    _check(first["long"].prompt_logprobs, long, _reference(hf_model, long), 3)
    _check(first["short"].prompt_logprobs, short, _reference(hf_model, short), 0)
    assert first["one"].prompt_logprobs == [None]


def test_prompt_logprobs_are_complete_despite_a_prefix_cache_hit(make_engine, encode, hf_model):
    """The prompt is cached by an earlier request: a request that wants its logprobs computes
    every position anyway (cached_tokens 0), and the cache still serves the others."""
    prompt = encode(LONG)
    assert len(prompt) > 2 * 16, "the prompt must fill blocks for the cache to hit"
    engine = make_engine(max_num_batched_tokens=24)
    engine.add("warm", prompt, greedy(3, ignore_eos=True))
    warm = _run(engine)[0]["warm"]
    engine.add("scored", prompt, greedy(3, ignore_eos=True, prompt_logprobs=2))
    engine.add("cached", prompt, greedy(3, ignore_eos=True))
    tokens, _, first = _run(engine)
    _check(first["scored"].prompt_logprobs, prompt, _reference(hf_model, prompt), 2)
    assert first["scored"].cached_tokens == 0
    assert first["cached"].cached_tokens > 0, "a request without prompt logprobs still hits"
    assert tokens["scored"] == tokens["cached"] == warm
    assert_idle(engine)


def test_asking_for_prompt_logprobs_leaves_the_output_unchanged(make_engine, encode):
    prompts = {"a": encode(LONG), "b": encode("你好 世界 🙂"), "c": encode("hello please")}
    runs = {}
    for asked in (None, 4):
        engine = make_engine(max_num_batched_tokens=7)
        for uid, ids in prompts.items():
            engine.add(uid, ids, greedy(10, logprobs=2, prompt_logprobs=asked))
        runs[asked] = _run(engine)[:2]
        assert_idle(engine)
    (tokens, logprobs), (want_tokens, want_logprobs) = runs[4], runs[None]
    assert tokens == want_tokens
    for uid, values in want_logprobs.items():
        assert logprobs[uid] == pytest.approx(values, abs=1e-5), uid


def test_preempted_prefills_keep_their_prompt_logprobs(make_engine, encode, hf_model):
    """A pool too small for every request preempts some, perhaps mid-prefill; each is then
    recomputed, and its prompt logprobs are still whole and right, each position once."""
    base = encode(LONG)
    prompts = {f"p{i}": [*base[: 30 + 4 * i], 50 + i] for i in range(4)}
    engine = make_engine(kv_blocks=9, max_num_batched_tokens=24)
    for uid, ids in prompts.items():
        engine.add(uid, ids, greedy(24, ignore_eos=True, prompt_logprobs=1))
    _, _, first = _run(engine)
    assert engine.policy.num_preemptions > 0, "the pool was meant to force preemption"
    for uid, ids in prompts.items():
        _check(first[uid].prompt_logprobs, ids, _reference(hf_model, ids), 1)
    assert_idle(engine)


def test_max_tokens_zero_reads_the_prompt_and_generates_nothing(make_engine, encode, hf_model):
    prompt = encode(LONG)
    engine = make_engine(max_num_batched_tokens=16)
    engine.add("read", prompt, greedy(0, prompt_logprobs=1))
    engine.add("write", prompt[:9], greedy(3, ignore_eos=True))
    tokens, _, first = _run(engine)
    assert tokens["read"] == [] and first["read"].finish_reason == "length"
    _check(first["read"].prompt_logprobs, prompt, _reference(hf_model, prompt), 1)
    assert len(tokens["write"]) == 3, "a read-only neighbour does not disturb the batch"
    assert_idle(engine)


def test_prompt_logprobs_beyond_the_bounds_are_refused(make_engine, encode, monkeypatch):
    engine = make_engine()
    prompt = encode(LONG)
    with pytest.raises(InvalidRequest) as too_many:
        engine.add("many", prompt, greedy(2, prompt_logprobs=prompt_logprobs.MAX_TOP + 1))
    assert too_many.value.param == "logprobs"
    monkeypatch.setattr(prompt_logprobs, "MAX_VALUES", len(prompt) * 3 - 1)
    with pytest.raises(InvalidRequest, match="shorter prompt") as too_long:
        engine.add("long", prompt, greedy(2, prompt_logprobs=2))
    assert too_long.value.param == "logprobs"
    engine.add("fits", prompt, greedy(2, prompt_logprobs=1))  # len(prompt) * 2 values fit
    assert not engine.policy.by_uid.keys() - {"fits"}, "refused requests are not held"
    _run(engine)
    assert_idle(engine)


def test_scored_rows_become_logits_a_slice_at_a_time(make_engine, encode, hf_model, monkeypatch):
    """Memory is bounded by slicing: 3 rows of logits at a time give the same entries."""
    monkeypatch.setattr(prompt_logprobs, "SLICE_ELEMENTS", 3 * make_engine().runner.vocab_size)
    seen = []
    real = prompt_logprobs.reduce_logprobs

    def spy(raw, token_ids, top_n):
        seen.append(raw.shape[0])
        return real(raw, token_ids, top_n)

    monkeypatch.setattr(prompt_logprobs, "reduce_logprobs", spy)
    prompt = encode(LONG)
    engine = make_engine()
    engine.add("s", prompt, greedy(1, prompt_logprobs=2))
    _, _, first = _run(engine)
    assert max(seen) == 3 and sum(seen) == len(prompt) - 1
    _check(first["s"].prompt_logprobs, prompt, _reference(hf_model, prompt), 2)
