"""OpenAI logprobs through the real four-process stack, read by the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI


@pytest.fixture
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=60)


CHAT = [{"role": "user", "content": "Tell me about the river and the mountain."}]
MAX_TOKENS = 12


def _chat(client, stack, **kw):
    return client.chat.completions.create(
        model=stack.model,
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        **kw,
    )


def _joined_bytes(entries) -> str:
    return b"".join(bytes(e.bytes) for e in entries).decode("utf-8")


def test_chat_logprobs_one_entry_per_token_greedy_is_top_one(client, stack):
    reply = _chat(client, stack)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens > 0
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        # greedy: the chosen token is the most likely alternative
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes is not None
    # the tokens spell the message: byte for byte, and as text where no token splits a char
    assert _joined_bytes(content) == choice.message.content
    if not any("\ufffd" in e.token for e in content):
        assert "".join(e.token for e in content) == choice.message.content


def test_chat_streaming_logprobs_match_non_streaming(client, stack):
    full = _chat(client, stack).choices[0]
    chunks = list(_chat(client, stack, stream=True, stream_options={"include_usage": True}))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.bytes) for e in streamed] == [
        (e.token, e.bytes) for e in full.logprobs.content
    ]
    for got, want in zip(streamed, full.logprobs.content, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
    assert len(streamed) == chunks[-1].usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.message.content


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_lists_line_up_with_the_tokens(client, stack, stream):
    kw = dict(model=stack.model, prompt="hello world", max_tokens=MAX_TOKENS, temperature=0)
    if stream:
        chunks = list(
            client.completions.create(
                **kw, logprobs=2, stream=True, stream_options={"include_usage": True}
            )
        )
        usage = chunks[-1].usage
        parts = [c.choices[0].logprobs for c in chunks if c.choices]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for p in parts for t in p.tokens]
        token_logprobs = [t for p in parts for t in p.token_logprobs]
        top_logprobs = [t for p in parts for t in p.top_logprobs]
        text_offset = [t for p in parts for t in p.text_offset]
    else:
        reply = client.completions.create(**kw, logprobs=2)
        usage, text, lp = reply.usage, reply.choices[0].text, reply.choices[0].logprobs
        tokens, token_logprobs = lp.tokens, lp.token_logprobs
        top_logprobs, text_offset = lp.top_logprobs, lp.text_offset
    n = usage.completion_tokens
    assert n > 0
    assert len(tokens) == len(token_logprobs) == len(top_logprobs) == len(text_offset) == n
    assert all(v <= 0 for v in token_logprobs)
    for token, value, top in zip(tokens, token_logprobs, top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and all(v <= 0 for v in top.values())
        # two alternatives, unless two tokens render alike (part of a character, a special)
        assert len(top) == 2 or any("\ufffd" in t or not t for t in top)
        assert max(top.values()) <= value + 1e-6  # greedy: nothing beats the chosen token
        if "\ufffd" not in token and token:
            assert top[token] == pytest.approx(value)
    # each token starts where the previous one's text ends
    lengths = [len(t) for t in tokens]
    assert text_offset == [sum(lengths[:i]) for i in range(n)]
    if not any("\ufffd" in t for t in tokens):
        assert "".join(tokens) == text


def test_top_logprobs_without_logprobs_is_400(client, stack):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=stack.model, messages=CHAT, max_tokens=2, top_logprobs=2
        )
    assert err.value.body["param"] == "top_logprobs"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            "chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": -1},
            "top_logprobs",
        ),
        ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ],
)
def test_out_of_range_logprobs_are_400_with_the_param_named(stack, path, body, param):
    response = httpx.post(
        f"{stack.api_url}/v1/{path}", json={"model": stack.model, "max_tokens": 2, **body}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_requests_without_logprobs_still_answer_null(client, stack):
    for stream in (False, True):
        kw = dict(model=stack.model, max_tokens=3, temperature=0, stream=stream)
        chat = client.chat.completions.create(messages=CHAT, **kw)
        text = client.completions.create(prompt="hello world", **kw)
        if stream:
            chunks = [c for c in [*chat, *text] if c.choices]
            assert chunks and all(c.choices[0].logprobs is None for c in chunks)
        else:
            assert chat.choices[0].logprobs is None and text.choices[0].logprobs is None
    raw = httpx.post(
        f"{stack.api_url}/v1/chat/completions",
        json={"model": stack.model, "messages": CHAT, "max_tokens": 2},
    ).json()
    assert "logprobs" in raw["choices"][0] and raw["choices"][0]["logprobs"] is None


def test_logprobs_false_is_like_not_asking(client, stack):
    reply = client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=2, logprobs=False
    )
    assert reply.choices[0].logprobs is None


def test_stop_string_keeps_logprobs_through_the_matching_token(client, stack):
    full = _chat(client, stack).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop and full.find(stop) > 0
    reply = _chat(client, stack, stop=[stop])
    content = reply.choices[0].message.content
    assert content == full[: full.find(stop)]
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    spelled = _joined_bytes(entries)
    # every token up to and including the one that completed the stop string, no further
    assert spelled.startswith(content + stop)
    assert not _joined_bytes(entries[:-1]).startswith(content + stop)


def test_coalesced_replies_keep_every_token_logprob():
    from tokenline.api.ring.exchange import coalesce as _coalesce
    from tokenline.protocol import LogprobEntry, Reply

    def entry(token: str) -> LogprobEntry:
        return LogprobEntry(token=token, logprob=-1.0, bytes=list(token.encode()))

    batch = [
        (0, Reply(uid="u", text="a", num_tokens=1, logprobs=[entry("a")])),
        (0, Reply(uid="u", text="", num_tokens=1, logprobs=[entry("\ufffd")])),
        (0, Reply(uid="u", text="bc", num_tokens=1, logprobs=[entry("c")], finish_reason="stop")),
        (1, Reply(uid="v", text="x", num_tokens=1)),
        (1, Reply(uid="v", text="y", num_tokens=1)),
    ]
    merged = _coalesce(batch)
    assert [(i, r.text, r.num_tokens, r.finish_reason) for i, r in merged] == [
        (0, "abc", 3, "stop"),
        (1, "xy", 2, None),
    ]
    assert [e.token for e in merged[0][1].logprobs] == ["a", "\ufffd", "c"]
    assert merged[1][1].logprobs is None


# ── the chosen token among the alternatives ────────────────────────────────────────────────────
def _sampled(client, stack, **kw):
    """Sampled at a high temperature, so the chosen token is often not the likeliest."""
    return client.completions.create(
        model=stack.model, prompt="hello world", max_tokens=MAX_TOKENS, temperature=2.0, **kw
    )


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_0_names_the_chosen_token(client, stack, stream):
    """OpenAI and vLLM list the sampled token in ``top_logprobs`` whatever ``logprobs`` is,
    so 0 gives one entry per token: the chosen one, with its own logprob."""
    if stream:
        chunks = [c for c in _sampled(client, stack, logprobs=0, seed=5, stream=True) if c.choices]
        parts = [c.choices[0].logprobs for c in chunks]
        tokens = [t for p in parts for t in p.tokens]
        values = [v for p in parts for v in p.token_logprobs]
        tops = [t for p in parts for t in p.top_logprobs]
    else:
        lp = _sampled(client, stack, logprobs=0, seed=5).choices[0].logprobs
        tokens, values, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    assert len(tops) == len(tokens) == MAX_TOKENS
    for token, value, top in zip(tokens, values, tops, strict=True):
        assert top == {token: pytest.approx(value)}


def test_completions_alternatives_hold_the_chosen_token_even_when_unlikely(client, stack):
    seen_outside_top = False
    for seed in range(4):
        lp = _sampled(client, stack, logprobs=1, seed=seed).choices[0].logprobs
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert token in top and 1 <= len(top) <= 2  # the likeliest, and the chosen one
            if "\ufffd" not in token and token:  # else two tokens may render alike
                assert top[token] == pytest.approx(value)
            seen_outside_top |= len(top) == 2
    assert seen_outside_top, "at temperature 2 some token should not be the likeliest"


def test_echoed_prompt_logprobs_0_name_each_prompt_token(client, stack):
    reply = client.completions.create(
        model=stack.model, prompt="the river and the mountain", max_tokens=0, echo=True, logprobs=0
    )
    lp = reply.choices[0].logprobs
    assert lp.top_logprobs[0] is None  # the first prompt token has nothing before it
    rest = zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True)
    for token, value, top in rest:
        assert top == {token: pytest.approx(value)}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_0_gives_empty_alternatives_as_openai_does(client, stack, stream):
    """Chat's shape lists alternatives apart from the chosen token, which has its own
    fields: OpenAI answers ``top_logprobs: 0`` (or none) with ``[]`` for each token."""
    for top_logprobs in (0, None):
        kw = {} if top_logprobs is None else {"top_logprobs": top_logprobs}
        reply = client.chat.completions.create(
            model=stack.model,
            messages=CHAT,
            max_tokens=4,
            logprobs=True,
            stream=stream,
            extra_body={"ignore_eos": True},  # four tokens, whatever the model prefers
            **kw,
        )
        if stream:
            entries = [
                e
                for c in reply
                if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content
            ]
        else:
            entries = reply.choices[0].logprobs.content
        assert len(entries) == 4
        # (a sampled special token, EOS among them with ignore_eos, has empty text: not checked)
        assert all(e.top_logprobs == [] and e.logprob <= 0 for e in entries)


def test_the_prompt_logprobs_of_n_choices_are_computed_once_and_shared():
    from tokenline.api.openai.completions import CompletionRequest

    body = CompletionRequest(model="m", prompt=["a", "b"], n=3, echo=True, logprobs=2)
    asked = [body.sampling(i).prompt_logprobs for i in range(body.choices)]
    assert asked == [2, None, None, 2, None, None]  # the first choice of each prompt asks
    assert all(body.sampling(i).echo for i in range(body.choices))


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_of_an_echoed_prompt_shows_its_logprobs(client, stack, stream):
    prompts = ["the river and the mountain", "a quiet morning"]
    kw = dict(model=stack.model, prompt=prompts, echo=True, logprobs=1, max_tokens=3, seed=5)
    alone = [client.completions.create(**{**kw, "prompt": p}).choices[0].logprobs for p in prompts]
    if stream:
        tokens: dict[int, list[str]] = {}
        values: dict[int, list] = {}
        for chunk in client.completions.create(**kw, n=3, stream=True):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
                    values.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
    else:
        choices = client.completions.create(**kw, n=3).choices
        tokens = {c.index: c.logprobs.tokens for c in choices}
        values = {c.index: c.logprobs.token_logprobs for c in choices}
    assert sorted(tokens) == list(range(6))
    for index in range(6):
        reference = alone[index // 3]
        size = len(reference.tokens) - 3  # the prompt's part, borrowed by choices 1 and 2
        assert tokens[index][:size] == reference.tokens[:size], index
        assert values[index][:size] == pytest.approx(reference.token_logprobs[:size]), index
