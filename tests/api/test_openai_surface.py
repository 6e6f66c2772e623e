"""The OpenAI surface the api serves, through the official openai client against the running
stack: every request field either does what it says or is refused by name.

Raw httpx only where the client cannot say it (HEAD, a wrong method, a body that is not JSON,
a CORS preflight, the exact bytes of a stream); CORS with an allowed origin runs in-process
(api_testkit), since the shared stack serves the defaults. The tiny model writes random text,
so these assert shapes and consistency: greedy (temperature 0) replies are compared with
greedy replies, never with expected words.
"""

from __future__ import annotations

import inspect
import json

import httpx
import jsonschema
import openai
import pytest
from api_testkit import app_with, client_for
from openai import OpenAI

MAX_TOKENS = 4
CHAT = [{"role": "user", "content": "Tell me about the river."}]
PROMPT = "The old river road"


@pytest.fixture
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def http(stack):
    with httpx.Client(base_url=stack.api_url, timeout=60) as session:
        yield session


def _greedy(client, stack, prompt=PROMPT, max_tokens=MAX_TOKENS, **kw):
    return client.completions.create(
        model=stack.model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, **kw.pop("extra_body", {})},
        **kw,
    )


def _greedy_chat(client, stack, messages=CHAT, max_tokens=MAX_TOKENS, **kw):
    return client.chat.completions.create(
        model=stack.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, **kw.pop("extra_body", {})},
        **kw,
    )


def _refusal(caught) -> dict:
    """The error body of a refused request, in OpenAI's shape."""
    body = caught.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    return body


def _ids_spelled(tokenizer, text: str) -> list[int]:
    """Every token id whose text is ``text`` (the vocabulary is small)."""
    return [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == text]


def _plain_token(tokenizer, avoid: str) -> int:
    """A token whose text is a plain word, unlike ``avoid``, spelled by no other token."""
    for i in range(len(tokenizer) - 1, 0, -1):
        text = tokenizer.decode([i])
        if text.strip().isalpha() and len(text) >= 3 and text != avoid:
            if _ids_spelled(tokenizer, text) == [i]:
                return i
    raise LookupError("no plain token in the vocabulary")


# ── models and routes ──────────────────────────────────────────────────────────────────────────
def test_models_retrieve_gives_the_card_and_an_unknown_id_is_404(client, stack):
    card = client.models.retrieve(stack.model)
    assert (card.id, card.object, card.owned_by) == (stack.model, "model", "tokenline")
    assert card.created == client.models.list().data[0].created > 0
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("nope")
    assert _refusal(caught)["code"] == "model_not_found"


GET_ROUTES = ["/health", "/ready", "/metrics", "/v1/models", "/v1/models/tiny", "/v1/models/nope"]


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_on_every_get_route_answers_like_get_without_a_body(http, path):
    got, head = http.get(path), http.head(path)
    assert head.status_code == got.status_code == (404 if path.endswith("nope") else 200)
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]


def test_unknown_routes_wrong_methods_and_non_json_bodies_answer_in_openai_shape(http, stack):
    def error(response, status: int) -> dict:
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"}
        return body

    assert error(http.get("/v1/nope"), 404)["code"] == "not_found"
    assert error(http.post("/v1/audio/speech", json={}), 404)["code"] == "not_found"
    assert error(http.post("/v1/models", json={}), 405)["code"] == "method_not_allowed"
    assert error(http.get("/v1/chat/completions"), 405)["code"] == "method_not_allowed"
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        raw = json.dumps({"model": stack.model, "prompt": "x", "max_tokens": 1})
        response = http.post("/v1/completions", content=raw, headers={"content-type": content_type})
        assert error(response, 415)["code"] == "unsupported_media_type"
        assert content_type in response.json()["error"]["message"]


def test_the_allow_header_of_a_405_lists_every_method_served(http):
    for path in ("/v1/models", "/health"):
        allowed = {m.strip() for m in http.post(path, json={}).headers["allow"].split(",")}
        assert {"GET", "HEAD"} <= allowed, (path, allowed)


# ── CORS ──────────────────────────────────────────────────────────────────────────────────────
ORIGIN = "https://app.example.com"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type",
}


def test_cors_is_off_by_default(http):
    preflight = http.options("/v1/chat/completions", headers={"Origin": ORIGIN, **PREFLIGHT})
    assert preflight.status_code == 405
    plain = http.get("/v1/models", headers={"Origin": ORIGIN})
    for response in (preflight, plain):
        assert not [h for h in response.headers if h.startswith("access-control-")]


def test_cors_answers_an_allowed_origin_and_no_other():
    app, _ = app_with(allowed_origins=[ORIGIN], api_keys=["sk-cors-key"])
    web = client_for(app)
    preflight = web.options("/v1/chat/completions", headers={"Origin": ORIGIN, **PREFLIGHT})
    assert preflight.status_code == 200  # before the key check: a preflight carries none
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    # an error answer carries the header too, or the page cannot read it
    refused = web.get("/v1/models", headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN
    served = web.get(
        "/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer sk-cors-key"}
    )
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == ORIGIN
    other = "https://evil.example.com"
    for response in (
        web.options("/v1/chat/completions", headers={"Origin": other, **PREFLIGHT}),
        web.get("/v1/models", headers={"Origin": other, "Authorization": "Bearer sk-cors-key"}),
    ):
        assert "access-control-allow-origin" not in response.headers


# ── completions: prompts ───────────────────────────────────────────────────────────────────────
def test_token_id_prompts_complete_as_their_text(client, stack, tiny_tokenizer):
    texts = [PROMPT, "a mountain"]
    ids = [tiny_tokenizer(t)["input_ids"] for t in texts]
    as_text = _greedy(client, stack, prompt=texts[0])
    as_ids = _greedy(client, stack, prompt=ids[0])
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage.prompt_tokens == len(ids[0]) == as_text.usage.prompt_tokens
    both_ids = _greedy(client, stack, prompt=ids)
    both_texts = _greedy(client, stack, prompt=texts)
    assert [c.text for c in both_ids.choices] == [c.text for c in both_texts.choices]
    assert both_ids.usage.prompt_tokens == sum(map(len, ids))
    # ids need not spell valid text: [72, 105] is two ids, whatever they decode to
    raw = _greedy(client, stack, prompt=[72, 105])
    assert raw.usage.prompt_tokens == 2 and raw.usage.completion_tokens == MAX_TOKENS
    # a forced token: the completion is exactly its text, the echo the prompt's in front
    token = _plain_token(tiny_tokenizer, "")
    forced = {"max_tokens": 2, "logit_bias": {str(token): 100}}
    twice = tiny_tokenizer.decode([token, token])
    assert _greedy(client, stack, prompt=ids[0], **forced).choices[0].text == twice
    echoed = _greedy(client, stack, prompt=ids[0], echo=True, **forced).choices[0].text
    assert echoed == texts[0] + twice


@pytest.mark.parametrize("ids", [[72, 105], [105]])
def test_a_token_id_prompt_ending_mid_character_leaks_no_prompt_text(
    client, stack, tiny_tokenizer, ids
):
    token = _plain_token(tiny_tokenizer, "")  # forced, so the completion's ids are known
    forced = {"max_tokens": 2, "temperature": 0, "logit_bias": {str(token): 100}}
    reply = client.completions.create(model=stack.model, prompt=ids, **forced)
    assert reply.choices[0].text == tiny_tokenizer.decode([token, token])
    echoed = client.completions.create(model=stack.model, prompt=ids, echo=True, **forced)
    want = tiny_tokenizer.decode(ids) + tiny_tokenizer.decode([token, token])
    assert echoed.choices[0].text == want


def test_a_list_of_prompts_gives_n_choices_each_in_prompt_order(client, stack, tiny_tokenizer):
    prompts = [PROMPT, "a b c d"]
    alone = [_greedy(client, stack, prompt=p).choices[0].text for p in prompts]
    reply = _greedy(client, stack, prompt=prompts, n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert all(c.finish_reason == "length" for c in reply.choices)
    usage = reply.usage
    assert usage.prompt_tokens == sum(len(tiny_tokenizer(p)["input_ids"]) for p in prompts)
    assert usage.completion_tokens == 4 * MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    chunks = list(
        _greedy(
            client, stack, prompt=prompts, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in reply.choices}
    final = chunks[-1].usage  # cached_tokens may differ: the first run filled the cache
    assert (final.prompt_tokens, final.completion_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )


def test_prompts_times_n_is_bounded_by_max_n(client, stack):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=stack.model, prompt=["a"] * 9, n=2, max_tokens=1)
    error = _refusal(caught)
    assert error["param"] == "prompt" and "--max-n" in error["message"]


def test_an_empty_prompt_list_is_refused(client, stack):
    for prompt in ([], [[]], [[1], []]):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=stack.model, prompt=prompt, max_tokens=1)
        assert _refusal(caught)["param"] == "prompt"


# ── completions: echo, logprobs, max_tokens 0 ─────────────────────────────────────────────────
def test_echo_puts_the_prompt_in_front(client, stack):
    plain = _greedy(client, stack).choices[0].text
    echoed = _greedy(client, stack, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    streamed = list(_greedy(client, stack, echo=True, stream=True))
    assert streamed[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + plain


def test_echo_gives_a_text_prompt_back_as_it_was_sent(client, stack, tiny_tokenizer):
    """Special tokens' text in a prompt is part of what was sent (decoding the prompt's ids
    without special tokens would drop it); token ids come back decoded."""
    prompt = f"the river{tiny_tokenizer.eos_token} and the road"
    plain = _greedy(client, stack, prompt=prompt).choices[0].text
    assert _greedy(client, stack, prompt=prompt, echo=True).choices[0].text == prompt + plain
    streamed = _greedy(client, stack, prompt=prompt, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == prompt + plain
    ids = tiny_tokenizer("the river road", add_special_tokens=False)["input_ids"]
    by_ids = _greedy(client, stack, prompt=ids, echo=True, max_tokens=1).choices[0].text
    assert by_ids.startswith("the river road")
    # with logprobs, the prompt's tokens are its own, the special token's text included
    scored = _greedy(client, stack, prompt=prompt, echo=True, logprobs=1).choices[0]
    tokens = scored.logprobs.tokens
    assert "".join(tokens) == scored.text and tiny_tokenizer.eos_token in tokens
    first = tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"][0]
    assert tokens[0] == tiny_tokenizer.decode([first])
    lengths = [len(t) for t in tokens]
    assert scored.logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]


def test_echo_gives_each_choice_its_own_prompt_and_stop_strings_skip_it(client, stack):
    prompts = ["ab", "river"]
    reply = _greedy(client, stack, prompt=prompts, n=2, echo=True, logprobs=1, max_tokens=2)
    for choice in reply.choices:
        prompt = prompts[choice.index // 2]
        assert choice.text.startswith(prompt)
        assert choice.logprobs.token_logprobs[0] is None
        assert "".join(choice.logprobs.tokens) == choice.text
    # a stop string is looked for in what is generated, never in the echoed prompt
    plain = _greedy(client, stack, max_tokens=6).choices[0].text
    stop = next(w for w in PROMPT.split() if w not in plain)
    stopped = _greedy(client, stack, max_tokens=6, echo=True, stop=[stop])
    assert stopped.choices[0].text == PROMPT + plain
    assert stopped.choices[0].finish_reason == "length"


def test_echo_with_logprobs_scores_the_prompt_first(client, stack, tiny_tokenizer):
    plain = _greedy(client, stack, logprobs=1).choices[0]
    reply = _greedy(client, stack, echo=True, logprobs=1)
    choice, usage = reply.choices[0], reply.usage
    lp = choice.logprobs
    prompt_tokens = len(tiny_tokenizer(PROMPT)["input_ids"])
    assert usage.prompt_tokens == prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == prompt_tokens + usage.completion_tokens
    # the first prompt token has nothing before it to be scored against
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text and choice.text.startswith(PROMPT)
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    # the generated part is what the same request without echo reports
    assert lp.tokens[prompt_tokens:] == plain.logprobs.tokens
    assert lp.token_logprobs[prompt_tokens:] == pytest.approx(plain.logprobs.token_logprobs)


def test_max_tokens_0_with_echo_and_logprobs_scores_the_prompt_only(client, stack):
    full = _greedy(client, stack, echo=True, logprobs=2).choices[0].logprobs
    reply = client.completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == reply.usage.prompt_tokens
    assert choice.logprobs.tokens == full.tokens[: reply.usage.prompt_tokens]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        full.token_logprobs[1 : reply.usage.prompt_tokens]
    )
    nothing = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=0)
    assert (nothing.choices[0].text, nothing.usage.completion_tokens) == ("", 0)


# ── logit_bias and stop_token_ids ─────────────────────────────────────────────────────────────
def test_logit_bias_moves_a_greedy_choice(client, stack, tiny_tokenizer):
    first = _greedy(client, stack, max_tokens=1).choices[0].text
    banned = _ids_spelled(tiny_tokenizer, first)
    assert banned, f"no token spells the greedy choice {first!r}"
    avoided = _greedy(client, stack, max_tokens=1, logit_bias={str(i): -100 for i in banned})
    assert avoided.choices[0].text != first
    chosen = _plain_token(tiny_tokenizer, first)
    forced = _greedy(client, stack, max_tokens=1, logit_bias={str(chosen): 100})
    assert forced.choices[0].text == tiny_tokenizer.decode([chosen])
    chat = _greedy_chat(client, stack, max_tokens=1, logit_bias={str(chosen): 100})
    assert chat.choices[0].message.content == tiny_tokenizer.decode([chosen])


@pytest.mark.parametrize(
    "bias",
    [{"5": 101}, {"5": -100.5}, {"x": 1}, {"-1": 1}, {str(i): 1 for i in range(301)}],
    ids=["over-100", "under-minus-100", "not-an-id", "negative-id", "301-keys"],
)
def test_a_bad_logit_bias_is_refused_naming_it(client, stack, bias):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=stack.model, prompt="x", max_tokens=1, logit_bias=bias)
    assert _refusal(caught)["param"].split(".")[0] == "logit_bias"


@pytest.mark.parametrize(
    "bias",
    [{"10": "a"}, {"10": None}, {"10": [1]}, [1, 2], "ab", 5],
    ids=["text-bias", "null-bias", "list-bias", "a-list", "a-string", "a-number"],
)
def test_a_logit_bias_of_the_wrong_type_is_a_400_not_a_500(http, stack, bias):
    body = {"model": stack.model, "prompt": "x", "max_tokens": 1, "logit_bias": bias}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == "logit_bias"


def test_a_logit_bias_outside_the_vocabulary_is_refused_by_the_scheduler(client, stack):
    for create in (
        lambda: client.completions.create(
            model=stack.model, prompt="x", max_tokens=1, logit_bias={"100000000": 1}
        ),
        lambda: client.chat.completions.create(
            model=stack.model, messages=CHAT, max_tokens=1, logit_bias={"100000000": 1}
        ),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            create()
        error = _refusal(caught)
        assert error["param"] == "logit_bias" and "100000000" in error["message"]
    assert _greedy(client, stack, max_tokens=1, logit_bias={"300": 100}).usage  # still serving


@pytest.mark.parametrize("chat", [False, True])
def test_a_stop_token_id_ends_the_choice_that_draws_it(client, stack, tiny_tokenizer, chat):
    token = _plain_token(tiny_tokenizer, "")
    body = {"logit_bias": {str(token): 100}, "extra_body": {"stop_token_ids": [token]}}
    if chat:
        reply = client.chat.completions.create(
            model=stack.model, messages=CHAT, max_tokens=5, temperature=0, **body
        )
    else:
        reply = client.completions.create(
            model=stack.model, prompt=PROMPT, max_tokens=5, temperature=0, **body
        )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 1
    # the token that stopped it is not text (vLLM's rule), though it is a plain one
    assert not (reply.choices[0].message.content if chat else reply.choices[0].text)


# ── streaming usage ───────────────────────────────────────────────────────────────────────────
def _sse(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_usage_sends_null_usage_then_a_last_chunk_with_it(client, http, stack, path):
    body = {"model": stack.model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    body |= {"prompt": PROMPT} if "chat" not in path else {"messages": CHAT}
    plain = _sse(http, path, body)
    assert all("usage" not in c for c in plain), "usage was not asked for"
    chunks = _sse(http, path, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None and c["choices"] for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == MAX_TOKENS
    usage = last["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
    # the official client reads the same
    kw = {k: v for k, v in body.items() if k not in ("ignore_eos", "stream")}
    create = client.chat.completions.create if "chat" in path else client.completions.create
    read = list(
        create(
            **kw,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.usage is None for c in read[:-1])
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(read[-1].usage, k) for k in counts] == [usage[k] for k in counts]


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, stack, chat):
    # The engine may deliver several tokens in one chunk, so "so far" is checked against the
    # tokens each chunk carries (one logprob entry a token), not against a chunk count.
    options = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if chat:
        stream = _greedy_chat(
            client, stack, max_tokens=6, stream=True, logprobs=True, extra_body=options
        )
    else:
        stream = _greedy(client, stack, max_tokens=6, stream=True, logprobs=1, extra_body=options)
    chunks = list(stream)
    assert chunks[-1].choices == []
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    assert len({u.prompt_tokens for u in usages}) == 1
    delivered, so_far = 0, []
    for chunk in chunks[:-1]:
        logprobs = chunk.choices[0].logprobs if chunk.choices else None
        if logprobs is not None:
            delivered += len(logprobs.content if chat else logprobs.tokens)
        so_far.append(delivered)
    assert [u.completion_tokens for u in usages[:-1]] == so_far
    assert usages[-1].completion_tokens == delivered == 6
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)


def test_stream_options_need_a_stream_and_continuous_usage_needs_include_usage(client, stack):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=stack.model, prompt="x", max_tokens=1, stream_options={"include_usage": True}
        )
    assert _refusal(caught)["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=stack.model,
            messages=CHAT,
            max_tokens=1,
            stream=True,
            extra_body={"stream_options": {"continuous_usage_stats": True}},
        )
    assert _refusal(caught)["param"] == "stream_options"


# ── best_of, suffix ────────────────────────────────────────────────────────────────────────────
def test_best_of_must_equal_n(client, stack):
    reply = client.completions.create(
        model=stack.model, prompt="x", max_tokens=2, n=2, best_of=2, seed=3
    )
    assert [c.index for c in reply.choices] == [0, 1]
    for best_of, n in ((3, 1), (1, 2)):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(
                model=stack.model, prompt="x", max_tokens=1, n=n, best_of=best_of
            )
        error = _refusal(caught)
        assert error["param"] == "best_of" and "n" in error["message"]


def test_suffix_is_refused_unless_empty(client, stack):
    assert (
        _greedy(client, stack, suffix="").choices[0].text == _greedy(client, stack).choices[0].text
    )
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=stack.model, prompt="x", max_tokens=1, suffix="tail")
    error = _refusal(caught)
    assert error["param"] == "suffix" and "fill-in-the-middle" in error["message"]


# ── unknown fields, and fields that ask for nothing ───────────────────────────────────────────
UNKNOWN = [
    ("completions", {"frobnicate": 1}, "frobnicate"),
    ("chat", {"frobnicate": 1}, "frobnicate"),
    ("chat", {"stream": True, "stream_options": {"frobnicate": 1}}, "stream_options.frobnicate"),
    ("chat", {"messages": [{**CHAT[0], "frobnicate": 1}]}, "messages.0.frobnicate"),
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "f", "frobnicate": 1}}]},
        "tools.0.function.frobnicate",
    ),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "frobnicate": 1}}},
        "response_format.json_schema.frobnicate",
    ),
    (
        "chat",
        {
            "messages": [
                *CHAT,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                            "frobnicate": 1,
                        }
                    ],
                },
            ]
        },
        "messages.1.tool_calls.0.frobnicate",
    ),
]


@pytest.mark.parametrize(("endpoint", "extra", "param"), UNKNOWN, ids=[p for _, _, p in UNKNOWN])
def test_unknown_fields_are_refused_by_name_at_any_depth(client, stack, endpoint, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            client.chat.completions.create(
                model=stack.model, messages=CHAT, max_tokens=1, extra_body=extra
            )
        else:
            client.completions.create(model=stack.model, prompt="x", max_tokens=1, extra_body=extra)
    error = _refusal(caught)
    assert (error["code"], error["param"]) == ("unsupported_parameter", param), error
    assert param.rsplit(".", 1)[-1] in error["message"]


def test_an_unknown_field_in_a_named_tool_choice_is_named_by_its_path(client, stack):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=stack.model,
            messages=CHAT,
            max_tokens=1,
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "f"}},
            extra_body={
                "tool_choice": {"type": "function", "function": {"name": "f", "frobnicate": 1}}
            },
        )
    assert _refusal(caught)["param"] == "tool_choice.function.frobnicate"


def test_an_unknown_field_in_a_text_part_is_refused(client, stack):
    part = {"type": "text", "text": "hi", "frobnicate": 1}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": [part]}], max_tokens=1
        )
    assert _refusal(caught)["param"] == "messages.0.content.0.frobnicate"


def test_tokenize_refuses_unknown_fields(http):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        response = http.post(path, json={**body, "frobnicate": 1})
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == "frobnicate"


# Fields the official client's chat.completions.create takes that this server does not serve:
# each must be refused by name, never dropped (a value of the right shape for each).
CLIENT_ONLY_CHAT = {
    "moderation": {"model": "omni-moderation-latest"},
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "verbosity": "low",
}
# Fields accepted with no effect on this model (README), refused when they ask for something
NO_EFFECT_CHAT = {
    "reasoning_effort": "low",
    "metadata": {"run": "1"},
    "prompt_cache_key": "k",
    "safety_identifier": "u1",
    "modalities": ["text"],
    "prediction": None,
    "audio": None,
    "web_search_options": None,
}
ASKING_CHAT = {
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "modalities": ["text", "audio"],
    "reasoning_effort": "maximal",
    "metadata": {str(i): "x" for i in range(17)},
}


def _client_parameters(create) -> set[str]:
    skip = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
    return set(inspect.signature(create).parameters) - skip


def test_every_field_the_client_sends_is_served_or_refused_by_name(client, stack):
    from tokenline.api.openai.chat import ChatCompletionRequest
    from tokenline.api.openai.completions import CompletionRequest

    chat = _client_parameters(type(client.chat.completions).create)
    assert set(NO_EFFECT_CHAT) <= set(ChatCompletionRequest.model_fields)
    assert chat - set(ChatCompletionRequest.model_fields) == set(CLIENT_ONLY_CHAT), (
        "the client gained or lost a chat field: decide whether it is served, and update "
        "CLIENT_ONLY_CHAT"
    )
    completions = _client_parameters(type(client.completions).create)
    assert completions <= set(CompletionRequest.model_fields)
    for field, value in CLIENT_ONLY_CHAT.items():
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=stack.model, messages=CHAT, max_tokens=1, **{field: value}
            )
        error = _refusal(caught)
        assert (error["code"], error["param"]) == ("unsupported_parameter", field), error


def test_fields_with_no_effect_refuse_values_that_ask_for_something(client, stack):
    for field, value in ASKING_CHAT.items():
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=stack.model, messages=CHAT, max_tokens=1, **{field: value}
            )
        assert _refusal(caught)["param"].split(".")[0] == field, field


def test_fields_that_ask_for_nothing_are_accepted(client, stack):
    base = _greedy_chat(client, stack).choices[0].message.content
    for kw in (
        {"user": "user-1"},
        {"store": False},
        {"store": None},
        {"service_tier": "auto"},
        {"service_tier": "default"},
        *({field: value} for field, value in NO_EFFECT_CHAT.items()),
        NO_EFFECT_CHAT,
    ):
        assert _greedy_chat(client, stack, **kw).choices[0].message.content == base, kw
    text = _greedy(client, stack).choices[0].text
    for kw in (
        {"user": "user-1"},
        {"extra_body": {"store": False}},
        {"extra_body": {"service_tier": "auto"}},
    ):
        assert _greedy(client, stack, **kw).choices[0].text == text, kw


def test_store_true_and_other_service_tiers_are_refused(client, stack):
    for kw, param in (
        ({"store": True}, "store"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"service_tier": "priority"}, "service_tier"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=1, **kw)
        assert _refusal(caught)["param"] == param
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=stack.model, prompt="x", max_tokens=1, extra_body=kw)
        assert _refusal(caught)["param"] == param
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=1, store=True)
    assert "stores no completions" in _refusal(caught)["message"]


# ── messages ──────────────────────────────────────────────────────────────────────────────────
def test_an_assistant_message_goes_back_as_the_client_returned_it(client, stack):
    first = _greedy_chat(client, stack)
    returned = first.choices[0].message.model_dump()  # refusal, audio, function_call: None
    assert {"refusal", "audio", "function_call"} <= set(returned)
    follow = [*CHAT, returned, {"role": "user", "content": "And the mountain?"}]
    again = _greedy_chat(client, stack, messages=follow)
    cited = {**returned, "annotations": [{"type": "url_citation", "url_citation": {}}]}
    annotated = _greedy_chat(client, stack, messages=[*follow[:1], cited, *follow[2:]])
    assert again.usage.prompt_tokens > first.usage.prompt_tokens
    # what the message carries besides its content does not reach the prompt
    assert annotated.usage.prompt_tokens == again.usage.prompt_tokens
    assert annotated.choices[0].message.content == again.choices[0].message.content


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("refusal", "I cannot"),
        ("audio", {"id": "audio_1"}),
        ("function_call", {"name": "f", "arguments": "{}"}),
    ],
)
def test_a_non_empty_refusal_audio_or_function_call_is_refused(client, stack, field, value):
    message = {"role": "assistant", "content": "ok", field: value}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=stack.model, messages=[*CHAT, message, *CHAT], max_tokens=1
        )
    error = _refusal(caught)
    assert error["param"] == f"messages.1.{field}"
    assert field in error["message"]
    if field == "function_call":
        assert "tool_calls" in error["message"]


def test_annotations_must_be_a_list(client, stack):
    message = {"role": "assistant", "content": "ok", "annotations": "cited"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=stack.model, messages=[*CHAT, message, *CHAT], max_tokens=1
        )
    assert _refusal(caught)["param"] == "messages.1.annotations"


def test_text_parts_are_joined_with_a_newline(client, stack):
    parts = [{"type": "text", "text": "Tell me about"}, {"type": "text", "text": "the river."}]
    joined = _greedy_chat(
        client, stack, messages=[{"role": "user", "content": "Tell me about\nthe river."}]
    )
    as_parts = _greedy_chat(client, stack, messages=[{"role": "user", "content": parts}])
    assert as_parts.usage.prompt_tokens == joined.usage.prompt_tokens
    assert as_parts.choices[0].message.content == joined.choices[0].message.content


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
    ],
)
def test_a_non_text_part_is_refused_naming_its_type_and_place(client, stack, part):
    content = [{"type": "text", "text": "Look:"}, part]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": content}], max_tokens=1
        )
    error = _refusal(caught)
    assert error["param"] == "messages.0.content.1"
    assert part["type"] in error["message"]


def test_a_text_part_without_text_is_refused(client, stack):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": [{"type": "text"}]}],
            max_tokens=1,
        )
    assert _refusal(caught)["param"] == "messages.0.content.0"


def test_a_developer_message_is_a_system_message(client, stack):
    system = _greedy_chat(
        client, stack, messages=[{"role": "system", "content": "Be brief."}, *CHAT]
    )
    developer = _greedy_chat(
        client, stack, messages=[{"role": "developer", "content": "Be brief."}, *CHAT]
    )
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    assert developer.choices[0].message.content == system.choices[0].message.content


def test_a_name_on_a_user_message_is_accepted(client, stack):
    """It reaches the template (tests/tokenizer), which the tiny model's does not print."""
    plain = _greedy_chat(client, stack)
    named = _greedy_chat(client, stack, messages=[{**CHAT[0], "name": "alice"}])
    assert named.usage.prompt_tokens == plain.usage.prompt_tokens
    assert named.choices[0].message.content == plain.choices[0].message.content


# ── sampling fields ───────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("chat", [False, True])
def test_top_k_1_min_p_1_and_a_tiny_top_p_are_greedy(client, stack, chat):
    def run(**kw) -> str:
        if chat:
            reply = client.chat.completions.create(
                model=stack.model,
                messages=CHAT,
                max_tokens=6,
                extra_body={"ignore_eos": True, **kw.pop("extra_body", {})},
                **kw,
            )
            return reply.choices[0].message.content
        reply = client.completions.create(
            model=stack.model,
            prompt=PROMPT,
            max_tokens=6,
            extra_body={"ignore_eos": True, **kw.pop("extra_body", {})},
            **kw,
        )
        return reply.choices[0].text

    greedy = run(temperature=0)
    sampled = {run(temperature=1.5, seed=s) for s in (1, 2, 3)}
    assert sampled != {greedy}, "sampling at temperature 1.5 should not be greedy"
    for seed in (1, 2):
        assert run(temperature=1.5, seed=seed, extra_body={"top_k": 1}) == greedy
        assert run(temperature=1.5, seed=seed, extra_body={"min_p": 1.0}) == greedy
        assert run(temperature=1.5, seed=seed, top_p=1e-6) == greedy
    # top_k -1 and 0 both mean every token, as vLLM has it
    assert run(temperature=0, extra_body={"top_k": -1}) == greedy


def test_max_completion_tokens_bounds_a_chat_reply_over_max_tokens(client, stack):
    reply = client.chat.completions.create(
        model=stack.model,
        messages=CHAT,
        max_tokens=8,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage.completion_tokens == 3
    assert reply.choices[0].finish_reason == "length"


def test_a_chat_seed_repeats_a_sampled_reply(client, stack):
    def run(seed: int) -> str:
        reply = client.chat.completions.create(
            model=stack.model,
            messages=CHAT,
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].message.content

    assert run(11) == run(11) != run(12)


def _run(client, stack, chat: bool, prompt: str, **kw):
    """(text, reply) of a chat or a completion of ``prompt``."""
    if chat:
        reply = client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": prompt}], **kw
        )
        return reply.choices[0].message.content, reply
    reply = client.completions.create(model=stack.model, prompt=prompt, **kw)
    return reply.choices[0].text, reply


@pytest.mark.parametrize("chat", [False, True])
def test_penalties_change_a_repetitive_greedy_reply(client, stack, chat):
    # greedy on this prompt repeats tokens within 24, so each penalty has something to act on
    kw = dict(max_tokens=24, temperature=0)
    base, _ = _run(client, stack, chat, "river river river", **kw, extra_body={"ignore_eos": True})
    for penalty in (
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"ignore_eos": True, "repetition_penalty": 2.0}},
    ):
        extra = penalty.pop("extra_body", {"ignore_eos": True})
        text, _ = _run(client, stack, chat, "river river river", **kw, **penalty, extra_body=extra)
        assert text != base, penalty


# greedy, each of these ends on the end-of-text token after a few tokens
ENDS_EARLY = {False: "river river river", True: "hello"}


@pytest.mark.parametrize("chat", [False, True])
def test_ignore_eos_and_min_tokens_hold_off_the_end_of_text(client, stack, chat):
    kw = dict(max_tokens=10, temperature=0)
    _, ended = _run(client, stack, chat, ENDS_EARLY[chat], **kw)
    assert ended.choices[0].finish_reason == "stop"
    early = ended.usage.completion_tokens
    assert early < 8, "the prompt no longer ends early: pick another"
    _, ignored = _run(client, stack, chat, ENDS_EARLY[chat], **kw, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage.completion_tokens == 10
    _, held = _run(client, stack, chat, ENDS_EARLY[chat], **kw, extra_body={"min_tokens": 8})
    assert held.usage.completion_tokens >= 8


def test_an_unknown_model_is_404_on_chat(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=1)
    error = _refusal(caught)
    assert (error["code"], error["param"]) == ("model_not_found", "model")


# ── structured output fields not exercised elsewhere ──────────────────────────────────────────
SMALL = {
    "type": "object",
    "properties": {
        "sunny": {"type": "boolean"},
        "floor": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["sunny", "floor"],
    "additionalProperties": False,
}


def test_a_json_schema_format_with_description_and_strict_is_served(client, stack):
    reply = client.chat.completions.create(
        model=stack.model,
        messages=CHAT,
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "weather",
                "description": "Whether it is sunny, and a floor",
                "schema": SMALL,
                "strict": True,
            },
        },
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), SMALL)


def test_response_format_text_is_free_text(client, stack):
    plain = _greedy_chat(client, stack).choices[0].message.content
    text = _greedy_chat(client, stack, response_format={"type": "text"})
    assert text.choices[0].message.content == plain


def test_a_strict_function_is_called_with_valid_arguments(client, stack):
    tool = {
        "type": "function",
        "function": {
            "name": "report",
            "description": "Report",
            "parameters": SMALL,
            "strict": True,
        },
    }
    reply = client.chat.completions.create(
        model=stack.model,
        messages=CHAT,
        max_tokens=80,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "report"}},
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "report"
    jsonschema.validate(json.loads(call.function.arguments), SMALL)


# ── Responses and tokenize fields not exercised elsewhere ─────────────────────────────────────
def test_responses_fields_that_ask_for_nothing_are_accepted(client, stack):
    base = client.responses.create(
        model=stack.model, input="Hello", max_output_tokens=3, temperature=0
    )
    accepted = client.responses.create(
        model=stack.model,
        input="Hello",
        max_output_tokens=3,
        temperature=0,
        user="user-1",
        safety_identifier="u1",
        prompt_cache_key="key-1",
        service_tier="auto",
        truncation="disabled",
        reasoning={"effort": "high"},
        include=[],
        background=False,
        store=False,
    )
    assert accepted.output_text == base.output_text
    assert accepted.usage.input_tokens == base.usage.input_tokens
    streamed = client.responses.create(
        model=stack.model,
        input="Hello",
        max_output_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_obfuscation": False},
    )
    assert list(streamed)[-1].response.output_text == base.output_text


def test_responses_refusal_parts_and_a_format_description_are_read(client, stack):
    turn = [{"role": "user", "content": "Weather?"}]
    refused = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "refusal", "refusal": "I cannot say the weather today."}],
    }
    short = client.responses.create(model=stack.model, input=turn, max_output_tokens=1)
    longer = client.responses.create(
        model=stack.model, input=[*turn, refused, *turn], max_output_tokens=1
    )
    assert longer.usage.input_tokens > short.usage.input_tokens + 8
    described = client.responses.create(
        model=stack.model,
        input="Weather?",
        max_output_tokens=60,
        text={
            "format": {
                "type": "json_schema",
                "name": "weather",
                "description": "Whether it is sunny",
                "schema": SMALL,
            }
        },
    )
    assert described.status == "completed"
    jsonschema.validate(json.loads(described.output_text), SMALL)


RESPONSES_UNKNOWN = [
    ({"frobnicate": 1}, "frobnicate"),
    ({"text": {"frobnicate": 1}}, "text.frobnicate"),
    ({"stream": True, "stream_options": {"frobnicate": 1}}, "stream_options.frobnicate"),
    (
        {"tools": [{"type": "function", "name": "f", "parameters": {}, "frobnicate": 1}]},
        "tools[0].frobnicate",
    ),
]


@pytest.mark.parametrize(
    ("extra", "param"), RESPONSES_UNKNOWN, ids=[p for _, p in RESPONSES_UNKNOWN]
)
def test_responses_refuse_unknown_fields_by_name(client, stack, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=stack.model, input="hi", max_output_tokens=1, extra_body=extra
        )
    error = _refusal(caught)
    assert (error["code"], error["param"]) == ("unsupported_parameter", param), error


def test_responses_refuse_an_unknown_field_in_the_text_format(client, stack):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=stack.model,
            input="hi",
            max_output_tokens=1,
            extra_body={"text": {"format": {"type": "text", "frobnicate": 1}}},
        )
    assert _refusal(caught)["param"] == "text.format.frobnicate"


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_add_special_tokens_counts_as_the_tokenizer_does(http, tiny_tokenizer, special):
    response = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": special})
    assert response.status_code == 200, response.text
    want = tiny_tokenizer(PROMPT, add_special_tokens=special)["input_ids"]
    assert response.json()["tokens"] == want
