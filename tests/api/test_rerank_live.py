"""/rerank, /v1/rerank and /score against one running stack of a Qwen3 cross-encoder (random
weights, ``Qwen3ForSequenceClassification`` with one label): the order and the scores are the
cross-encoder's own (transformers' forward over the pair read together, its logit through a
sigmoid, as a cross-encoder scores)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import start_stack
from pooling_testkit import write_cross_encoder

from tokenline import tiny_model

NAME = "reranker"
QUERY = "where does the fox sleep"
DOCS = [
    "The quick brown fox jumps over the lazy dog near the river.",
    "a",
    "你好 世界 🙂",
    "request queue world and the morning light " * 8,
]


@pytest.fixture(scope="module")
def cross_encoder(model_cache, tmp_path_factory) -> Path:
    tiny = tiny_model.ensure_cached(model_cache)
    return write_cross_encoder(tiny, tmp_path_factory.mktemp("cross"))


@pytest.fixture(scope="module")
def rerank_stack(cross_encoder, model_cache, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    flags = ("--model", str(cross_encoder), "--served-model-name", NAME)
    running = start_stack(model_cache, logs, *flags, "--max-num-batched-tokens", "32")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def expected(cross_encoder) -> np.ndarray:
    """The sigmoid of transformers' logit for each (query, document) pair, tokenized as a
    pair. (sentence-transformers 6's CrossEncoder renders pairs through a chat template when
    the tokenizer has one, as the tiny tokenizer has, so it is not the oracle here.)"""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    model = AutoModelForSequenceClassification.from_pretrained(cross_encoder).eval()
    with torch.no_grad():
        logits = [model(**tokenizer(QUERY, d, return_tensors="pt")).logits[0, 0] for d in DOCS]
    return torch.sigmoid(torch.stack(logits)).numpy()


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.api_url}{path}", json={"model": NAME, **body}, timeout=60)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_rerank_order_and_scores_are_the_cross_encoders(rerank_stack, expected, path):
    reply = post(rerank_stack, path, {"query": QUERY, "documents": DOCS})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected))
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=2e-5)
        assert result["document"] == {"text": DOCS[result["index"]]}
    assert reply.json()["usage"]["total_tokens"] > len(DOCS)


def test_rerank_top_n_and_documents_left_out(rerank_stack, expected):
    documents = [{"text": d} for d in DOCS]  # Cohere's objects
    body = {"query": QUERY, "documents": documents, "top_n": 2, "return_documents": False}
    results = post(rerank_stack, "/rerank", body).json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected))[:2]
    assert all("document" not in r for r in results)


def test_score_one_to_many_and_pairwise(rerank_stack, expected):
    reply = post(rerank_stack, "/score", {"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in reply["data"]] == list(range(len(DOCS)))
    np.testing.assert_allclose([d["score"] for d in reply["data"]], expected, atol=2e-5)
    pairwise = {"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}
    got = [d["score"] for d in post(rerank_stack, "/score", pairwise).json()["data"]]
    np.testing.assert_allclose(got, expected[:2], atol=2e-5)
    mismatched = post(rerank_stack, "/score", {"text_1": DOCS[:2], "text_2": DOCS[:3]})
    assert mismatched.status_code == 400 and "text_1 holds 2" in mismatched.text


def test_embeddings_on_a_cross_encoder_is_a_400_naming_the_mismatch(rerank_stack):
    reply = post(rerank_stack, "/v1/embeddings", {"input": "hello"})
    assert reply.status_code == 400
    assert "--convert classify" in reply.json()["error"]["message"]
