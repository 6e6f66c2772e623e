"""BERT-style encoders through one running stack each (random weights, a WordPiece tokenizer
built offline): an embedder in sentence-transformers' layout (MEAN pooling) answers the
official openai client with sentence-transformers' vectors, alone, as a list and beside
concurrent requests; an input past the encoder's 128 positions is a 400 naming the limit, even
with --max-model-len above them; a BERT cross-encoder's /rerank and /score are
sentence-transformers' CrossEncoder's own scores and order."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import start_stack
from openai import BadRequestError, OpenAI
from pooling_testkit import BERT_CONFIG, write_bert_classifier, write_bert_embedder

NAME = "bert"
LIMIT = BERT_CONFIG["max_position_embeddings"]
TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog near the river.",
    "你好 世界 🙂",
    "a",
    "request queue world and the morning light " * 6,
]
QUERY = "where does the fox sleep"
ATOL = 2e-5


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> Path:
    return write_bert_embedder(tmp_path_factory.mktemp("bert_mean"), "MEAN")


@pytest.fixture(scope="module")
def embed_stack(embedder, model_cache, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    # --max-model-len above the encoder's positions: the scheduler still holds to them
    flags = ("--model", str(embedder), "--served-model-name", NAME, "--request-timeout", "60")
    running = start_stack(model_cache, logs, *flags, "--max-model-len", str(2 * LIMIT))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def oracle(embedder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedder), device="cpu")


@pytest.fixture(scope="module")
def client(embed_stack) -> OpenAI:
    return OpenAI(base_url=f"{embed_stack.api_url}/v1", api_key="unused", max_retries=0)


def test_openai_client_gets_sentence_transformers_vectors(client, oracle):
    expected = oracle.encode(TEXTS, batch_size=1)
    for encoding in ("float", "base64"):
        reply = client.embeddings.create(model=NAME, input=TEXTS, encoding_format=encoding)
        got = [d.embedding for d in reply.data]
        if encoding == "base64":
            got = [np.frombuffer(base64.b64decode(e), dtype="<f4") for e in got]
        np.testing.assert_allclose(got, expected, atol=ATOL)
        ids = [oracle.tokenizer(t)["input_ids"] for t in TEXTS]
        assert reply.usage.prompt_tokens == sum(map(len, ids))
    alone = client.embeddings.create(model=NAME, input=TEXTS[1])
    np.testing.assert_allclose(alone.data[0].embedding, expected[1], atol=ATOL)
    cut = client.embeddings.create(model=NAME, input=TEXTS[:2], dimensions=16)
    want = expected[:2, :16] / np.linalg.norm(expected[:2, :16], axis=1, keepdims=True)
    np.testing.assert_allclose([d.embedding for d in cut.data], want, atol=ATOL)


def test_concurrent_requests_batched_together_get_their_own_vectors(client, oracle):
    expected = oracle.encode(TEXTS, batch_size=1)

    def embed(i: int) -> list[float]:
        return client.embeddings.create(model=NAME, input=TEXTS[i % len(TEXTS)]).data[0].embedding

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(embed, range(24)))
    for i, vector in enumerate(got):
        np.testing.assert_allclose(vector, expected[i % len(TEXTS)], atol=ATOL)


def test_an_input_past_the_positions_is_a_400_naming_the_limit(client, embed_stack):
    with pytest.raises(BadRequestError, match=f"maximum context length is {LIMIT} tokens"):
        client.embeddings.create(model=NAME, input=[[5] * (LIMIT + 1)])
    with pytest.raises(BadRequestError, match=f"maximum context length is {LIMIT} tokens"):
        client.embeddings.create(model=NAME, input="fox " * (LIMIT + 10))
    fits = client.embeddings.create(model=NAME, input=[[5] * LIMIT])
    assert len(fits.data[0].embedding) == BERT_CONFIG["hidden_size"]
    assert embed_stack.metric("scheduler", "tokenline_live_uids", stage="scheduler") == 0


def test_models_say_the_runner_and_the_code_that_runs_it(client):
    (card,) = client.models.list().data
    assert (card.id, card.architecture, card.model_impl) == (NAME, "BertModel", "transformers")
    assert (card.runner, card.task) == ("pooling", "embed")


def test_classify_on_an_embedding_model_is_a_400_naming_the_mismatch(embed_stack):
    reply = httpx.post(f"{embed_stack.api_url}/classify", json={"input": "x"}, timeout=60)
    assert reply.status_code == 400
    assert "--convert embed" in reply.json()["error"]["message"]


# ── a BERT cross-encoder ─────────────────────────────────────────────────────────────────────────
@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Path:
    return write_bert_classifier(tmp_path_factory.mktemp("bert_cross"))


@pytest.fixture(scope="module")
def rerank_stack(cross_encoder, model_cache, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    running = start_stack(model_cache, logs, "--model", str(cross_encoder))
    yield running
    running.stop()


def test_bert_cross_encoder_rerank_and_score_are_its_own(rerank_stack, cross_encoder):
    from sentence_transformers import CrossEncoder

    oracle = CrossEncoder(str(cross_encoder), device="cpu")
    expected = oracle.predict([(QUERY, d) for d in TEXTS], batch_size=1)
    body = {"query": QUERY, "documents": TEXTS}
    reply = httpx.post(f"{rerank_stack.api_url}/v1/rerank", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected))
    got = [r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])]
    np.testing.assert_allclose(got, expected, atol=ATOL)
    body = {"text_1": QUERY, "text_2": TEXTS}
    scores = httpx.post(f"{rerank_stack.api_url}/score", json=body, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in scores["data"]], expected, atol=ATOL)
