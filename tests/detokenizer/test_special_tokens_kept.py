"""A request that keeps special tokens (``SamplingParams.skip_special_tokens`` False: a tool
format whose marker, Mistral's ``[TOOL_CALLS]``, is a special token) sees them as text, in its
text and its logprobs; the model's control tokens and the token that stopped it never are;
every other request decodes as before."""

from __future__ import annotations

import copy

import pytest
from tokenizers import AddedToken, Tokenizer

from tokenline import protocol
from tokenline.detokenizer.incremental import IncrementalDecoder
from tokenline.detokenizer.stage import DetokenizerStage

MARKER = "[TOOL_CALLS]"


@pytest.fixture(scope="module")
def marked(tokenizer: Tokenizer) -> tuple[Tokenizer, int, int]:
    """The tiny tokenizer with the marker as a special added token; the marker's id and EOS."""
    grown = copy.deepcopy(tokenizer)
    grown.add_special_tokens([AddedToken(MARKER, special=True, normalized=False)])
    return grown, grown.token_to_id(MARKER), grown.token_to_id("<|end|>")


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_the_decoder_keeps_special_tokens_but_the_hidden_ones(marked):
    tokenizer, marker, eos = marked
    ids = [*_ids(tokenizer, "Sure. "), marker, *_ids(tokenizer, '[{"a": 1}]'), eos]
    kept = IncrementalDecoder(tokenizer, skip_special_tokens=False, hidden={eos})
    assert kept.feed(ids) + kept.flush() == 'Sure. [TOOL_CALLS][{"a": 1}]'
    skipped = IncrementalDecoder(tokenizer, hidden={eos})
    assert skipped.feed(ids) + skipped.flush() == 'Sure. [{"a": 1}]'


def _run(stage: DetokenizerStage, begin: protocol.Begin, outputs: list[protocol.TokenOutput]):
    stage.handle(begin, 0.0)
    replies = []
    for output in outputs:
        for message in stage.handle(protocol.TokenBatch(outputs=[output]), 0.0):
            replies += message.replies
    return replies


@pytest.mark.parametrize("skip", [True, False])
def test_the_stage_decodes_as_the_request_asks(marked, skip):
    tokenizer, marker, eos = marked
    stop_token = _ids(tokenizer, "<|user|>")  # a special token a request stops on
    assert len(stop_token) == 1
    stage = DetokenizerStage(tokenizer, control_ids={eos})
    body = _ids(tokenizer, '[{"a": 1}]')
    begin = protocol.Begin(uid="u", prompt_tokens=3, prompt_tail=[1, 2], skip_special_tokens=skip)
    lp = protocol.TokenLogprobs(token_id=marker, logprob=-0.1, top_ids=[eos], top_logprobs=[-3])
    replies = _run(
        stage,
        begin,
        [
            protocol.TokenOutput(uid="u", token_ids=[marker], logprobs=[lp]),
            protocol.TokenOutput(uid="u", token_ids=[*body, eos]),
        ],
    )
    text = "".join(r.text for r in replies)
    assert text == ("" if skip else MARKER) + '[{"a": 1}]'
    assert replies[0].logprobs[0].token == ("" if skip else MARKER)
    assert replies[0].logprobs[0].top[0].token == ""  # EOS is never text
    # a stop token that is special, at the end of a "stop": never text either
    begin = protocol.Begin(uid="v", prompt_tokens=3, prompt_tail=[1, 2], skip_special_tokens=skip)
    last = protocol.TokenOutput(uid="v", token_ids=[*body, *stop_token], finish_reason="stop")
    (reply,) = _run(stage, begin, [last])
    assert reply.text == '[{"a": 1}]' and reply.num_tokens == len(body) + 1


def test_a_plain_begin_skips_special_tokens(marked):
    tokenizer, marker, eos = marked
    stage = DetokenizerStage(tokenizer, control_ids={eos})
    begin = protocol.Begin(uid="u", prompt_tokens=3, prompt_tail=[1, 2])
    out = protocol.TokenOutput(uid="u", token_ids=[marker, *_ids(tokenizer, "hi")])
    (reply,) = _run(stage, begin, [out])
    assert reply.text == "hi"
