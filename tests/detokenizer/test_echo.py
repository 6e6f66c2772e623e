"""Echo and prompt logprobs in the detokenizer: the uid's first reply carries the decoded prompt
and each prompt token's logprob entry ([0] None); later replies carry neither; nothing is held
for the uid once it ends, however it ends."""

from __future__ import annotations

import time

import msgspec
import pytest

from tokenline import protocol
from tokenline.detokenizer.stage import DetokenizerStage
from tokenline.stage_runtime import StageRuntime

PROMPT = "Say hé 🙂 to the river"


class Ring:
    """The detokenizer under its real runtime, its sent messages decoded as the api would."""

    def __init__(self, tokenizer) -> None:
        self.handler = DetokenizerStage(tokenizer)
        self.sent: list[msgspec.Struct] = []
        codec = protocol.Codec(protocol.ToApi)
        self.runtime = StageRuntime(
            self.handler, lambda m: self.sent.append(codec.decode(codec.encode(m)))
        )

    def deliver(self, *messages: msgspec.Struct) -> list[protocol.Reply]:
        self.sent.clear()
        self.runtime.process([(time.monotonic(), m) for m in messages])
        return [r for m in self.sent if isinstance(m, protocol.ReplyBatch) for r in m.replies]

    def assert_nothing_held(self) -> None:
        assert not self.handler.live, "per-uid state outlived the uid"
        assert not len(self.runtime.ledger), "the ledger still holds the uid"


def _scores(ids: list[int]) -> list[protocol.TokenLogprobs | None]:
    """Made-up prompt logprobs naming each prompt token, with two alternatives."""
    return [None] + [
        protocol.TokenLogprobs(
            token_id=t, logprob=-0.5 * i, top_ids=[t, ids[0]], top_logprobs=[-0.1, -2.0]
        )
        for i, t in enumerate(ids[1:], start=1)
    ]


def _begin(uid: str, ids: list[int], echo: bool) -> protocol.Begin:
    return protocol.Begin(
        uid=uid,
        prompt_tokens=len(ids),
        timeout_s=30,
        prompt_tail=ids[-8:],
        echo_ids=ids if echo else [],
    )


def _tokens(*outputs: protocol.TokenOutput) -> protocol.TokenBatch:
    return protocol.TokenBatch(outputs=list(outputs))


def test_the_first_reply_carries_the_prompt_text_and_its_logprobs(tokenizer):
    ring = Ring(tokenizer)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    out_ids = tokenizer.encode(" and back", add_special_tokens=False).ids
    assert ring.deliver(_begin("u", ids, echo=True)) == []
    scores = _scores(ids)
    first = ring.deliver(
        _tokens(protocol.TokenOutput(uid="u", token_ids=out_ids[:1], prompt_logprobs=scores))
    )
    [reply] = first
    assert reply.prompt_text == PROMPT
    entries = reply.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    for entry, score in zip(entries[1:], scores[1:], strict=True):
        text = tokenizer.decode([score.token_id], skip_special_tokens=True)
        assert entry.token == text and entry.logprob == score.logprob
        assert [t.logprob for t in entry.top] == score.top_logprobs
        assert entry.top[0].token == text
    # the bytes of the entries join into the prompt exactly, split characters included
    assert (
        b"".join(bytes(e.bytes) for e in entries[1:])
        == PROMPT.encode()[len(tokenizer.decode(ids[:1]).encode()) :]
    )
    rest = ring.deliver(
        _tokens(protocol.TokenOutput(uid="u", token_ids=out_ids[1:], finish_reason="length"))
    )
    assert [r.prompt_text for r in rest] == [None] and rest[0].prompt_logprobs is None
    assert reply.text + rest[0].text == " and back"
    ring.assert_nothing_held()


def test_logprobs_without_echo_send_no_prompt_text(tokenizer):
    ring = Ring(tokenizer)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    ring.deliver(_begin("u", ids, echo=False))
    [reply] = ring.deliver(
        _tokens(
            protocol.TokenOutput(
                uid="u", token_ids=[], finish_reason="length", prompt_logprobs=_scores(ids)
            )
        )
    )
    assert reply.prompt_text is None
    assert len(reply.prompt_logprobs) == len(ids)
    assert reply.finish_reason == "length" and reply.num_tokens == 0
    ring.assert_nothing_held()


def test_echo_of_a_prompt_that_is_all_the_reply(tokenizer):
    """max_tokens 0 with echo: the only reply is the first and the terminal one."""
    ring = Ring(tokenizer)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    ring.deliver(_begin("u", ids, echo=True))
    [reply] = ring.deliver(
        _tokens(protocol.TokenOutput(uid="u", token_ids=[], finish_reason="length"))
    )
    assert (reply.prompt_text, reply.text, reply.prompt_logprobs) == (PROMPT, "", None)
    ring.assert_nothing_held()


@pytest.mark.parametrize(
    "end",
    [
        protocol.Abort(uid="u", reason="client_disconnect"),
        protocol.Failed(uid="u", code="internal_error", message="boom", stage="scheduler"),
        protocol.TokenBatch(
            outputs=[protocol.TokenOutput(uid="u", token_ids=[], finish_reason="abort")]
        ),
    ],
    ids=["abort", "failed", "aborted-output"],
)
def test_a_uid_ended_before_its_first_token_leaves_nothing_behind(tokenizer, end):
    ring = Ring(tokenizer)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    ring.deliver(_begin("u", ids, echo=True))
    assert ring.handler.live["u"].echo_ids == ids
    ring.deliver(end)
    ring.assert_nothing_held()


def test_a_stop_string_on_the_first_reply_still_carries_the_prompt(tokenizer):
    ring = Ring(tokenizer)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    begin = msgspec.structs.replace(_begin("u", ids, echo=True), stop=["back"])
    ring.deliver(begin)
    out_ids = tokenizer.encode(" and back again", add_special_tokens=False).ids
    [reply] = ring.deliver(
        _tokens(protocol.TokenOutput(uid="u", token_ids=out_ids, prompt_logprobs=_scores(ids)))
    )
    assert reply.stop_string and reply.finish_reason == "stop"
    assert reply.prompt_text == PROMPT and len(reply.prompt_logprobs) == len(ids)
    # the scheduler's own end for the uid follows; it is settled quietly
    ring.deliver(_tokens(protocol.TokenOutput(uid="u", token_ids=[], finish_reason="abort")))
    ring.assert_nothing_held()


def test_a_prompt_sent_as_ids_is_echoed_with_its_special_tokens(tokenizer):
    """As vLLM decodes it: the prompt the model saw, control and special tokens included."""
    special = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
    ids = [special[0], *tokenizer.encode("hello", add_special_tokens=False).ids, special[-1]]
    ring = Ring(tokenizer)
    ring.deliver(_begin("u", ids, echo=True))
    [reply] = ring.deliver(
        _tokens(protocol.TokenOutput(uid="u", token_ids=ids[1:2], finish_reason="length"))
    )
    assert reply.prompt_text == tokenizer.decode(ids, skip_special_tokens=False)
    assert reply.prompt_text.startswith(tokenizer.id_to_token(special[0]))
    ring.assert_nothing_held()


def test_the_stop_token_that_ends_a_reply_is_not_its_text(tokenizer):
    """As vLLM: a plain token named in stop_token_ids ends the reply and is not shown; the
    same token ending it otherwise (a grammar's last token, say) is text."""
    ids = tokenizer.encode("Hi there.", add_special_tokens=False).ids
    for stop_ids, text in (([ids[-1]], tokenizer.decode(ids[:-1])), ([], "Hi there.")):
        ring = Ring(tokenizer)
        begin = msgspec.structs.replace(_begin("u", ids[:2], echo=False), stop_token_ids=stop_ids)
        ring.deliver(begin)
        replies = ring.deliver(
            _tokens(protocol.TokenOutput(uid="u", token_ids=ids, finish_reason="stop"))
        )
        assert "".join(r.text for r in replies) == text
        assert replies[-1].num_tokens == len(ids)
        ring.assert_nothing_held()


def test_a_prompts_special_tokens_keep_their_text_in_its_logprobs(tokenizer):
    """The prompt's tokens read as the prompt the model saw: joined, they are the echoed text
    (a text prompt comes back as sent, its special tokens' text included)."""
    special = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
    ids = [
        *tokenizer.encode("the river", add_special_tokens=False).ids,
        special[-1],
        *tokenizer.encode(" and the road", add_special_tokens=False).ids,
    ]
    ring = Ring(tokenizer)
    ring.deliver(_begin("u", ids, echo=True))
    [reply] = ring.deliver(
        _tokens(
            protocol.TokenOutput(
                uid="u", token_ids=ids[:1], prompt_logprobs=_scores(ids), finish_reason="length"
            )
        )
    )
    tokens = [tokenizer.decode(ids[:1])] + [e.token for e in reply.prompt_logprobs[1:]]
    assert "".join(tokens) == reply.prompt_text == tokenizer.decode(ids, skip_special_tokens=False)
    assert tokenizer.id_to_token(special[-1]) in tokens
    ring.assert_nothing_held()
