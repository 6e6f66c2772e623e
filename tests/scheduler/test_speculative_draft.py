"""Draft-model speculation (vLLM's ``draft_model``): a second model guesses, the target checks.
The output is the target's own whatever the draft is: the target as its own draft (every guess
right: the machinery's whole path, and the ceiling), and a draft with other weights (many
guesses wrong, rolled back in the draft's KV)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from scheduler_testkit import PROMPTS, assert_idle, drain, greedy

MAX_TOKENS = 24


def draft_config(model: str, tokens: int = 4) -> str:
    return json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": tokens})


@pytest.fixture(scope="module")
def other_draft(tiny_source, tmp_path_factory) -> str:
    """The tiny model with its weights disturbed: same vocabulary, other guesses."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("draft") / "model"
    shutil.copytree(tiny_source.path, out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std() * 0.5)
    model.save_pretrained(out)
    return str(out)


def run_all(engine, encode) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add(f"r{i}", encode(prompt), greedy(MAX_TOKENS))
    return drain(engine).tokens


@pytest.fixture(scope="module")
def expected(make_engine, encode) -> dict[str, list[int]]:
    return run_all(make_engine(), encode)


def test_the_target_as_its_own_draft_is_right_and_exact(
    make_engine, tiny_source, encode, expected
) -> None:
    engine = make_engine(speculative=draft_config(tiny_source.path))
    assert run_all(engine, encode) == expected
    taken = engine.acceptance
    assert taken.drafts > 0
    assert taken.accepted_tokens >= 0.9 * taken.draft_tokens  # the same model guesses right
    assert_idle(engine)
    # once idle, the engine has had every draft copy given back, without being asked
    assert not engine.policy.proposer.drafts
    assert engine.policy.proposer.pool.num_referenced == 0


def test_another_draft_leaves_the_output_the_targets(
    make_engine, other_draft, encode, expected
) -> None:
    engine = make_engine(speculative=draft_config(other_draft, tokens=3))
    assert run_all(engine, encode) == expected
    taken = engine.acceptance
    assert taken.drafts > 0 and taken.accepted_tokens < taken.draft_tokens  # wrong guesses too
    assert_idle(engine)


def test_a_draft_of_another_vocabulary_is_refused(make_engine, tmp_path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=77, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="vocabulary of 77 tokens"):
        make_engine(speculative=draft_config(str(tmp_path)))


def test_a_long_prompt_reaches_the_draft_in_bounded_chunks(
    make_engine, tiny_source, encode, monkeypatch
) -> None:
    """The draft catches up on a long context a bounded chunk per step, guessing nothing
    meanwhile, so no step carries a whole prompt's forward in the draft."""
    from tokenline.scheduler.speculative.draft import CATCH_UP_TOKENS

    prompt = encode("the keeper of the light " * 60)
    assert len(prompt) > 2 * CATCH_UP_TOKENS
    alone = make_engine()
    alone.add("a", prompt, greedy(MAX_TOKENS))
    # the draft's pool is a quarter of the target's: room for the whole context
    engine = make_engine(speculative=draft_config(tiny_source.path), kv_cache_memory=32 * 2**20)
    fed: list[int] = []
    forward = engine.policy.proposer.runner.forward
    monkeypatch.setattr(
        engine.policy.proposer.runner,
        "forward",
        lambda chunks: fed.extend(c.num_tokens for c in chunks) or forward(chunks),
    )
    engine.add("s", prompt, greedy(MAX_TOKENS))
    assert drain(engine).tokens["s"] == drain(alone).tokens["a"]
    assert max(fed) <= CATCH_UP_TOKENS and sum(fed) >= len(prompt)
    assert engine.acceptance.accepted_tokens > 0
