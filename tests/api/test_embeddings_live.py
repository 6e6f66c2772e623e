"""/v1/embeddings against one running stack of a Qwen3-Embedding-style decoder (random weights,
sentence-transformers' layout, last-token pooling): the official openai client (float and
base64), LangChain's OpenAIEmbeddings and LiteLLM's embedding() get sentence-transformers'
vectors; a generation request to it, and an embedding request to a generating model, are 400s
that name the mismatch."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import start_stack
from openai import BadRequestError, OpenAI
from pooling_testkit import write_embedder

from tokenline import tiny_model

NAME = "embedder"
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "你好 世界 🙂"]
ATOL = 2e-5


@pytest.fixture(scope="module")
def embedder(model_cache, tmp_path_factory) -> Path:
    tiny = tiny_model.ensure_cached(model_cache)
    return write_embedder(tiny, tmp_path_factory.mktemp("embedder"))


@pytest.fixture(scope="module")
def pooling_stack(embedder, model_cache, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    flags = ("--model", str(embedder), "--served-model-name", NAME, "--request-timeout", "60")
    running = start_stack(model_cache, logs, *flags)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def oracle(embedder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedder), device="cpu")


@pytest.fixture(scope="module")
def client(pooling_stack) -> OpenAI:
    return OpenAI(base_url=f"{pooling_stack.api_url}/v1", api_key="unused", max_retries=0)


def test_openai_client_float_and_base64_equal_sentence_transformers(client, oracle):
    expected = oracle.encode(TEXTS, batch_size=1)
    for encoding in ("float", "base64"):
        reply = client.embeddings.create(model=NAME, input=TEXTS, encoding_format=encoding)
        assert [d.index for d in reply.data] == [0, 1, 2]
        got = [d.embedding for d in reply.data]
        if encoding == "base64":  # asked for by name, the client hands the text over as is
            got = [np.frombuffer(base64.b64decode(e), dtype="<f4") for e in got]
        np.testing.assert_allclose(got, expected, atol=ATOL)
        ids = [oracle.tokenizer(t)["input_ids"] for t in TEXTS]
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    # unasked, the client asks for base64 and decodes it itself
    default = client.embeddings.create(model=NAME, input=TEXTS[0])
    np.testing.assert_allclose(default.data[0].embedding, expected[0], atol=ATOL)


def test_token_id_inputs_and_matryoshka_dimensions(client, oracle):
    ids = [oracle.tokenizer(t)["input_ids"] for t in TEXTS]
    expected = oracle.encode(TEXTS, batch_size=1)
    one = client.embeddings.create(model=NAME, input=ids[1])
    np.testing.assert_allclose(one.data[0].embedding, expected[1], atol=ATOL)
    many = client.embeddings.create(model=NAME, input=ids)
    np.testing.assert_allclose([d.embedding for d in many.data], expected, atol=ATOL)
    cut = client.embeddings.create(model=NAME, input=TEXTS, dimensions=32)
    want = expected[:, :32] / np.linalg.norm(expected[:, :32], axis=1, keepdims=True)
    np.testing.assert_allclose([d.embedding for d in cut.data], want, atol=ATOL)
    with pytest.raises(BadRequestError, match="dimensions 48"):
        client.embeddings.create(model=NAME, input="x", dimensions=48)


def test_langchain_and_litellm_get_the_same_vectors(pooling_stack, oracle):
    from langchain_openai import OpenAIEmbeddings

    expected = oracle.encode(TEXTS, batch_size=1)
    base = f"{pooling_stack.api_url}/v1"
    # tiktoken's token counting would need a download: send the texts as they are
    lc = OpenAIEmbeddings(
        model=NAME, base_url=base, api_key="unused", check_embedding_ctx_length=False
    )
    np.testing.assert_allclose(lc.embed_documents(TEXTS), expected, atol=ATOL)
    np.testing.assert_allclose(lc.embed_query(TEXTS[0]), expected[0], atol=ATOL)
    import litellm

    reply = litellm.embedding(model=f"openai/{NAME}", input=TEXTS, api_base=base, api_key="unused")
    got = [d["embedding"] for d in reply.data]
    np.testing.assert_allclose(got, expected, atol=ATOL)


def test_rerank_and_score_on_an_embedding_model_are_cosines(pooling_stack, oracle):
    query, docs = "the fox", ["a fox jumps", "the river", "你好"]
    vectors = oracle.encode([query, *docs], batch_size=1)
    cosines = vectors[1:] @ vectors[0]  # normalised: the dot product is the cosine
    body = {"model": NAME, "query": query, "documents": docs, "top_n": 2}
    reply = httpx.post(f"{pooling_stack.api_url}/v1/rerank", json=body, timeout=60).json()
    order = list(np.argsort(-cosines))[:2]
    assert [r["index"] for r in reply["results"]] == order
    for result in reply["results"]:
        assert result["relevance_score"] == pytest.approx(cosines[result["index"]], abs=ATOL)
        assert result["document"]["text"] == docs[result["index"]]
    body = {"model": NAME, "text_1": query, "text_2": docs}
    scores = httpx.post(f"{pooling_stack.api_url}/score", json=body, timeout=60).json()
    got = [d["score"] for d in scores["data"]]
    np.testing.assert_allclose(got, cosines, atol=ATOL)


def test_a_user_id_is_accepted_and_changes_nothing(client, oracle):
    expected = oracle.encode(TEXTS, batch_size=1)
    reply = client.embeddings.create(model=NAME, input=TEXTS, user="end-user-7")
    np.testing.assert_allclose([d.embedding for d in reply.data], expected, atol=ATOL)


def test_an_unknown_model_is_a_404_on_every_pooling_endpoint(pooling_stack):
    bodies = {
        "/v1/embeddings": {"input": "x"},
        "/v1/rerank": {"query": "q", "documents": ["d"]},
        "/score": {"text_1": "q", "text_2": "d"},
    }
    for path, body in bodies.items():
        url = f"{pooling_stack.api_url}{path}"
        reply = httpx.post(url, json={**body, "model": "gpt-9"}, timeout=60)
        assert reply.status_code == 404, (path, reply.text)
        error = reply.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model"), path
        assert f"`{NAME}`" in error["message"], path


def test_generation_on_a_pooling_model_is_a_400_naming_the_mismatch(client, pooling_stack):
    with pytest.raises(BadRequestError, match="--runner pooling"):
        client.completions.create(model=NAME, prompt="hello", max_tokens=3)
    with pytest.raises(BadRequestError, match="--runner pooling"):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    assert pooling_stack.metric("scheduler", "tokenline_live_uids", stage="scheduler") == 0


def test_limits_and_context_length(client, pooling_stack):
    with pytest.raises(BadRequestError, match="maximum context length is 512"):
        client.embeddings.create(model=NAME, input=[[5] * 600])
    with pytest.raises(BadRequestError):
        client.embeddings.create(model=NAME, input=[])
    assert pooling_stack.metric("api", "tokenline_requests_total", finish_reason="stop") > 0


def test_embeddings_on_a_generating_model_is_a_400_naming_the_mismatch(stack):
    body = {"model": stack.model, "input": "hello"}
    reply = httpx.post(f"{stack.api_url}/v1/embeddings", json=body, timeout=60)
    assert reply.status_code == 400
    assert "--runner generate" in reply.json()["error"]["message"]
