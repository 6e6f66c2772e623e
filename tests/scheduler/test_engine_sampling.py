"""Sampling on the tiny model: seeds, greedy equivalents and penalties."""

from __future__ import annotations

import random

import pytest
from scheduler_testkit import assert_idle, drain, greedy

from tokenline.protocol import SamplingParams

PROMPT = "hello please"
REPEATING_PROMPTS = ["a", "<|assistant|>"]  # greedy output repeats tokens within 16
N = 16


def run_one(make_engine, prompt_ids, sampling, **engine_kw) -> list[int]:
    engine = make_engine(**engine_kw)
    engine.add("x", prompt_ids, sampling)
    return drain(engine).tokens["x"]


def sampled(seed: int | None = None, temperature: float = 1.0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=temperature, seed=seed, ignore_eos=True, **kw)


def random_requests(rng: random.Random, count: int) -> list[tuple[str, list[int], SamplingParams]]:
    out = []
    for i in range(count):
        prompt = [rng.randrange(5, 600) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 2 * N),
            temperature=rng.choice([0.0, 0.7, 1.0, 1.5]),
            top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([0, 20]),
            seed=rng.choice([None, rng.randrange(1000)]),
            ignore_eos=rng.random() < 0.5,
        )
        out.append((f"other{i}", prompt, params))
    return out


@pytest.fixture(scope="module")
def prompt_ids(encode) -> list[int]:
    return encode(PROMPT)


@pytest.fixture(scope="module")
def greedy_tokens(make_engine, prompt_ids) -> list[int]:
    return run_one(make_engine, prompt_ids, greedy(N, ignore_eos=True))


# ── seeds ─────────────────────────────────────────────────────────────────────────────────────
def test_seeded_sampling_repeats_across_runs(make_engine, prompt_ids, greedy_tokens):
    first = run_one(make_engine, prompt_ids, sampled(seed=1234))
    second = run_one(make_engine, prompt_ids, sampled(seed=1234))
    assert first == second
    assert first != greedy_tokens, "temperature 1.0 should not collapse to greedy here"


@pytest.mark.parametrize("rng_seed", [0, 1])
def test_seeded_sampling_ignores_what_else_is_in_the_batch(make_engine, prompt_ids, rng_seed):
    alone = run_one(make_engine, prompt_ids, sampled(seed=77, top_p=0.95))
    engine = make_engine(max_num_batched_tokens=24)  # the others' prompts arrive in chunks
    others = random_requests(random.Random(rng_seed), 5)
    for uid, ids, params in others[:2]:
        engine.add(uid, ids, params)
    engine.add("x", prompt_ids, sampled(seed=77, top_p=0.95))
    for uid, ids, params in others[2:]:
        engine.add(uid, ids, params)
    run = drain(engine)
    assert run.tokens["x"] == alone
    assert set(run.terminals.values()) == {1} and len(run.terminals) == 6
    assert_idle(engine)


def test_different_seeds_give_different_tokens(make_engine, prompt_ids):
    outputs = {tuple(run_one(make_engine, prompt_ids, sampled(seed=s))) for s in (1, 2, 3)}
    assert len(outputs) == 3


# ── greedy by another name ────────────────────────────────────────────────────────────────────
def test_temperature_zero_is_greedy_beside_sampled_requests(make_engine, prompt_ids, greedy_tokens):
    """A temperature-0 row keeps its argmax when the batch also samples (the mixed path)."""
    engine = make_engine()
    engine.add("sampled", prompt_ids, sampled())
    engine.add("x", prompt_ids, greedy(N, ignore_eos=True, seed=5))
    engine.add("sampled-seeded", prompt_ids, sampled(seed=9))
    assert drain(engine).tokens["x"] == greedy_tokens


@pytest.mark.parametrize(
    "narrowing",
    [
        {"top_k": 1},
        {"top_k": 1, "seed": 3},
        {"top_p": 1e-6},
        {"min_p": 1.0},
        {"temperature": 1e-300},  # 0 in float32: the limit, not a division by zero
    ],
    ids=["top_k=1", "top_k=1,seed", "top_p~0", "min_p=1", "temperature~0"],
)
def test_sampling_narrowed_to_one_token_is_greedy(
    make_engine, prompt_ids, greedy_tokens, narrowing
):
    assert run_one(make_engine, prompt_ids, sampled(**narrowing)) == greedy_tokens


# ── penalties ─────────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.0}, {"presence_penalty": 1.0}],
    ids=["repetition", "frequency", "presence"],
)
def test_penalties_change_greedy_output(make_engine, encode, penalty):
    for text in REPEATING_PROMPTS:
        ids = encode(text)
        plain = run_one(make_engine, ids, greedy(N, ignore_eos=True))
        assert len(set(plain)) < len(plain), f"{text!r} no longer repeats: pick another prompt"
        penalized = run_one(make_engine, ids, greedy(N, ignore_eos=True, **penalty))
        assert penalized != plain, f"{penalty} left {text!r} unchanged"


def test_strong_presence_penalty_yields_no_repeated_tokens(make_engine, encode):
    for text in REPEATING_PROMPTS:
        tokens = run_one(
            make_engine, encode(text), greedy(N, ignore_eos=True, presence_penalty=2.0)
        )
        assert len(tokens) == N
        assert len(set(tokens)) == N, f"{text!r} repeated a token: {tokens}"


def test_the_scheduler_seed_makes_unseeded_sampling_repeat(make_engine, prompt_ids) -> None:
    """vLLM's --seed: requests without a seed of their own sample the same tokens after the
    same seed, and others after another."""
    from tokenline.scheduler.start import seed_sampling

    def sampled(seed: int) -> dict[str, list[int]]:
        seed_sampling(seed)
        engine = make_engine()
        for uid in ("a", "b", "c"):
            engine.add(uid, prompt_ids, SamplingParams(max_tokens=12, ignore_eos=True))
        return drain(engine).tokens

    assert sampled(7) == sampled(7) != sampled(8)
