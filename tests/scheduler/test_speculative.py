"""Speculative decoding: proposals verified in one forward give the output of one token per
step, whatever the proposals were, for greedy and sampled requests alike.

The tiny model's random weights rarely repeat themselves, so the engine tests install
proposers of known quality next to the n-gram one: an oracle that proposes the greedy
continuation (every guess right: the machinery's whole path), one that is always wrong (every
guess rejected), and a fixed guess for the sampled distribution.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter

import pytest
import torch
from scheduler_testkit import PROMPTS, Drained, assert_idle, collect, drain, greedy

from tokenline.protocol import SamplingParams
from tokenline.scheduler.sequence import Sequence
from tokenline.scheduler.speculative.config import SpeculativeConfig, parse
from tokenline.scheduler.speculative.ngram import NgramProposer
from tokenline.scheduler.speculative.verify import Acceptance, accepted_tokens
from tokenline.settings.scheduler import SpeculativeConfigText

MAX_TOKENS = 24
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


# ── the config ─────────────────────────────────────────────────────────────────────────────────
def test_config_takes_vllms_keys_and_defaults() -> None:
    assert parse(None) is None and parse("  ") is None
    assert parse(NGRAM) == SpeculativeConfig("ngram", 4, 3, 3)  # min follows max, as in vLLM
    assert parse('{"method": "ngram", "num_speculative_tokens": 2}') == SpeculativeConfig(
        "ngram", 2, 5, 5
    )
    both = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
    assert parse(both + '"prompt_lookup_max": 4}') == SpeculativeConfig("ngram", 3, 1, 4)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "model": "x", "num_speculative_tokens": 3}', "EAGLE heads"),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', 'needs "model"'),
        ('{"method": "lookahead", "num_speculative_tokens": 3}', "unknown"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "1 to 16"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "integer"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "model": "x"}', "['model']"),
        (
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, '
            '"prompt_lookup_max": 2}',
            "min <= max",
        ),
    ],
)
def test_config_refuses_what_it_cannot_serve(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        parse(text)
    assert says in str(caught.value)
    with pytest.raises(argparse.ArgumentTypeError):  # the flag fails at start, saying so
        SpeculativeConfigText(text)


# ── proposals and acceptance, without a model ──────────────────────────────────────────────────
def seq_of(tokens: list[int], prompt_len: int | None = None) -> Sequence:
    prompt_len = len(tokens) if prompt_len is None else prompt_len
    seq = Sequence(
        uid="s", prompt_ids=tokens[:prompt_len], sampling=SamplingParams(), max_tokens=99
    )
    seq.output_ids = tokens[prompt_len:]
    return seq


def test_ngram_proposes_what_followed_the_last_occurrence() -> None:
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose(seq_of([1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3]), 3) == [7, 1, 2]
    # the longest n that occurred wins over a later, shorter match
    assert proposer.propose(seq_of([5, 6, 7, 8, 0, 6, 4, 6, 5, 6]), 2) == [7, 8]
    assert proposer.propose(seq_of([1, 2, 3, 4]), 3) == []  # nothing repeats
    assert proposer.propose(seq_of([1, 2, 1, 2]), 0) == []
    # only known tokens are proposed: the match's continuation stops at the end
    assert proposer.propose(seq_of([4, 4, 4]), 3) == [4]


def test_ngram_index_grows_with_the_sequence() -> None:
    """Proposals made step by step, the index extended each time, equal those of a fresh
    index over the whole sequence; across the prompt/output boundary too."""
    import random

    rng = random.Random(7)
    tokens = [rng.randrange(6) for _ in range(300)]
    proposer = NgramProposer(4, 2, 4)
    growing = seq_of(tokens[:40], 40)
    for end in range(41, len(tokens)):
        growing.output_ids.append(tokens[end - 1])
        assert proposer.propose(growing, 4) == proposer.propose(seq_of(tokens[:end], 40), 4)


def test_acceptance_keeps_proposals_up_to_the_first_wrong_one() -> None:
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all right: a bonus token
    assert accepted_tokens([5, 6, 7], [5, 1, 7, 8]) == [5, 1]
    assert accepted_tokens([5, 6, 7], [2, 6, 7, 8]) == [2]
    counts = Acceptance()
    counts.record(3, 2)
    counts.record(2, 0)
    assert (counts.drafts, counts.draft_tokens, counts.accepted_tokens) == (2, 5, 2)
    assert counts.accepted_per_position == [1, 1, 0]
    taken = counts.take()
    assert taken.accepted_per_position == [1, 1, 0] and counts.drafts == 0


# ── the engine ─────────────────────────────────────────────────────────────────────────────────
class Oracle:
    """Proposes each sequence's known greedy continuation, or with ``wrong`` another token
    in place of each."""

    def __init__(self, continuations: dict[str, list[int]], wrong: bool = False) -> None:
        self.continuations = continuations
        self.wrong = wrong
        self.proposed = 0

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        done = len(seq.output_ids)
        guess = self.continuations[seq.uid][done : done + min(limit, 4)]
        self.proposed += len(guess)
        return [(t - 1 if t else 1) for t in guess] if self.wrong else guess


@pytest.fixture(scope="module")
def prompt_ids(encode) -> dict[str, list[int]]:
    return {f"p{i}": encode(text) for i, text in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def reference(make_engine, prompt_ids) -> dict[str, list[int]]:
    """Greedy tokens without speculation, all requests in one batch, EOS ignored."""
    engine = make_engine()
    for uid, ids in prompt_ids.items():
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True))
    return drain(engine).tokens


def run(engine, prompt_ids, proposer=None, **sampling) -> Drained:
    if proposer is not None:
        engine.policy.proposer = proposer
    for uid, ids in prompt_ids.items():
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True, **sampling))
    out = drain(engine)
    assert_idle(engine)
    return out


@pytest.mark.parametrize("backend", ["dense-cpu", "sdpa", "flex"])
def test_right_guesses_give_the_same_tokens_in_fewer_steps(
    make_engine, prompt_ids, reference, backend
) -> None:
    """Every attention backend verifies proposals as a chunk that continues the sequence."""
    engine = make_engine(speculative=NGRAM, attention_backend=backend)
    assert engine.runner.attention.name == backend
    oracle = Oracle(reference)
    out = run(engine, prompt_ids, oracle)
    assert out.tokens == reference
    assert out.steps <= 1 + math.ceil((MAX_TOKENS - 1) / 5) + 1  # a prefill, then 5 a step
    assert engine.acceptance.accepted_tokens == engine.acceptance.draft_tokens == oracle.proposed


def test_wrong_guesses_give_the_same_tokens(make_engine, prompt_ids, reference) -> None:
    engine = make_engine(speculative=NGRAM)
    out = run(engine, prompt_ids, Oracle(reference, wrong=True))
    assert out.tokens == reference
    assert engine.acceptance.drafts > 0 and engine.acceptance.accepted_tokens == 0


def test_a_proposer_that_fails_costs_its_sequence_the_guesses_not_the_answer(
    make_engine, prompt_ids, reference
) -> None:
    """Guesses only save steps: a proposer raising (a draft model out of memory) leaves that
    sequence decoding a token a step, with the same tokens, and the others speculating."""

    class FailsFor(Oracle):
        def propose(self, seq: Sequence, limit: int) -> list[int]:
            if seq.uid == "p1":
                raise RuntimeError("out of memory")
            return super().propose(seq, limit)

    engine = make_engine(speculative=NGRAM)
    oracle = FailsFor(reference)
    out = run(engine, prompt_ids, oracle)
    assert out.tokens == reference
    assert oracle.proposed > 0 and engine.acceptance.accepted_tokens == oracle.proposed


def test_ngram_proposals_give_the_same_tokens(make_engine, prompt_ids, reference) -> None:
    engine = make_engine(
        speculative='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    )
    assert run(engine, prompt_ids).tokens == reference
    assert engine.acceptance.drafts > 0  # one-token matches are common in 24 tokens


def test_speculation_beside_requests_that_cannot_speculate(
    make_engine, prompt_ids, reference
) -> None:
    """A penalised request takes a token per step next to speculating ones; small token
    budgets chunk the prompts and cut proposals short; a tiny pool preempts. Output is the
    same, every block comes back."""
    penalised_engine = make_engine()
    penalised_engine.add("pen", prompt_ids["p1"], greedy(MAX_TOKENS, repetition_penalty=1.3))
    penalised = drain(penalised_engine).tokens["pen"]
    engine = make_engine(speculative=NGRAM, kv_blocks=12, max_num_batched_tokens=7)
    engine.policy.proposer = Oracle({**reference, "pen": penalised})
    engine.add("pen", prompt_ids["p1"], greedy(MAX_TOKENS, repetition_penalty=1.3))
    assert not engine.policy.by_uid["pen"].speculates
    for uid, ids in prompt_ids.items():
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True))
    out = drain(engine)
    assert_idle(engine)
    assert out.tokens == {**reference, "pen": penalised}
    assert engine.acceptance.accepted_tokens > 0


def test_prefix_cache_stays_exact(make_engine, prompt_ids, reference) -> None:
    """The blocks a speculating sequence registers hold its real tokens only: a later request
    whose prompt is that sequence's prompt and output hits them and continues exactly."""
    engine = make_engine(speculative=NGRAM)
    engine.policy.proposer = Oracle(reference)
    long_uid = max(prompt_ids, key=lambda uid: len(prompt_ids[uid]))
    engine.add(long_uid, prompt_ids[long_uid], greedy(MAX_TOKENS, ignore_eos=True))
    drain(engine)
    follow = prompt_ids[long_uid] + reference[long_uid]
    plain = make_engine()
    plain.add("f", follow, greedy(8, ignore_eos=True))
    engine.policy.proposer = None
    seq = engine.add("f", follow, greedy(8, ignore_eos=True))
    assert drain(engine).tokens["f"] == drain(plain).tokens["f"]
    assert seq.cached_tokens >= engine.pool.block_size * (len(follow) // engine.pool.block_size - 1)


def test_max_tokens_and_eos_cut_a_step_short(make_engine, prompt_ids, reference) -> None:
    """Tokens after the one that ends a request are never sent, whatever was accepted."""
    engine = make_engine(speculative=NGRAM)
    engine.policy.proposer = Oracle(reference)
    uid = "p4"
    stop_at = reference[uid][6]
    engine.add("cut", prompt_ids[uid], greedy(5, ignore_eos=True))
    engine.add("stop", prompt_ids[uid], greedy(MAX_TOKENS, stop_token_ids=[stop_at]))
    engine.policy.proposer.continuations.update(cut=reference[uid], stop=reference[uid])
    out = drain(engine)
    assert out.tokens["cut"] == reference[uid][:5] and out.reasons["cut"] == "length"
    first = reference[uid].index(stop_at)
    assert out.tokens["stop"] == reference[uid][: first + 1] and out.reasons["stop"] == "stop"
    assert_idle(engine)


def test_logprobs_match_one_token_per_step(make_engine, prompt_ids, reference) -> None:
    def logprobs(engine) -> list:
        engine.add("p1", prompt_ids["p1"], greedy(10, ignore_eos=True, logprobs=2))
        entries = []
        while engine.has_work():
            for out in engine.step():
                assert len(out.logprobs or []) == len(out.token_ids)
                entries += out.logprobs or []
        return [(e.token_id, round(e.logprob, 4), e.top_ids) for e in entries]

    speculating = make_engine(speculative=NGRAM)
    speculating.policy.proposer = Oracle(reference)
    assert logprobs(speculating) == logprobs(make_engine())
    assert speculating.acceptance.accepted_tokens > 0


def test_sampled_tokens_keep_the_targets_distribution(make_engine, encode) -> None:
    """Many sampled requests of three tokens each (top-k 3 keeps the joint law on at most 27
    triples), with a fixed guess for the second and third, against the same requests one token
    per step: a two-sample chi-square test of the triples' counts. The global RNG is seeded,
    so a pass or a failure repeats exactly."""
    torch.manual_seed(1234)
    prompt = encode("hello please")
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    count = 1500

    def triples(engine) -> Counter:
        for i in range(count):
            engine.add(f"r{i}", prompt, params)
        return Counter(tuple(t) for t in drain(engine).tokens.values())

    plain = triples(make_engine(max_num_seqs=count))
    # guess the commonest continuation: accepted often, rejected often
    guess = list(plain.most_common(1)[0][0][1:])

    class Fixed:
        def propose(self, seq, limit):
            return guess[len(seq.output_ids) - 1 :][:limit]

    engine = make_engine(speculative=NGRAM, max_num_seqs=count)
    engine.policy.proposer = Fixed()
    speculated = triples(engine)
    assert 0 < engine.acceptance.accepted_tokens < engine.acceptance.draft_tokens
    cells = set(plain) | set(speculated)
    statistic = sum((plain[c] - speculated[c]) ** 2 / (plain[c] + speculated[c]) for c in cells)
    # the chi-square's 0.999 quantile at len(cells) - 1 degrees of freedom (Wilson-Hilferty)
    df = len(cells) - 1
    limit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert statistic < limit, (statistic, limit, plain, speculated)


def test_the_stage_exports_vllms_counters(make_engine, prompt_ids, reference) -> None:
    """Through the scheduler stage: the tokens reach the ring in batches of the kept ones, and
    the vllm:spec_decode_* counters add up what verification did."""
    import time

    from prometheus_client import REGISTRY

    from tokenline import protocol
    from tokenline.scheduler.stage import SchedulerStage
    from tokenline.stage_runtime import StageRuntime

    def value(name: str, **labels) -> float:
        return REGISTRY.get_sample_value(name, {"model_name": "spec", **labels}) or 0

    names = ("drafts", "draft_tokens", "accepted_tokens")
    before = {n: value(f"vllm:spec_decode_num_{n}_total") for n in names}
    first_before = value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0")
    sent: list = []
    stage = SchedulerStage(make_engine(speculative=NGRAM), "spec")
    stage.engine.policy.proposer = Oracle(reference)
    runtime = StageRuntime(stage, sent.append)
    request = protocol.Tokenized(
        uid="p3",
        prompt_ids=prompt_ids["p3"],
        sampling=protocol.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
        timeout_s=30,
    )
    runtime.process([(time.monotonic(), request)])
    while stage.engine.has_work():
        runtime.step()
    outputs = [o for m in sent if isinstance(m, protocol.TokenBatch) for o in m.outputs]
    assert [t for o in outputs for t in o.token_ids] == reference["p3"]
    assert max(len(o.token_ids) for o in outputs) == 5
    grew = {n: value(f"vllm:spec_decode_num_{n}_total") - before[n] for n in names}
    assert grew["drafts"] >= 4 and grew["draft_tokens"] == grew["accepted_tokens"] > 0
    first = value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0")
    assert first - first_before == grew["drafts"]


def test_bf16_greedy_output_with_flex_is_exact_at_one_stream(tiny_source, prompt_ids) -> None:
    """In bf16, where a kernel's rounding shows, flex attention's verification equals one token
    per step for a request alone, every guess right or wrong. (The other CPU paths compute a
    decode token and a verified chunk with kernels of other shapes, which may round apart, as
    steps of other batch shapes do without speculation; the tests above hold in float32.)"""
    backend = "flex"
    from tokenline.scheduler.engine import Engine, EngineLimits
    from tokenline.scheduler.runner import ModelRunner, RunnerOptions

    options = RunnerOptions(
        device="cpu", dtype="bfloat16", kv_cache_memory=2**23, attention_backend=backend
    )
    runner = ModelRunner(tiny_source, options)

    def alone(proposer=None) -> dict[str, list[int]]:
        tokens = {}
        for uid, ids in prompt_ids.items():
            engine = Engine(runner, EngineLimits(256), [], prefix_caching=False)
            tokens |= run(engine, {uid: ids}, proposer).tokens
        return tokens

    plain = alone()
    assert alone(Oracle(plain)) == plain
    assert alone(Oracle(plain, wrong=True)) == plain


def test_no_proposals_past_disable_by_batch_size(make_engine, prompt_ids, reference) -> None:
    """vLLM's disable_by_batch_size: while more sequences run than it says, nobody guesses;
    as the batch drains below it, guessing resumes. The output is the same either way."""
    config = '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 2}'
    assert parse(config).disable_by_batch_size == 2
    with pytest.raises(ValueError, match="1 or more"):
        parse('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0}')
    engine = make_engine(speculative=config)
    oracle = Oracle(reference)
    oracle.disable_by_batch_size = 2
    engine.policy.proposer = oracle
    for uid in ("p0", "p1", "p2"):
        engine.add(uid, prompt_ids[uid], greedy(MAX_TOKENS, ignore_eos=True))
    out = Drained()
    for _ in range(4):  # three running: no chunk carries proposals
        collect(engine.step(), out)
    assert engine.acceptance.drafts == 0
    engine.abort("p2")
    drain(engine, into=out)
    assert engine.acceptance.drafts > 0
    assert out.tokens["p0"] == reference["p0"] and out.tokens["p1"] == reference["p1"]
