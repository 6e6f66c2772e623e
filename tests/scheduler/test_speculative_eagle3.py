"""EAGLE-3 speculation (vLLM's ``eagle3``): a one-layer head reads the target's hidden states
and guesses, the target checks. The head's guesses are those of speculators' PyTorch head
given transformers' hidden states of the target (eagle3_oracle.py), and the output is the
target's own, with guesses all wrong (a random head) or often right (a head that always guesses
the target's favourite tokens), alone and batched, with chunked prefill and prefix hits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eagle3_oracle import OracleHead, target_aux, write_head
from scheduler_testkit import PROMPTS, assert_idle, drain, greedy

from tokenline.scheduler.models.llama import LlamaForCausalLM
from tokenline.scheduler.speculative import eagle3
from tokenline.scheduler.speculative.config import parse

MAX_TOKENS = 24


def eagle3_config(head: Path, tokens: int = 4) -> str:
    return json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": tokens})


@pytest.fixture(scope="module")
def target_config(tiny_source) -> dict:
    return json.loads((Path(tiny_source.path) / "config.json").read_text())


@pytest.fixture(scope="module")
def random_head(target_config, tmp_path_factory) -> Path:
    """A random head over half the target's vocabulary (d2t maps it to every other id)."""
    vocab = target_config["vocab_size"]
    draft = vocab // 2
    d2t = torch.arange(draft) * 2 - torch.arange(draft)  # draft id i is target id 2i
    return write_head(tmp_path_factory.mktemp("eagle3") / "head", target_config,
                      draft_vocab=draft, d2t=d2t)  # fmt: skip


FAVOURITES = (100, 200)  # biased requests emit one of these at every step
BIASED = {t: 50.0 for t in FAVOURITES}


def run_all(engine, encode) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add(f"r{i}", encode(prompt), greedy(MAX_TOKENS))
    for i in (1, 4):  # the target's choice between the favourites follows the context
        engine.add(f"b{i}", encode(PROMPTS[i]), greedy(MAX_TOKENS, logit_bias=BIASED))
    return drain(engine).tokens


@pytest.fixture(scope="module")
def expected(make_engine, encode) -> dict[str, list[int]]:
    return run_all(make_engine(), encode)


@pytest.fixture(scope="module")
def favourite_head(target_config, tmp_path_factory) -> Path:
    """A head of two draft tokens, the favourites: on biased requests it guesses right about
    half the time, so verification keeps some guesses and rejects others."""
    d2t = torch.tensor(FAVOURITES) - torch.arange(2)
    return write_head(tmp_path_factory.mktemp("eagle3") / "favourite", target_config,
                      draft_vocab=2, d2t=d2t, seed=3)  # fmt: skip


def recording(proposer) -> list[tuple[list[int], list[int]]]:
    """Each proposal the policy asks for: the sequence's tokens then, and the guesses."""
    calls: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def record(seq, limit):
        guesses = propose(seq, limit)
        calls.append((seq.token_slice(0, seq.num_tokens), guesses))
        return guesses

    proposer.propose = record
    return calls


@pytest.mark.parametrize(
    "kind", ["target-embedding", "own-embedding", "speculators", "pieces", "favourite", "eager"]
)
def test_the_heads_guesses_are_speculators_given_the_same_hidden_states(
    make_engine, tiny_source, target_config, encode, favourite_head, kind, tmp_path, monkeypatch
) -> None:
    """``eager``: the head reads the target's rows after every step, not at its proposals;
    ``pieces``: a prompt's rows reach the head in forwards of 3 rows."""
    import transformers

    if kind == "eager":
        monkeypatch.setattr(eagle3, "MAX_WAITING", 0)
        kind = "favourite"
    if kind == "pieces":
        monkeypatch.setattr(eagle3, "CATCH_UP_ROWS", 3)

    vocab = target_config["vocab_size"]
    d2t = torch.randperm(vocab, generator=torch.Generator().manual_seed(5))[:300].sort().values
    head = favourite_head
    if kind != "favourite":
        head = write_head(tmp_path / "head", target_config, draft_vocab=300,
                          d2t=d2t - torch.arange(300), seed=7,
                          own_embedding=kind == "own-embedding",
                          speculators=kind == "speculators")  # fmt: skip
    engine = make_engine(speculative=eagle3_config(head, tokens=3), prefix_caching=False)
    calls = recording(engine.policy.proposer)
    bias = BIASED if kind == "favourite" else {}
    engine.add("a", encode(PROMPTS[1]), greedy(16, logit_bias=bias))
    engine.add("b", encode(PROMPTS[4]), greedy(16, logit_bias=bias))
    drain(engine)
    assert len(calls) >= 4
    if kind == "favourite":  # calls after guesses kept and after guesses rolled back
        assert 0 < engine.acceptance.accepted_tokens < engine.acceptance.draft_tokens
    target = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_source.path, dtype=torch.float32
    )
    embed = target.model.embed_tokens.weight.detach()
    oracle = OracleHead(head)
    for tokens, guesses in calls:
        assert guesses  # every proposal has the target's rows up to its last token
        aux = target_aux(target, tokens[:-1], (1, 2, 3))
        assert guesses == oracle.propose(tokens, aux, embed, len(guesses)), tokens


def test_a_random_head_leaves_the_output_the_targets(
    make_engine, random_head, encode, expected
) -> None:
    engine = make_engine(speculative=eagle3_config(random_head))
    assert run_all(engine, encode) == expected
    assert engine.acceptance.drafts > 0
    assert_idle(engine)
    assert not engine.policy.proposer.states  # idle: every sequence's head KV given back


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 8},  # chunked prefill, guesses squeezed by the budget
        {"dense_decode": False},
        {"kv_blocks": 12},  # preemptions: a sequence's rows are computed again
    ],
    ids=["batched", "chunked-prefill", "paged-decode", "preempting"],
)
def test_guesses_kept_and_rejected_leave_the_output_the_targets(
    make_engine, favourite_head, encode, expected, options
) -> None:
    engine = make_engine(speculative=eagle3_config(favourite_head, tokens=3), **options)
    assert run_all(engine, encode) == expected
    taken = engine.acceptance
    assert 0 < taken.accepted_tokens < taken.draft_tokens  # right guesses and wrong ones
    assert_idle(engine)


def test_prefix_hits_leave_the_output_the_targets(make_engine, favourite_head, encode) -> None:
    """A prompt found in the prefix cache has no hidden states of its cached part: the head
    goes without them, the output stays the target's."""
    prompt = encode(PROMPTS[1])
    plain = make_engine()
    plain.add("x", prompt, greedy(MAX_TOKENS, logit_bias=BIASED))
    want = drain(plain).tokens["x"]
    engine = make_engine(speculative=eagle3_config(favourite_head))
    for uid in ("first", "again"):
        engine.add(uid, prompt, greedy(MAX_TOKENS, logit_bias=BIASED))
        assert drain(engine).tokens[uid] == want
    assert engine.prefix_cache_hits > 0 and engine.acceptance.accepted_tokens > 0
    assert_idle(engine)


def test_nothing_is_kept_without_eagle3(make_engine, encode) -> None:
    engine = make_engine(speculative='{"method": "ngram", "num_speculative_tokens": 3}')
    engine.add("a", encode(PROMPTS[4]), greedy(4))
    drain(engine)
    assert engine.runner.aux_sink is None
    assert engine.runner.model.aux_layers == () and engine.runner.model.aux_hidden is None


def test_the_config_takes_the_heads_path() -> None:
    config = parse('{"method": "eagle3", "model": "/heads/h", "num_speculative_tokens": 3}')
    assert (config.method, config.model, config.num_speculative_tokens) == ("eagle3", "/heads/h", 3)
    with pytest.raises(ValueError, match='needs "model"'):
        parse('{"method": "eagle3", "num_speculative_tokens": 3}')


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"hidden": 128}, "hidden size is 128 and the target's 256"),
        ({"architecture": "LlamaForCausalLMEagle"}, "not an EAGLE-3 head"),
        ({"aux": (1, 2, 9)}, "not layers of the target"),
        ({"aux": (1, 2, 2)}, "fc weight"),
    ],
)
def test_what_cannot_be_served_is_refused_at_start(
    make_engine, target_config, tmp_path, change, says
) -> None:
    head = write_head(tmp_path / "head", target_config, draft_vocab=target_config["vocab_size"],
                      **change)  # fmt: skip
    with pytest.raises(SystemExit, match=says):
        make_engine(speculative=eagle3_config(head))


def test_a_target_that_keeps_no_hidden_states_is_refused(
    make_engine, random_head, monkeypatch
) -> None:
    monkeypatch.setattr(LlamaForCausalLM, "captures_aux", False)
    with pytest.raises(SystemExit, match="does not hand its hidden states"):
        make_engine(speculative=eagle3_config(random_head))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"fc_norm": True}, "does not compute yet"),
        ({"speculators_model_type": "mlp"}, "not an EAGLE-3 head"),
    ],
)
def test_speculators_heads_it_cannot_compute_are_refused(
    make_engine, target_config, tmp_path, change, says
) -> None:
    head = write_head(tmp_path / "head", target_config, draft_vocab=64,
                      d2t=torch.zeros(64, dtype=torch.long), speculators=True)  # fmt: skip
    config = json.loads((head / "config.json").read_text()) | change
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match=says):
        make_engine(speculative=eagle3_config(head))


def test_sampled_requests_speculate_beside_greedy_ones(
    make_engine, favourite_head, encode, expected
) -> None:
    """Sampled requests (their law is verify.py's, tested with any proposer) speculate in the
    same batches as greedy ones; the greedy ones keep their tokens, everything is given back."""
    engine = make_engine(speculative=eagle3_config(favourite_head, tokens=3))
    for i in range(4):
        sampling = greedy(MAX_TOKENS, logit_bias=BIASED)
        sampling.temperature, sampling.seed = 1.0, i
        engine.add(f"s{i}", encode(PROMPTS[i]), sampling)
    tokens = run_all(engine, encode)
    assert {uid: tokens[uid] for uid in expected} == expected
    assert all(set(tokens[f"s{i}"]) <= set(FAVOURITES) for i in range(4))
    assert engine.acceptance.accepted_tokens > 0
    assert_idle(engine)


def test_a_gpu_short_of_room_for_the_heads_kv_is_warned_of(
    make_engine, random_head, monkeypatch, caplog
) -> None:
    engine = make_engine(speculative=eagle3_config(random_head))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (0, 0))
    eagle3._check_room(engine.policy.proposer.head, engine.runner)
    assert "lower --gpu-memory-utilization" in caplog.text


def test_a_hugging_face_id_is_fetched(make_engine, random_head, monkeypatch) -> None:
    import huggingface_hub

    asked = []

    def fetch(repo_id, **kw):
        asked.append(repo_id)
        return str(random_head)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetch)
    engine = make_engine(speculative=eagle3_config(Path("acme/eagle3-head")))
    assert asked == ["acme/eagle3-head"] and engine.policy.proposer.head.aux_layers == (1, 2, 3)
