"""The workload shapes: distinct prompts as before, shared prefixes, conversations, rewording."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tokenline.loadgen.cli import build_parser, config_from_args
from tokenline.loadgen.config import BenchConfig, TargetConfig
from tokenline.loadgen.request import build_body
from tokenline.loadgen.workload import (
    WORDS,
    LengthDist,
    build_workload,
    conversations,
    reword,
    shared_prefixes,
)


def old_workload(
    num_requests: int, prompt_len: LengthDist, output_len: LengthDist, seed: int
) -> list[tuple[str, int, int]]:
    """The workload as `tokenline bench` drew it before shared prefixes and conversations."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        words = prompt_len.sample(rng)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append((prompt, words, output_len.sample(rng)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 17])
def test_the_default_workload_is_the_one_drawn_before(seed: int) -> None:
    shapes = ((LengthDist(32, 32), LengthDist(64, 64)), (LengthDist(5, 50), LengthDist(1, 64)))
    for prompt_len, output_len in shapes:
        specs = build_workload(48, prompt_len, output_len, seed)
        assert [(s.prompt, s.prompt_words, s.max_tokens) for s in specs] == old_workload(
            48, prompt_len, output_len, seed
        )
        assert all((s.conversation, s.turn, s.prefix_words) == (s.index, 0, 0) for s in specs)


def test_shared_prefixes_start_every_prompt_and_groups_get_equal_shares() -> None:
    specs = build_workload(
        12, LengthDist(4, 9), LengthDist(8, 8), seed=3, shared_prefix_len=20, prefix_groups=3
    )
    prefixes = shared_prefixes(20, 3, seed=3)
    assert len(set(prefixes)) == 3 and all(len(p.split()) == 20 for p in prefixes)
    assert Counter(s.prefix_group for s in specs) == {0: 4, 1: 4, 2: 4}
    for spec in specs:
        assert spec.prompt.startswith(prefixes[spec.prefix_group] + " ")
        own = spec.prompt.split()[20:]
        assert 4 <= len(own) <= 9 and spec.prompt_words == 20 + len(own)
        assert spec.prefix_words == 20
    assert len({s.prompt for s in specs}) == 12  # the words after the prefix are their own


def test_a_prefix_leaves_the_rest_of_the_workload_as_it_was() -> None:
    plain = build_workload(8, LengthDist(3, 7), LengthDist(1, 9), seed=5)
    prefixed = build_workload(8, LengthDist(3, 7), LengthDist(1, 9), seed=5, shared_prefix_len=6)
    for a, b in zip(plain, prefixed, strict=True):
        assert b.prompt.split()[6:] == a.prompt.split()
        assert b.max_tokens == a.max_tokens


def test_the_warm_up_shares_the_runs_prefixes_but_not_its_words() -> None:
    run = build_workload(4, LengthDist(5, 5), LengthDist(4, 4), seed=0, shared_prefix_len=10)
    warm = build_workload(
        1, LengthDist(5, 5), LengthDist(4, 4), seed=1, shared_prefix_len=10, prefix_seed=0
    )
    assert warm[0].prompt.split()[:10] == run[0].prompt.split()[:10]
    assert warm[0].prompt not in {s.prompt for s in run}


def test_conversations_number_their_turns_and_only_the_first_carries_the_prefix() -> None:
    specs = build_workload(
        12, LengthDist(6, 6), LengthDist(4, 4), seed=2, turns=3, shared_prefix_len=8
    )
    assert [(s.conversation, s.turn) for s in specs] == [(c, t) for c in range(4) for t in range(3)]
    prefix = shared_prefixes(8, 1, seed=2)[0]
    for spec in specs:
        if spec.turn == 0:
            assert spec.prompt.startswith(prefix + " ") and spec.prompt_words == 14
        else:
            assert spec.prefix_words == 0 and len(spec.prompt.split()) == spec.prompt_words == 6
    grouped = conversations(list(reversed(specs)))
    assert [[s.index for s in c] for c in grouped] == [[9, 10, 11], [6, 7, 8], [3, 4, 5], [0, 1, 2]]


def test_reworded_rounds_keep_lengths_and_prefixes_and_change_the_rest() -> None:
    specs = build_workload(
        10, LengthDist(3, 12), LengthDist(1, 30), seed=4, shared_prefix_len=7, prefix_groups=2
    )
    again = reword(specs, "4:1")
    assert again == reword(specs, "4:1")  # the same for every target of the round
    assert again != reword(specs, "4:2")
    for old, new in zip(specs, again, strict=True):
        assert new.prompt != old.prompt
        assert new.prompt.split()[:7] == old.prompt.split()[:7]
        assert len(new.prompt.split()) == new.prompt_words == old.prompt_words
        assert (new.max_tokens, new.prefix_group, new.turn) == (
            old.max_tokens,
            old.prefix_group,
            old.turn,
        )
    plain = build_workload(5, LengthDist(4, 4), LengthDist(2, 2), seed=0)
    assert all(len(s.prompt.split()) == 4 for s in reword(plain, "0:1"))


def test_a_turns_body_carries_the_conversation_so_far() -> None:
    config = BenchConfig(targets=[TargetConfig("a", "http://a")], endpoint="chat", turns=2)
    spec = build_workload(2, LengthDist(3, 3), LengthDist(5, 5), seed=0, turns=2)[1]
    history = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "ok"}]
    body = build_body(config, config.targets[0], "m", spec, history)
    assert body["messages"] == [*history, {"role": "user", "content": spec.prompt}]
    assert history == body["messages"][:2] and len(history) == 2  # not mutated


def _config(*args: str) -> BenchConfig:
    return config_from_args(build_parser().parse_args(list(args)))


def test_arguments_reach_the_config_and_defaults_are_unchanged() -> None:
    plain = _config()
    assert (plain.shared_prefix_len, plain.prefix_groups, plain.turns) == (0, 1, 1)
    assert plain.reword_rounds and plain.num_requests == 48 and plain.concurrency == 16
    assert (plain.prompt_len, plain.output_len) == (LengthDist(32, 32), LengthDist(64, 64))
    shaped = _config(
        "--shared-prefix-len",
        "300",
        "--prefix-groups",
        "4",
        "--turns",
        "4",
        "--endpoint",
        "chat",
        "--repeat-prompts",
    )
    assert (shaped.shared_prefix_len, shaped.prefix_groups, shaped.turns) == (300, 4, 4)
    assert not shaped.reword_rounds
    described = shaped.describe()
    assert (described["shared_prefix_len"], described["turns"]) == (300, 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--turns", "2"], "needs the chat endpoint"),
        (["--turns", "5", "--endpoint", "chat"], "whole conversations"),
        (["--prefix-groups", "2"], "need a shared prefix"),
    ],
)
def test_contradictory_shapes_are_refused(args: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(*args)
