"""The sampler's draws follow the distribution it was given, and never pick a cut token.

Thousands of rows of the same logits go through ``sample_with_logprobs`` at once; each row is
an independent draw, so token frequencies must match the probabilities within a few standard
errors. The global RNG is seeded, so a pass or a failure here repeats exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenline.protocol import SamplingParams
from tokenline.scheduler.sampler import plain_sampling, sample_with_logprobs
from tokenline.scheduler.sequence import Sequence

DRAWS = 20_000
LOGITS = [-math.inf, 2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5]  # token 0 can never be drawn


def draw(logits: list[float], count: int = DRAWS, **params) -> torch.Tensor:
    sampling = SamplingParams(max_tokens=8, **params)
    plain = plain_sampling(sampling)  # as the engine sets it
    seqs = [
        Sequence(uid=f"r{i}", prompt_ids=[1], sampling=sampling, max_tokens=8, plain_sampling=plain)
        for i in range(count)
    ]
    if sampling.seed is not None:
        for seq in seqs:
            seq.generator = torch.Generator().manual_seed(sampling.seed)
    batch = torch.tensor([logits] * count)
    tokens, _ = sample_with_logprobs(batch, seqs, eos_ids=[])
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).double()


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    total = counts.sum()
    expected = probs * total
    sigma = torch.sqrt(total * probs * (1 - probs)).clamp(min=1.0)
    z = ((counts - expected) / sigma).abs()
    assert bool((z < 4.5).all()), f"counts {counts.tolist()} expected {expected.tolist()}"


@pytest.fixture(autouse=True)
def _seeded_rng():
    state = torch.random.get_rng_state()
    torch.manual_seed(20261201)
    yield
    torch.random.set_rng_state(state)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_follow_softmax_of_logits_over_temperature(temperature):
    counts = draw(LOGITS, temperature=temperature)
    assert counts[0] == 0
    assert_matches(counts, torch.softmax(torch.tensor(LOGITS) / temperature, -1).double())


def test_top_k_draws_only_the_k_likeliest_in_their_renormalised_proportions():
    counts = draw(LOGITS, top_k=3)
    kept = torch.tensor([-math.inf, 2.0, 1.0, -math.inf, -math.inf, -math.inf, -math.inf, 1.5])
    assert counts[[0, 3, 4, 5, 6]].sum() == 0
    assert_matches(counts, torch.softmax(kept, -1).double())


def test_min_p_cuts_the_unlikely_tail():
    counts = draw(LOGITS, min_p=0.3)  # keeps tokens 1, 2 and 7
    probs = torch.softmax(torch.tensor(LOGITS), -1)
    kept = probs >= 0.3 * probs.max()
    assert counts[~kept].sum() == 0
    assert_matches(counts, (probs * kept / (probs * kept).sum()).double())


def test_a_banned_token_is_never_drawn_even_when_it_is_the_likeliest():
    logits = [0.0, 8.0, 0.0, 0.0]
    counts = draw(logits, min_tokens=4, stop_token_ids=[1])
    assert counts[1] == 0
    assert_matches(counts, torch.tensor([1 / 3, 0.0, 1 / 3, 1 / 3], dtype=torch.float64))


def test_the_last_token_is_drawn_at_its_rate_and_a_zero_last_token_never():
    assert_matches(draw([0.0, 0.0, 0.0, 0.0]), torch.full((4,), 0.25, dtype=torch.float64))
    counts = draw([0.0, 0.0, 0.0, -math.inf])
    assert counts[3] == 0
    assert_matches(counts, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0], dtype=torch.float64))


def test_rows_with_the_same_seed_draw_the_same_token():
    counts = draw(LOGITS, count=64, seed=7)
    assert int((counts > 0).sum()) == 1


def test_a_uniform_number_at_the_very_top_draws_the_last_token_of_nonzero_probability(
    monkeypatch,
):
    """``u * total`` that reaches ``total`` (u at its largest, or a rounding up) passes no
    running sum: the draw stays on the last token that can be drawn, never past the vocabulary
    or onto a cut token."""
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.ones(*shape))
    counts = draw([0.0, 1.0, 0.5, -math.inf, -math.inf], count=8)
    assert counts.tolist() == [0, 0, 8, 0, 0]


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-6])
def test_a_temperature_too_small_for_float32_is_greedy(temperature):
    """Logits over 1e-300 (0 in float32) are infinite or NaN: such a row takes its limit."""
    counts = draw(LOGITS, count=64, temperature=temperature)
    assert counts.tolist() == [0, 64, 0, 0, 0, 0, 0, 0]


def test_a_row_with_every_token_banned_still_gets_an_id_inside_the_vocabulary():
    counts = draw([0.0, 5.0, 1.0], count=16, min_tokens=4, stop_token_ids=[0, 1, 2])
    assert counts.sum() == 16  # bincount would have grown past 3 for an id out of range
    assert len(counts) == 3


@pytest.mark.parametrize(
    "field",
    [
        {"temperature": 0.7},
        {"temperature": 0.0},
        {"top_p": 0.9},
        {"top_k": 5},
        {"min_p": 0.1},
        {"seed": 3},
        {"min_tokens": 2},
        {"repetition_penalty": 1.1},
        {"frequency_penalty": 0.5},
        {"presence_penalty": -0.5},
        {"logit_bias": {3: 5.0}},
    ],
)
def test_any_sampling_field_off_its_default_takes_the_full_path(field):
    assert plain_sampling(SamplingParams(max_tokens=8))
    assert not plain_sampling(SamplingParams(max_tokens=8, **field))


def test_the_shortcut_for_default_rows_draws_what_the_full_path_draws():
    sampling = SamplingParams(max_tokens=8)
    logits = torch.randn(64, 50)

    def tokens(plain: bool) -> list[int]:
        seqs = [
            Sequence(f"r{i}", [1], sampling, 8, plain_sampling=plain) for i in range(len(logits))
        ]
        torch.manual_seed(7)
        return sample_with_logprobs(logits.clone(), seqs, eos_ids=[])[0]

    assert tokens(True) == tokens(False)
    assert len(set(tokens(True))) > 10  # a draw, not one token repeated
