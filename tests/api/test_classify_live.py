"""vLLM's /classify against one running stack of a random-weight BERT classifier of three
labels: each input's probabilities are transformers' softmax over its logits, its label the
config's id2label of the likeliest, in vLLM's response shape; a classifier of several labels
is no cross-encoder (/rerank is a 400), and /classify on a generating model is a 400 naming
the mismatch."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import start_stack
from pooling_testkit import write_bert_classifier

NAME = "classifier"
LABELS = ["negative", "neutral", "positive"]
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "你好 🙂", "a"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    return write_bert_classifier(tmp_path_factory.mktemp("classifier"), LABELS)


@pytest.fixture(scope="module")
def classify_stack(classifier, model_cache, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    running = start_stack(
        model_cache, logs, "--model", str(classifier), "--served-model-name", NAME
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def oracle(classifier):
    """transformers' softmax over each text's logits, and the token counts."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(classifier)
    model = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    with torch.no_grad():
        logits = [model(**tokenizer(t, return_tensors="pt")).logits[0] for t in TEXTS]
    probs = torch.softmax(torch.stack(logits), dim=-1).numpy()
    return probs, [tokenizer(t)["input_ids"] for t in TEXTS]


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.api_url}{path}", json={"model": NAME, **body}, timeout=60)


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_probs_and_labels_are_transformers_softmax(classify_stack, oracle, path):
    probs, ids = oracle
    reply = post(classify_stack, path, {"input": TEXTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == NAME
    assert body["id"].startswith("classify-") and isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    for row, data in zip(probs, body["data"], strict=True):
        np.testing.assert_allclose(data["probs"], row, atol=2e-5)
        assert data["num_classes"] == len(LABELS)
        assert data["label"] == LABELS[int(np.argmax(row))]
    tokens = sum(map(len, ids))
    assert body["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
    }


def test_one_text_and_token_ids(classify_stack, oracle):
    probs, ids = oracle
    one = post(classify_stack, "/classify", {"input": TEXTS[1]}).json()
    np.testing.assert_allclose(one["data"][0]["probs"], probs[1], atol=2e-5)
    as_ids = post(classify_stack, "/classify", {"input": ids[2]}).json()
    np.testing.assert_allclose(as_ids["data"][0]["probs"], probs[2], atol=2e-5)
    unknown = post(classify_stack, "/classify", {"input": "x", "softmax": False})
    assert unknown.status_code == 400


def test_a_user_id_is_accepted_and_an_unknown_model_is_a_404(classify_stack, oracle):
    probs, _ = oracle
    reply = post(classify_stack, "/classify", {"input": TEXTS, "user": "end-user-7"})
    assert reply.status_code == 200, reply.text
    np.testing.assert_allclose([d["probs"] for d in reply.json()["data"]], probs, atol=2e-5)
    unknown = post(classify_stack, "/classify", {"input": "x", "model": "gpt-9"})
    assert unknown.status_code == 404, unknown.text
    error = unknown.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert f"`{NAME}`" in error["message"]


def test_a_classifier_of_several_labels_is_no_cross_encoder(classify_stack):
    reply = post(classify_stack, "/rerank", {"query": "q", "documents": ["d"]})
    assert reply.status_code == 400
    assert "one label; this classifier has 3 (negative, neutral, positive)" in reply.text
    assert classify_stack.metric("scheduler", "tokenline_live_uids", stage="scheduler") == 0
    card = httpx.get(f"{classify_stack.api_url}/v1/models", timeout=60).json()["data"][0]
    assert (card["runner"], card["task"]) == ("pooling", "classify")


def test_classify_on_a_generating_model_is_a_400_naming_the_mismatch(stack):
    reply = httpx.post(f"{stack.api_url}/classify", json={"input": "hello"}, timeout=60)
    assert reply.status_code == 400
    assert "--runner generate" in reply.json()["error"]["message"]
    card = httpx.get(f"{stack.api_url}/v1/models", timeout=60).json()["data"][0]
    assert card["runner"] == "generate" and "task" not in card


def test_probabilities_follow_the_problem_type():
    import torch

    from tokenline.api.endpoints.pooling import _probabilities

    logits = np.array([2.0, -1.0, 0.5])
    softmax = torch.softmax(torch.tensor(logits), -1).numpy()
    sigmoid = torch.sigmoid(torch.tensor(logits)).numpy()
    np.testing.assert_allclose(_probabilities(logits, ""), softmax)
    np.testing.assert_allclose(_probabilities(logits, "single_label_classification"), softmax)
    np.testing.assert_allclose(_probabilities(logits, "multi_label_classification"), sigmoid)
    np.testing.assert_allclose(_probabilities(logits, "regression"), logits)
    np.testing.assert_allclose(_probabilities(np.array([800.0]), ""), [1.0])  # no overflow
