"""Logprobs from the engine are those of the model's raw distribution: transformers' own logits,
log-softmaxed, for the same prefix, whatever sampling did to the choice of token."""

from __future__ import annotations

import pytest
import torch
from scheduler_testkit import assert_idle, greedy

from tokenline.protocol import SamplingParams, TokenLogprobs

TOKENS = 6
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_source):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_source.path, dtype=torch.float32)
    return model.eval()


def _run(engine) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs | None]]]:
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs | None]] = {}
    for _ in range(500):
        if not engine.has_work():
            break
        for out in engine.step():
            tokens.setdefault(out.uid, []).extend(out.token_ids)
            entries = out.logprobs if out.logprobs is not None else [None] * len(out.token_ids)
            assert len(entries) == len(out.token_ids)
            logprobs.setdefault(out.uid, []).extend(entries)
    return tokens, logprobs


def _reference(hf_model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each generated position: [len(generated), V]."""
    ids = prompt + generated
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(ids) - 1]


def _check(entries: list[TokenLogprobs], generated: list[int], ref: torch.Tensor, n: int) -> None:
    assert len(entries) == len(generated)
    for k, (entry, token) in enumerate(zip(entries, generated, strict=True)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(ref[k, token].item(), abs=TOL)
        assert len(entry.top_ids) == len(entry.top_logprobs) == n
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
        for top_id, value in zip(entry.top_ids, entry.top_logprobs, strict=True):
            assert value == pytest.approx(ref[k, top_id].item(), abs=TOL)
        # they are the top n: nothing outside them beats the last one
        if n:
            assert entry.top_logprobs[-1] >= ref[k].topk(n).values[-1].item() - TOL


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 5], ids=["whole", "chunked"])
def test_engine_logprobs_equal_log_softmax_of_transformers_logits(
    make_engine, encode, hf_model, max_num_batched_tokens
):
    engine = make_engine(max_num_batched_tokens=max_num_batched_tokens)
    prompt = encode("The quick brown fox jumps over the lazy dog")
    other = encode("hello world")
    engine.add("greedy", prompt, greedy(TOKENS, ignore_eos=True, logprobs=5))
    engine.add("none", other, greedy(TOKENS, ignore_eos=True))
    # penalties and temperature change the draw, not the reported (raw) distribution
    engine.add(
        "sampled",
        prompt,
        SamplingParams(
            max_tokens=TOKENS,
            temperature=0.8,
            seed=3,
            repetition_penalty=1.5,
            ignore_eos=True,
            logprobs=3,
        ),
    )
    engine.add("chosen-only", other, greedy(TOKENS, ignore_eos=True, logprobs=0))
    tokens, logprobs = _run(engine)
    assert_idle(engine)

    assert logprobs["none"] == [None] * TOKENS
    _check(logprobs["greedy"], tokens["greedy"], _reference(hf_model, prompt, tokens["greedy"]), 5)
    # greedy: the chosen token is the most likely one
    assert [e.top_ids[0] for e in logprobs["greedy"]] == tokens["greedy"]
    sampled_ref = _reference(hf_model, prompt, tokens["sampled"])
    _check(logprobs["sampled"], tokens["sampled"], sampled_ref, 3)
    chosen_ref = _reference(hf_model, other, tokens["chosen-only"])
    _check(logprobs["chosen-only"], tokens["chosen-only"], chosen_ref, 0)
