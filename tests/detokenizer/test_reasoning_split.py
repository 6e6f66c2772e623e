"""Thinking kept apart from the answer, by token id: the split alone, then the detokenizer stage
under its runtime with the thinking variant of the tiny model's tokenizer."""

from __future__ import annotations

import time

import msgspec
import pytest
from reasoning_testkit import END, START, TEMPLATE, write_thinking_model
from tokenizers import Tokenizer

from tokenline import protocol, tiny_model
from tokenline.detokenizer.stage import DetokenizerStage
from tokenline.reasoning import ReasoningSplit, detect, reasoning_format
from tokenline.stage_runtime import StageRuntime


@pytest.fixture(scope="session")
def thinking(tmp_path_factory) -> Tokenizer:
    cache = tmp_path_factory.getbasetemp() / "tiny-model-cache"
    tiny = tiny_model.ensure_cached(cache)
    out = write_thinking_model(tiny, tmp_path_factory.mktemp("thinking") / "model")
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _split(tokenizer, name, prompt_tail, ids):
    split = ReasoningSplit(reasoning_format(name, tokenizer), prompt_tail)
    return [(s.reasoning, s.token_ids, s.tokens) for s in split.segments(ids)]


def test_qwen3_thinks_only_inside_the_block_the_output_opens(thinking):
    start, end = thinking.token_to_id(START), thinking.token_to_id(END)
    a, b, c = _ids(thinking, "a b c")
    assert _split(thinking, "qwen3", [], [start, a, b, end, c]) == [
        (True, [a, b], 4),
        (False, [c], 1),
    ]
    assert _split(thinking, "qwen3", [], [a, b]) == [(False, [a, b], 2)]  # no block: an answer
    # a <think> after the answer began is text, as is a stray </think>
    assert _split(thinking, "qwen3", [], [a, start, end]) == [(False, [a, start, end], 3)]


def test_the_prompt_decides_where_the_output_starts(thinking):
    start, end = thinking.token_to_id(START), thinking.token_to_id(END)
    a, b = _ids(thinking, "a b")
    opened = [start, *_ids(thinking, "\n")]  # a thinking-only template opens the block
    assert _split(thinking, "qwen3", opened, [a, end, b]) == [(True, [a], 2), (False, [b], 1)]
    closed = [start, *_ids(thinking, "\n\n"), end, *_ids(thinking, "\n\n")]  # thinking off
    assert _split(thinking, "qwen3", closed, [start, a]) == [(False, [start, a], 2)]
    assert _split(thinking, "deepseek_r1", closed, [a, end]) == [(False, [a, end], 2)]


def test_deepseek_r1_thinks_until_the_block_ends_whoever_opened_it(thinking):
    start, end = thinking.token_to_id(START), thinking.token_to_id(END)
    a, b = _ids(thinking, "a b")
    assert _split(thinking, "deepseek_r1", [], [a, end, b]) == [(True, [a], 2), (False, [b], 1)]
    assert _split(thinking, "deepseek_r1", [], [start, a, end]) == [(True, [a], 3)]
    assert _split(thinking, "deepseek_r1", [], [a, b]) == [(True, [a, b], 2)]  # cut short


def test_only_the_output_s_first_token_may_open_a_block(thinking):
    start, end = thinking.token_to_id(START), thinking.token_to_id(END)
    (a,) = _ids(thinking, "a")
    split = ReasoningSplit(reasoning_format("qwen3", thinking), [])
    assert split.may_open and not split.reasoning
    assert [split.step(t) for t in (start, a, end, a)] == ["marker", "thought", "marker", "answer"]
    assert not split.may_open
    r1 = ReasoningSplit(reasoning_format("deepseek_r1", thinking), [])
    assert r1.reasoning and not r1.may_open  # already thinking: nothing to open


def test_a_vocabulary_without_the_markers_gets_a_split_on_text(thinking, tokenizer):
    by_text = reasoning_format("qwen3", tokenizer)  # the plain tiny model has no markers
    assert by_text.by_text and not reasoning_format("qwen3", thinking).by_text
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_format("granite", thinking)
    assert reasoning_format("none", thinking) is None


def test_auto_reads_the_template_alone():
    assert detect(TEMPLATE) == "qwen3"
    r1 = "{{ bos }}{% if add_generation_prompt %}<think>\n{% endif %}{{ c.split('</think>') }}"
    assert detect(r1) == "deepseek_r1"
    assert detect(tiny_model.CHAT_TEMPLATE) == "none"
    assert detect(None) == "none"


class Ring:
    """The detokenizer under its real runtime, its replies decoded as the api reads them."""

    def __init__(self, tokenizer: Tokenizer, parser: str) -> None:
        self.handler = DetokenizerStage(tokenizer, reasoning_format(parser, tokenizer))
        self.sent: list[msgspec.Struct] = []
        codec = protocol.Codec(protocol.ToApi)
        self.runtime = StageRuntime(
            self.handler, lambda m: self.sent.append(codec.decode(codec.encode(m)))
        )

    def run(self, begin: protocol.Begin, *chunks: list[int], finish: str = "stop"):
        self.sent.clear()
        now = time.monotonic()
        self.runtime.process([(now, begin)])
        for i, ids in enumerate(chunks):
            last = i == len(chunks) - 1
            output = protocol.TokenOutput(
                uid=begin.uid, token_ids=ids, finish_reason=finish if last else None
            )
            self.runtime.process([(now, protocol.TokenBatch(outputs=[output]))])
        assert not self.handler.live
        return [r for m in self.sent if isinstance(m, protocol.ReplyBatch) for r in m.replies]


def _begin(uid: str, reasoning: bool, tail: list[int] | None = None) -> protocol.Begin:
    return protocol.Begin(
        uid=uid, prompt_tokens=3, timeout_s=30, prompt_tail=tail or [], reasoning=reasoning
    )


def test_the_stage_sends_thinking_and_answer_apart_and_never_the_markers(thinking):
    ring = Ring(thinking, "qwen3")
    start, end = thinking.token_to_id(START), thinking.token_to_id(END)
    thought, answer = _ids(thinking, "the river"), _ids(thinking, " hello world")
    # the markers arrive inside steps and at their edges
    replies = ring.run(
        _begin("u1", True), [start, thought[0]], [*thought[1:], end], [answer[0]], answer[1:]
    )
    assert "".join(r.reasoning for r in replies) == "the river"
    assert "".join(r.text for r in replies) == " hello world"
    assert sum(r.reasoning_tokens for r in replies) == len(thought) + 2
    assert sum(r.num_tokens for r in replies) == len(thought) + len(answer) + 2
    assert all(START not in r.text + r.reasoning and END not in r.text for r in replies)


def test_a_reply_cut_inside_its_thinking_has_an_empty_answer(thinking):
    ring = Ring(thinking, "deepseek_r1")
    thought = _ids(thinking, "the river mountain")
    replies = ring.run(_begin("u2", True), thought[:1], thought[1:], finish="length")
    assert [r.text for r in replies] == ["", ""]
    assert "".join(r.reasoning for r in replies) == "the river mountain"
    assert replies[-1].finish_reason == "length"


def test_a_stop_string_ends_the_answer_and_held_text_keeps_its_channel(thinking):
    ring = Ring(thinking, "qwen3")
    start, end = thinking.token_to_id(START), thinking.token_to_id(END)
    begin = msgspec.structs.replace(_begin("u3", True), stop=["world"])
    # "wor" is held back as a possible stop string while thinking; the block's end lets it
    # out as thinking, and the answer's own "world" stops the reply
    replies = ring.run(
        begin, [start, *_ids(thinking, "the wor"), end], _ids(thinking, " hello world again")
    )
    assert "".join(r.reasoning for r in replies) == "the wor"
    assert "".join(r.text for r in replies) == " hello "
    assert replies[-1].finish_reason == "stop"


def test_completions_and_models_without_a_parser_keep_the_markers_as_text(thinking):
    start, end = thinking.token_to_id(START), thinking.token_to_id(END)
    ids = [start, *_ids(thinking, "a"), end, *_ids(thinking, " b")]
    for ring, reasoning in ((Ring(thinking, "qwen3"), False), (Ring(thinking, "none"), True)):
        replies = ring.run(_begin("u4", reasoning), ids)
        assert "".join(r.text for r in replies) == "<think>a</think> b"
        assert not any(r.reasoning or r.reasoning_tokens for r in replies)


def test_nothing_after_a_stop_string_leaks_from_a_step_of_several_tokens(thinking):
    """Speculation hands the detokenizer several tokens a step: a stop string in the thinking
    ends the reply there, and the answer after the block's end in the same step is not text."""
    ring = Ring(thinking, "deepseek_r1")
    end = thinking.token_to_id(END)
    ids = [*_ids(thinking, "think STOP more"), end, *_ids(thinking, " answer text")]
    begin = msgspec.structs.replace(_begin("u5", True), stop=["STOP"])
    replies = ring.run(begin, ids[:3], ids[3:])
    assert "".join(r.reasoning for r in replies) == "think "
    assert "".join(r.text for r in replies) == ""
    assert replies[-1].finish_reason == "stop"
