"""The tokenizer handler driven directly, no sockets: prompts sent as token ids, and the
/tokenize and /detokenize calls it answers alone."""

from __future__ import annotations

import time

import msgspec
import pytest

from tokenline import protocol, uid_lifetime
from tokenline.stage_runtime import StageRuntime
from tokenline.tokenizer.stage import PromptEncoder, TokenizerStage

MAX_MODEL_LEN = 1024
SAMPLING = protocol.SamplingParams(max_tokens=4, temperature=0.0)
CHAT = [protocol.ChatMessage(role="user", content="Tell me about the river.")]


@pytest.fixture
def stage(tiny_tokenizer) -> TokenizerStage:
    return TokenizerStage(PromptEncoder(tiny_tokenizer, MAX_MODEL_LEN))


def run(stage: TokenizerStage, *messages: msgspec.Struct) -> list[msgspec.Struct]:
    now = time.monotonic()
    return stage.handle_batch([(now, m) for m in messages])


def generate(uid: str, **fields) -> protocol.Generate:
    return protocol.Generate(uid=uid, **{"sampling": SAMPLING, "timeout_s": 30, **fields})


# ── prompts as token ids ───────────────────────────────────────────────────────────────────────
def test_prompt_ids_are_the_prompt_untouched(stage, tiny_tokenizer):
    ids = tiny_tokenizer("the old river road", add_special_tokens=False)["input_ids"]
    by_ids, by_text = run(stage, generate("a", prompt_ids=ids), generate("b", prompt="x y"))
    assert isinstance(by_ids, protocol.Tokenized) and by_ids.prompt_ids == ids
    assert isinstance(by_text, protocol.Tokenized) and by_text.uid == "b"


def test_prompt_ids_match_the_same_prompt_sent_as_text(stage, tiny_tokenizer):
    text = "hello there, river"
    ids = tiny_tokenizer(text)["input_ids"]  # what a text prompt becomes, specials included
    by_text, by_ids = run(stage, generate("t", prompt=text), generate("i", prompt_ids=ids))
    assert by_text.prompt_ids == by_ids.prompt_ids == ids
    assert by_text.sampling == by_ids.sampling


def test_an_out_of_vocab_id_fails_naming_it_and_the_vocab_size(stage, tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    ok, too_big, negative = run(
        stage,
        generate("ok", prompt_ids=[vocab - 1]),
        generate("big", prompt_ids=[5, vocab, vocab + 7]),
        generate("neg", prompt_ids=[3, -1]),
    )
    assert isinstance(ok, protocol.Tokenized)
    for failed, bad in ((too_big, vocab), (negative, -1)):
        assert isinstance(failed, protocol.Failed)
        assert (failed.http_status, failed.code, failed.param) == (
            400,
            "invalid_request_error",
            "prompt",
        )
        assert f"token id {bad} " in failed.message and str(vocab) in failed.message


def test_empty_prompt_ids_fail(stage):
    (failed,) = run(stage, generate("e", prompt_ids=[]))
    assert isinstance(failed, protocol.Failed)
    assert (failed.http_status, failed.param) == (400, "prompt")
    assert failed.code == "invalid_request_error"
    assert "no token ids" in failed.message


def test_prompt_ids_are_held_to_the_context_length(stage):
    long, with_room, no_room = run(
        stage,
        generate("long", prompt_ids=[7] * MAX_MODEL_LEN),
        protocol.Generate(
            uid="fill", sampling=protocol.SamplingParams(), timeout_s=30, prompt_ids=[7] * 10
        ),
        generate("over", prompt_ids=[7] * (MAX_MODEL_LEN - 2)),  # + max_tokens 4
    )
    assert isinstance(long, protocol.Failed) and long.code == "context_length_exceeded"
    assert long.param == "prompt"
    assert isinstance(with_room, protocol.Tokenized)
    assert with_room.sampling.max_tokens == MAX_MODEL_LEN - 10  # filled in as for text
    # max_tokens 4 past the context: cut to the 2 it leaves, as vLLM 0.32 cuts it
    assert isinstance(no_room, protocol.Tokenized) and no_room.sampling.max_tokens == 2


# ── the prompt's length: the tokenizer stage owns these rules (the engine trusts them) ─────────
def test_a_text_prompt_that_tokenizes_to_nothing_fails(stage):
    (failed,) = run(stage, generate("e", prompt=""))
    assert isinstance(failed, protocol.Failed)
    assert (failed.http_status, failed.code, failed.param) == (
        400,
        "invalid_request_error",
        "prompt",
    )
    assert "empty after tokenization" in failed.message


def test_min_tokens_above_what_the_request_may_generate_is_refused(stage):
    """vLLM's rule: min_tokens at most max_tokens, the one sent or the context's rest; the
    engine would otherwise end at max_tokens with min_tokens unmet."""
    prompt = [7] * 10
    at_most, above, above_rest = run(
        stage,
        generate(
            "at-most",
            prompt_ids=prompt,
            sampling=protocol.SamplingParams(max_tokens=4, min_tokens=4),
        ),
        generate(
            "above", prompt_ids=prompt, sampling=protocol.SamplingParams(max_tokens=4, min_tokens=5)
        ),
        generate(
            "above-rest",
            prompt_ids=prompt,
            sampling=protocol.SamplingParams(min_tokens=MAX_MODEL_LEN),
        ),
    )
    assert isinstance(at_most, protocol.Tokenized) and at_most.sampling.min_tokens == 4
    for failed, most in ((above, 4), (above_rest, MAX_MODEL_LEN - len(prompt))):
        assert isinstance(failed, protocol.Failed)
        assert (failed.http_status, failed.code, failed.param) == (
            400,
            "invalid_request_error",
            "min_tokens",
        )
        assert f"the {most} tokens this request may generate" in failed.message


def test_a_text_prompt_is_held_to_the_context_and_given_the_rest_of_it(stage):
    words = "the old river road"
    unset = protocol.SamplingParams()  # max_tokens: up to the context
    fill, over, long = run(
        stage,
        protocol.Generate(uid="fill", sampling=unset, timeout_s=30, prompt=words),
        protocol.Generate(
            uid="over",
            sampling=protocol.SamplingParams(max_tokens=MAX_MODEL_LEN),
            timeout_s=30,
            prompt=words,
        ),
        generate("long", prompt=" ".join([words] * MAX_MODEL_LEN)),
    )
    assert isinstance(fill, protocol.Tokenized)
    assert fill.sampling.max_tokens == MAX_MODEL_LEN - len(fill.prompt_ids)
    assert isinstance(over, protocol.Tokenized)  # a max_tokens past the context: cut to it
    assert over.sampling.max_tokens == MAX_MODEL_LEN - len(over.prompt_ids)
    assert isinstance(long, protocol.Failed) and long.code == "context_length_exceeded"
    assert long.param == "prompt" and f"{MAX_MODEL_LEN} tokens" in long.message


def test_prompt_ids_cross_the_wire(stage):
    codec = protocol.Codec(protocol.ToTokenizer)
    sent = generate("w", prompt_ids=[1, 2, 3])
    assert codec.decode(codec.encode(sent)) == sent


# ── /tokenize and /detokenize ──────────────────────────────────────────────────────────────────
def test_tokenize_a_prompt_counts_what_a_completion_would(stage, tiny_tokenizer):
    text = "the river and the mountain"
    answer, request = run(
        stage,
        protocol.TokenizeCall(uid="c", prompt=text, return_token_strs=True),
        generate("g", prompt=text),
    )
    assert isinstance(answer, protocol.TokenizerAnswer)
    assert answer.ids == request.prompt_ids
    assert answer.max_model_len == MAX_MODEL_LEN
    assert answer.token_strs == tiny_tokenizer.convert_ids_to_tokens(answer.ids)
    assert "".join(answer.token_strs).replace("Ġ", " ") == text  # byte-level pieces


def test_tokenize_chat_renders_as_a_chat_completion(stage):
    answer, request = run(
        stage,
        protocol.TokenizeCall(uid="c", messages=CHAT, add_special_tokens=False),
        generate("g", messages=CHAT),
    )
    assert answer.ids == request.prompt_ids
    assert answer.token_strs is None  # not asked for


def test_tokenize_chat_with_tools_renders_as_a_chat_completion(stage):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    plain, with_tools, request = run(
        stage,
        protocol.TokenizeCall(uid="p", messages=CHAT, add_special_tokens=False),
        protocol.TokenizeCall(uid="t", messages=CHAT, tools=tools, add_special_tokens=False),
        generate("g", messages=CHAT, tools=tools),
    )
    assert with_tools.ids == request.prompt_ids
    assert len(with_tools.ids) > len(plain.ids)


def test_tokenize_chat_flags_change_the_rendering(stage, tiny_tokenizer):
    turns = [*CHAT, protocol.ChatMessage(role="assistant", content="It runs")]
    bare, prefilled = run(
        stage,
        protocol.TokenizeCall(
            uid="a", messages=CHAT, add_generation_prompt=False, add_special_tokens=False
        ),
        protocol.TokenizeCall(
            uid="b",
            messages=turns,
            add_generation_prompt=False,
            continue_final_message=True,
            add_special_tokens=False,
        ),
    )
    (with_prompt,) = run(
        stage, protocol.TokenizeCall(uid="c", messages=CHAT, add_special_tokens=False)
    )
    assert with_prompt.ids[: len(bare.ids)] == bare.ids and len(with_prompt.ids) > len(bare.ids)
    assert tiny_tokenizer.decode(prefilled.ids).endswith("It runs")


def test_a_template_that_refuses_fails_the_call(stage):
    both = protocol.TokenizeCall(uid="x", messages=CHAT, continue_final_message=True)
    (failed,) = run(stage, both)  # add_generation_prompt is true as well
    assert isinstance(failed, protocol.Failed) and failed.uid == "x"
    assert (failed.http_status, failed.param) == (400, "messages")


def test_detokenize_round_trips(stage):
    text = "Tell me about the river, 🙂 and the mountain."
    (answer,) = run(stage, protocol.TokenizeCall(uid="t", prompt=text))
    (decoded,) = run(stage, protocol.TokenizeCall(uid="d", decode=answer.ids))
    assert isinstance(decoded, protocol.TokenizerAnswer) and decoded.text == text


def test_detokenize_names_the_out_of_vocab_id(stage, tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    (failed,) = run(stage, protocol.TokenizeCall(uid="d", decode=[1, vocab + 3, vocab]))
    assert isinstance(failed, protocol.Failed)
    assert (failed.http_status, failed.param) == (400, "tokens")
    assert failed.code == "invalid_request_error"
    assert f"token id {vocab + 3} " in failed.message and f"vocab size {vocab}" in failed.message


def test_calls_and_requests_keep_their_order_in_one_batch(stage):
    batch = [
        generate("g1", prompt="a"),
        protocol.TokenizeCall(uid="c1", prompt="b"),
        protocol.Abort(uid="g1", reason="client_disconnect"),
        protocol.TokenizeCall(uid="c2", decode=[5]),
        generate("g2", prompt_ids=[5]),
    ]
    out = run(stage, *batch)
    assert [uid_lifetime.uids_of(m) for m in out] == [["g1"], ["c1"], ["g1"], ["c2"], ["g2"]]


# ── the leak ledger ────────────────────────────────────────────────────────────────────────────
def test_calls_open_nothing_in_any_ledger(stage):
    """A call is answered where it arrives: no stage's ledger holds it, before or after."""
    sent: list[msgspec.Struct] = []
    runtime = StageRuntime(stage, sent.append)
    runtime.process([(time.monotonic(), protocol.TokenizeCall(uid="c", prompt="river"))])
    runtime.process([(time.monotonic(), protocol.TokenizeCall(uid="d", decode=[10**6]))])
    assert [type(m) for m in sent] == [protocol.TokenizerAnswer, protocol.Failed]
    assert len(runtime.ledger) == 0
    assert uid_lifetime.started_uids(sent[0]) == [] and uid_lifetime.ended_uids(sent[0]) == ["c"]
    runtime.tick(force=True)
    assert len(runtime.ledger) == 0


def test_answers_cross_every_hop_to_the_api():
    answer = protocol.TokenizerAnswer(uid="c", ids=[1, 2], token_strs=["a", "b"], max_model_len=9)
    for union in (protocol.ToScheduler, protocol.ToDetokenizer, protocol.ToApi):
        codec = protocol.Codec(union)
        assert codec.decode(codec.encode(answer)) == answer
