"""Thinking kept apart from the answer on text, for a vocabulary without ``<think>`` and
``</think>`` as tokens (the plain tiny model's: it spells ``</think>`` in six pieces). The
oracle is the split by token id over the thinking variant, whose markers are tokens: the
same text splits into the same thinking and answer whichever way it was tokenized."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
from reasoning_testkit import write_thinking_model
from tokenizers import Tokenizer

from tokenline import protocol, tiny_model
from tokenline.detokenizer.stage import DetokenizerStage
from tokenline.detokenizer.text_split import TextSplit
from tokenline.reasoning import MarkersAreText, ReasoningSplit, reasoning_format
from tokenline.scheduler.refusals import InvalidRequest
from tokenline.stage_runtime import StageRuntime

OUTPUTS = [  # (parser, prompt's end, generated text)
    ("qwen3", "<|assistant|>\n", "<think>the river</think>\n\nhello world"),
    ("qwen3", "<|assistant|>\n", "plain <think>text</think> stays"),
    ("qwen3", "<|assistant|>\n<think>\n", "the <b>river</b> <think>again</think>\n\nhi"),
    ("qwen3", "<think>\n\n</think>\n\n", "<think>answer</think>"),
    ("deepseek_r1", "<|assistant|>\n", "long </thin river</think>answer <think>x"),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "cut inside <" + "/thi"),
]


@pytest.fixture(scope="session")
def thinking(tmp_path_factory) -> Tokenizer:
    cache = tmp_path_factory.getbasetemp() / "tiny-model-cache"
    out = write_thinking_model(
        tiny_model.ensure_cached(cache), tmp_path_factory.mktemp("thinking") / "model"
    )
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


class Ring:
    """The detokenizer under its real runtime, its replies decoded as the api reads them."""

    def __init__(self, tokenizer: Tokenizer, parser: str) -> None:
        self.handler = DetokenizerStage(tokenizer, reasoning_format(parser, tokenizer))
        self.sent: list[msgspec.Struct] = []
        codec = protocol.Codec(protocol.ToApi)
        self.runtime = StageRuntime(
            self.handler, lambda m: self.sent.append(codec.decode(codec.encode(m)))
        )

    def run(self, prompt: list[int], ids: list[int], steps: list[int], **begin) -> list:
        """``ids`` sent in steps of the given sizes; the replies."""
        self.sent.clear()
        now = time.monotonic()
        start = protocol.Begin(
            uid="u", prompt_tokens=3, timeout_s=30, prompt_tail=prompt[-8:], reasoning=True
        )
        self.runtime.process([(now, msgspec.structs.replace(start, **begin))])
        at = 0
        for i, size in enumerate(steps):
            last = i == len(steps) - 1
            chunk = ids[at:] if last else ids[at : at + size]
            at += size
            output = protocol.TokenOutput(
                uid="u", token_ids=chunk, finish_reason="stop" if last else None
            )
            self.runtime.process([(now, protocol.TokenBatch(outputs=[output]))])
        assert not self.handler.live
        return [r for m in self.sent if isinstance(m, protocol.ReplyBatch) for r in m.replies]


def _split_by(tokenizer: Tokenizer, parser: str, prompt: str, text: str, seed: int = 0):
    ids = _ids(tokenizer, text)
    steps = [random.Random(seed).randint(1, 3) for _ in ids]
    replies = Ring(tokenizer, parser).run(_ids(tokenizer, prompt), ids, steps)
    reasoning = "".join(r.reasoning for r in replies)
    answer = "".join(r.text for r in replies)
    return reasoning, answer, sum(r.reasoning_tokens for r in replies)


@pytest.mark.parametrize(("parser", "prompt", "text"), OUTPUTS)
def test_text_markers_split_as_marker_tokens_do_in_any_steps(
    tokenizer, thinking, parser, prompt, text
):
    assert reasoning_format(parser, tokenizer).by_text
    expected = _split_by(thinking, parser, prompt, text)[:2]
    for seed in range(4):
        assert _split_by(tokenizer, parser, prompt, text, seed)[:2] == expected


def test_thinking_tokens_are_counted_to_the_one_that_ends_the_block(tokenizer):
    text = "<think>the river</think>\n\nhello world"
    reasoning, answer, counted = _split_by(tokenizer, "qwen3", "<|assistant|>\n", text)
    assert (reasoning, answer) == ("the river", "\n\nhello world")
    # the <think> spelled in pieces counts too, once the marker is whole
    assert counted == len(_ids(tokenizer, "<think>the river</think>"))
    thought = "no end in sight"
    assert _split_by(tokenizer, "deepseek_r1", "<think>\n", thought)[2] == len(
        _ids(tokenizer, thought)
    )


def test_a_stop_string_ends_the_answer_after_a_spelled_end_marker(tokenizer):
    ids = _ids(tokenizer, "<think>the wor</think> hello world again")
    prompt = _ids(tokenizer, "<|assistant|>\n")
    replies = Ring(tokenizer, "qwen3").run(prompt, ids, [2] * len(ids), stop=["world"])
    assert "".join(r.reasoning for r in replies) == "the wor"
    assert "".join(r.text for r in replies) == " hello "
    assert replies[-1].finish_reason == "stop"


def test_the_split_alone_holds_a_possible_marker_until_it_is_settled(tokenizer):
    split = TextSplit(reasoning_format("deepseek_r1", tokenizer), [])
    assert split.feed("the <") == [(True, "the ")]
    assert split.feed("/thi") == []
    assert split.feed("nk>ok") == [(False, "ok")]
    assert split.feed("</think>") == [(False, "</think>")]  # the answer: markers are text
    held = TextSplit(reasoning_format("deepseek_r1", tokenizer), [])
    assert held.feed("a </th") == [(True, "a ")]
    assert held.finish() == [(True, "</th")]  # cut off: thinking, as written


def test_a_grammar_after_text_markers_is_refused_unless_the_prompt_closed_the_block(tokenizer):
    """The scheduler's split: where the answer starts cannot be told by token, so a grammar
    request is refused with a 400 naming the way out, unless there is no thinking at all."""
    for parser, prompt in (
        ("qwen3", "<|assistant|>\n"),  # the model may open a block
        ("qwen3", "<|assistant|>\n<think>\n"),
        ("deepseek_r1", "<|assistant|>\n"),
    ):
        with pytest.raises(MarkersAreText) as refused:
            ReasoningSplit(reasoning_format(parser, tokenizer), _ids(tokenizer, prompt))
        assert isinstance(refused.value, InvalidRequest) and refused.value.http_status == 400
        assert "enable_thinking" in str(refused.value) and "--reasoning-parser none" in str(
            refused.value
        )
    closed = _ids(tokenizer, "<|assistant|>\n<think>\n\n</think>\n\n")
    for parser in ("qwen3", "deepseek_r1"):
        split = ReasoningSplit(reasoning_format(parser, tokenizer), closed)
        assert not split.reasoning and not split.may_open
        assert {split.step(t) for t in _ids(tokenizer, "<think>x</think>")} == {"answer"}


def test_a_stop_string_completed_by_text_held_at_the_end_stops_the_reply(tokenizer):
    """The splitter holds a possible marker's start ("<") until the end; let out then, it
    completes the stop string: the reply ends as a stop, not as its length."""
    ids = _ids(tokenizer, "a <")
    replies = Ring(tokenizer, "deepseek_r1").run([], ids, [1] * len(ids), stop=["<"])
    assert "".join(r.reasoning for r in replies) == "a "
    assert replies[-1].finish_reason == "stop"
