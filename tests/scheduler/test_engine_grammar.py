"""Constrained decoding and logit_bias in the real engine over the tiny model."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import llguidance
import pytest
from scheduler_testkit import assert_idle, drain

from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import InvalidRequest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


def _grammar(schema: dict) -> str:
    # as the api builds them: fixed separators, no free whitespace to wander in
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(grammars=True)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_constrained_output_parses_and_validates(engine, encode, tokenizer, temperature):
    grammar = _grammar(PERSON)
    uids = [f"g{temperature}-{i}" for i in range(4)]
    for i, uid in enumerate(uids):
        sampling = SamplingParams(max_tokens=300, temperature=temperature, seed=i, grammar=grammar)
        engine.add(uid, encode(f"person {i}:"), sampling)
    engine.add("free", encode("unconstrained"), SamplingParams(max_tokens=20, temperature=1.0))
    seen = drain(engine)
    for uid in uids:
        assert seen.reasons[uid] == "stop", f"{uid} ended with {seen.reasons[uid]}"
        jsonschema.validate(json.loads(_text(tokenizer, seen.tokens[uid])), PERSON)
    assert seen.reasons["free"] in ("stop", "length")
    assert_idle(engine)


def test_different_grammars_share_one_batch(engine, encode, tokenizer):
    number = {"type": "integer", "minimum": 10, "maximum": 99}
    color = {"enum": ["red", "green", "blue"]}
    grammars = {"n": (number, _grammar(number)), "c": (color, _grammar(color))}
    for uid, (_, grammar) in grammars.items():
        engine.add(uid, encode("value"), SamplingParams(max_tokens=50, grammar=grammar, seed=3))
    seen = drain(engine)
    for uid, (schema, _) in grammars.items():
        assert seen.reasons[uid] == "stop"
        jsonschema.validate(json.loads(_text(tokenizer, seen.tokens[uid])), schema)


def test_grammar_complete_ends_even_with_ignore_eos_and_min_tokens(engine, encode, tokenizer):
    schema = {"enum": ["yes", "no"]}
    sampling = SamplingParams(
        max_tokens=100, grammar=_grammar(schema), ignore_eos=True, min_tokens=50
    )
    engine.add("short", encode("answer"), sampling)
    seen = drain(engine)
    assert seen.reasons["short"] == "stop"
    assert json.loads(_text(tokenizer, seen.tokens["short"])) in ("yes", "no")


def test_a_grammar_that_fails_to_build_rejects_only_its_request(engine, encode):
    bad = _grammar({"type": "string", "pattern": "(?<=a)b"})  # look-behind: not enforceable
    engine.add("bad", encode("x"), SamplingParams(max_tokens=5, grammar=bad))
    engine.add("fine", encode("y"), SamplingParams(max_tokens=5, temperature=0.0))
    seen = drain(engine)
    rejected = engine.take_rejected()
    assert [uid for uid, _ in rejected] == ["bad"]
    assert rejected[0][1].param == "response_format"
    assert "look-around" in str(rejected[0][1])
    assert "bad" not in seen.reasons and seen.reasons["fine"] == "length"
    assert_idle(engine)


def test_aborting_while_the_grammar_builds_frees_it(engine, encode):
    schema = {"type": "object", "properties": {"unique": {"type": "string", "maxLength": 3}}}
    engine.add("gone", encode("x"), SamplingParams(max_tokens=5, grammar=_grammar(schema)))
    assert "gone" in engine.held_uids()
    engine.abort("gone")
    seen = drain(engine)
    assert seen.reasons["gone"] == "abort"
    assert_idle(engine)


def test_a_slow_grammar_build_does_not_stall_other_decoding(engine, encode, monkeypatch):
    """While a grammar builds (held here until the other request has its 30 tokens), the
    other request decodes on."""
    release = threading.Event()
    real_build = engine.grammars._build

    def slow_build(grammar: str):
        release.wait(15)
        return real_build(grammar)

    monkeypatch.setattr(engine.grammars, "_build", slow_build)
    schema = {
        "type": "object",
        "properties": {"slow": {"type": "boolean"}},
        "required": ["slow"],
        "additionalProperties": False,
    }
    engine.add("slow", encode("a"), SamplingParams(max_tokens=40, grammar=_grammar(schema)))
    engine.add("busy", encode("b"), SamplingParams(max_tokens=30, temperature=0.0))
    started = time.monotonic()
    busy_tokens = 0
    while time.monotonic() - started < 10 and busy_tokens < 30:
        for out in engine.step():
            assert out.uid == "busy"
            busy_tokens += len(out.token_ids)
    assert busy_tokens == 30, "decoding stalled behind a grammar being built"
    release.set()
    seen = drain(engine)
    assert seen.reasons["slow"] == "stop"
    assert_idle(engine)


def test_a_built_grammar_is_reused_without_a_worker(engine, encode, monkeypatch):
    grammar = _grammar({"type": "boolean"})
    engine.add("first", encode("a"), SamplingParams(max_tokens=10, grammar=grammar))
    drain(engine)

    def no_worker(grammar: str):
        raise AssertionError("a cached grammar went to the worker again")

    monkeypatch.setattr(engine.grammars, "submit", no_worker)
    engine.add("second", encode("b"), SamplingParams(max_tokens=10, grammar=grammar))
    assert not engine.compiling
    assert drain(engine).reasons["second"] == "stop"


def test_grammar_mask_covers_padded_logit_columns(engine):
    compiler = engine.grammars
    matcher = compiler.cached(_grammar({"type": "boolean"})) or llguidance.LLMatcher(
        compiler.tokenizer, _grammar({"type": "boolean"})
    )
    width = compiler.vocab_size + 40  # a model whose embedding is padded past the tokenizer
    mask = compiler.masks([matcher], width, "cpu")
    assert mask.shape == (1, width)
    assert not mask[0, compiler.vocab_size :].any()
    assert 0 < int(mask[0].sum()) < compiler.vocab_size


def test_without_a_compiler_grammar_requests_are_refused(make_engine, encode):
    plain = make_engine(kv_blocks=8)
    with pytest.raises(InvalidRequest) as err:
        plain.add("g", encode("x"), SamplingParams(grammar=_grammar({"type": "boolean"})))
    assert err.value.param == "response_format"


# ── logit_bias ─────────────────────────────────────────────────────────────────────────────────
def test_logit_bias_changes_a_greedy_choice(engine, encode):
    prompt = encode("the quick brown")
    engine.add("plain", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    plain = drain(engine).tokens["plain"][0]
    target = (plain + 17) % engine.runner.vocab_size
    biased = SamplingParams(max_tokens=1, temperature=0.0, logit_bias={target: 100.0})
    engine.add("biased", prompt, biased)
    assert drain(engine).tokens["biased"] == [target]
    banned = SamplingParams(max_tokens=1, temperature=0.0, logit_bias={plain: -100.0})
    engine.add("banned", prompt, banned)
    assert drain(engine).tokens["banned"][0] != plain


def test_logit_bias_outside_the_vocabulary_is_refused(engine, encode):
    vocab = engine.runner.vocab_size
    with pytest.raises(InvalidRequest) as err:
        engine.add("oob", encode("x"), SamplingParams(logit_bias={vocab: 1.0}))
    assert err.value.param == "logit_bias"
    assert not engine.holds("oob")


def test_without_a_grammar_compiler_a_grammar_request_is_refused_saying_why(tiny_source):
    """A tokenizer the grammar library cannot read leaves the model serving plain text; what
    needs a grammar is refused with the reason the scheduler found at start."""
    from tokenline.scheduler.engine import Engine, EngineLimits, InvalidRequest
    from tokenline.scheduler.runner import ModelRunner, RunnerOptions

    runner = ModelRunner(
        tiny_source, RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=2**20)
    )
    engine = Engine(runner, EngineLimits(256), [], grammar_refusal="llguidance cannot read it")
    with pytest.raises(InvalidRequest, match="llguidance cannot read it") as refused:
        engine.add("g", [5, 6, 7], SamplingParams(max_tokens=2, grammar='start: "a"'))
    assert refused.value.param == "response_format"
    engine.add("plain", [5, 6, 7], SamplingParams(max_tokens=2))
    assert engine.has_work()
