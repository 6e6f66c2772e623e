"""The encoder engine against the models' own code: a random-weight BERT embedder's vectors
equal sentence-transformers' (CLS and MEAN pooling, alone and padded into batches with other
requests), a BERT cross-encoder's scores equal sentence-transformers' CrossEncoder and a
classifier's logits transformers'; steps keep to the batch limits, an input past the encoder's
positions is refused naming the limit, and aborts, pauses and deadlines leave nothing held."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pooling_testkit import BERT_CONFIG, write_bert_classifier, write_bert_embedder

from tokenline.model_source import ModelSource
from tokenline.protocol import PoolingParams
from tokenline.scheduler.engine import EngineLimits
from tokenline.scheduler.pooling.config import resolve_setup, runner_of
from tokenline.scheduler.pooling.encoder import EncoderRunner
from tokenline.scheduler.pooling.encoder_engine import EncoderEngine, InputTooLong
from tokenline.scheduler.pooling.engine_base import WrongRunner
from tokenline.scheduler.runner import RunnerOptions

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog near the river in the morning light.",
    "你好 世界 🙂",
    "a",
    " ".join(["request queue world and the river"] * 12),
]
QUERY = "where does the fox sleep"
LIMIT = BERT_CONFIG["max_position_embeddings"]


def engine_for(path: Path, seqs: int = 8, budget: int = 1024, **options) -> EncoderEngine:
    source = ModelSource(spec=path.name, path=str(path))
    setup = resolve_setup(source, "auto", None)
    opts = RunnerOptions(device="cpu", dtype="float32", torch_threads=1, **options)
    runner = EncoderRunner(source, opts, setup)
    return EncoderEngine(runner, setup, EngineLimits(runner.max_model_len, seqs, budget))


def drain(engine: EncoderEngine, requests: dict[str, tuple]) -> tuple[dict, list[list[str]]]:
    """Add every (ids, params[, types]) request and step until none is held: the results by
    uid and each step's uids."""
    for uid, (ids, params, *types) in requests.items():
        engine.add(uid, ids, params, token_type_ids=types[0] if types else None)
    out, steps = {}, []
    while engine.has_work():
        replies = engine.step()
        steps.append(list(engine.step_uids))
        for reply in replies:
            assert reply.finish_reason == "stop", reply
            assert reply.prompt_tokens == len(requests[reply.uid][0])
            out[reply.uid] = np.frombuffer(reply.pooled, dtype="<f4")
        assert len(steps) < 100
    assert not engine.held_uids()
    return out, steps


@pytest.fixture(scope="module", params=["CLS", "MEAN"])
def embedder(request, tmp_path_factory) -> Path:
    return write_bert_embedder(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Path:
    return write_bert_classifier(tmp_path_factory.mktemp("cross"))


def test_the_checkpoint_says_it_is_an_encoder_and_how_it_pools(embedder):
    source = ModelSource(spec="bert", path=str(embedder))
    assert runner_of("auto", source) == "pooling"
    setup = resolve_setup(source, "auto", None)
    assert setup.encoder and setup.task == "embed" and setup.normalize
    assert setup.pooling_type == embedder.name.rstrip("0123456789")


def test_embeddings_equal_sentence_transformers_alone_and_batched(embedder):
    from sentence_transformers import SentenceTransformer

    oracle = SentenceTransformer(str(embedder), device="cpu")
    expected = oracle.encode(TEXTS, batch_size=1)
    ids = [oracle.tokenizer(t)["input_ids"] for t in TEXTS]
    engine = engine_for(embedder)
    params = PoolingParams(task="embed")
    for i in range(len(TEXTS)):
        got, _ = drain(engine, {"alone": (ids[i], params)})
        np.testing.assert_allclose(got["alone"], expected[i], atol=2e-5)
    batched, steps = drain(engine, {f"r{i}": (ids[i], params) for i in range(len(TEXTS))})
    assert steps == [[f"r{i}" for i in range(len(TEXTS))]]  # one padded batch
    for i in range(len(TEXTS)):
        np.testing.assert_allclose(batched[f"r{i}"], expected[i], atol=2e-5)
    # Matryoshka (the test's models all declare dimensions): cut, then normalised again
    cut, _ = drain(engine, {"cut": (ids[1], PoolingParams(task="embed", dimensions=32))})
    want = torch.nn.functional.normalize(torch.tensor(expected[1][:32]), dim=-1).numpy()
    np.testing.assert_allclose(cut["cut"], want, atol=2e-5)


def test_steps_keep_to_max_num_seqs_and_the_padded_token_budget(embedder):
    engine = engine_for(embedder, seqs=3, budget=40)
    params = PoolingParams(task="embed")
    requests = {f"s{i}": ([5] * 8, params) for i in range(5)}  # 8 tokens each
    requests["long"] = ([5] * 30, params)  # 2 x 30 > 40: it runs alone
    requests["late"] = ([5] * 8, params)
    _, steps = drain(engine, requests)
    assert steps == [["s0", "s1", "s2"], ["s3", "s4"], ["long"], ["late"]]
    alone = engine_for(embedder, budget=16)
    _, steps = drain(alone, {"over": ([5] * 60, params)})  # over the budget, within positions
    assert steps == [["over"]]


def test_inputs_past_the_positions_are_refused_naming_the_limit(embedder):
    engine = engine_for(embedder)
    with pytest.raises(InputTooLong, match=f"maximum context length is {LIMIT} tokens"):
        engine.add("long", [5] * (LIMIT + 1), PoolingParams(task="embed"))
    engine.add("fits", [5] * LIMIT, PoolingParams(task="embed"))
    assert engine.step()[0].finish_reason == "stop"
    shorter = engine_for(embedder, max_model_len=32)  # --max-model-len below the positions
    with pytest.raises(InputTooLong, match="maximum context length is 32 tokens"):
        shorter.add("long", [5] * 33, PoolingParams(task="embed"))
    wider = engine_for(embedder, max_model_len=4 * LIMIT)  # above them: the positions hold
    with pytest.raises(InputTooLong, match=f"maximum context length is {LIMIT} tokens"):
        wider.add("long", [5] * (LIMIT + 1), PoolingParams(task="embed"))


def test_requests_of_the_other_kind_are_refused_by_name(embedder):
    engine = engine_for(embedder)
    with pytest.raises(WrongRunner, match="--runner pooling"):
        engine.add("g", [1, 2], None)
    with pytest.raises(WrongRunner, match="not classify"):
        engine.add("c", [1, 2], PoolingParams(task="classify"))
    with pytest.raises(ValueError, match=r"dimensions 48: this model serves \[16, 32, 64\]"):
        engine.add("d", [1, 2], PoolingParams(task="embed", dimensions=48))
    assert not engine.held_uids()


def test_aborts_pauses_and_deadlines_end_requests_once(embedder):
    engine = engine_for(embedder)
    params = PoolingParams(task="embed")
    engine.add("a", [5, 6], params)
    engine.add("p", [5, 6], params)
    engine.add("late", [5, 6], params, timeout_s=0.0)
    assert engine.pause("p") and engine.counts() == {"waiting": 2, "running": 0, "paused": 1}
    assert engine.abort("a") and not engine.abort("a")
    assert engine.expire() == [] and engine.expire(now=10**9) == ["late"]
    replies = engine.step()
    assert sorted((r.uid, r.finish_reason) for r in replies) == [("a", "abort"), ("late", "abort")]
    assert engine.step_uids == [] and not engine.has_work()  # the paused one waits
    assert engine.resume("p")
    (done,) = engine.step()
    assert (done.uid, done.finish_reason) == ("p", "stop") and not engine.held_uids()
    engine.add("d", [5], params)
    assert engine.drop("d") and not engine.has_work()


def test_a_head_the_checkpoint_lacks_is_refused_at_start(embedder):
    source = ModelSource(spec="bert", path=str(embedder))
    setup = resolve_setup(source, "classify", None)  # a BertModel has no classifier
    options = RunnerOptions(device="cpu", dtype="float32", torch_threads=1)
    with pytest.raises(SystemExit, match=r"no weights for classifier\.bias, classifier\.weight"):
        EncoderRunner(source, options, setup)


def test_dtype_follows_the_runner_options(embedder):
    engine = engine_for(embedder)
    half = EncoderRunner(
        ModelSource(spec="bert", path=str(embedder)),
        RunnerOptions(device="cpu", dtype="bfloat16", torch_threads=1),
        engine.setup,
    )
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    vector = half.forward([([2, 40, 41, 3], None)])
    full = engine.runner.forward([([2, 40, 41, 3], None)])
    assert vector.dtype == torch.float32
    np.testing.assert_allclose(vector.numpy(), full.numpy(), atol=0.1)


def test_cross_encoder_scores_equal_sentence_transformers_cross_encoder(cross_encoder):
    from sentence_transformers import CrossEncoder

    oracle = CrossEncoder(str(cross_encoder), device="cpu")
    expected = oracle.predict([(QUERY, d) for d in TEXTS], batch_size=1)
    tokenizer = oracle.tokenizer
    engine = engine_for(cross_encoder)
    assert engine.setup.task == "classify" and engine.size == 1
    params = PoolingParams(task="classify")
    requests = {}
    for i, doc in enumerate(TEXTS):
        pair = tokenizer(QUERY, doc)
        requests[f"p{i}"] = (pair["input_ids"], params, pair["token_type_ids"])
    got, steps = drain(engine, requests)
    assert len(steps) == 1
    scores = [torch.sigmoid(torch.tensor(got[f"p{i}"][0])).item() for i in range(len(TEXTS))]
    np.testing.assert_allclose(scores, expected, atol=2e-5)
    # the segments count: read as one text, the pairs score otherwise
    flat, _ = drain(engine, {k: v[:2] for k, v in requests.items()})
    assert not np.allclose([flat[k] for k in flat], [got[k] for k in flat], atol=1e-3)


def test_classifier_logits_equal_transformers(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    labels = ["negative", "neutral", "positive"]
    path = write_bert_classifier(tmp_path_factory.mktemp("classifier"), labels)
    tokenizer = AutoTokenizer.from_pretrained(path)
    oracle = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = [oracle(**tokenizer(t, return_tensors="pt")).logits[0].numpy() for t in TEXTS]
    engine = engine_for(path)
    assert engine.size == 3
    params = PoolingParams(task="classify")
    got, _ = drain(
        engine, {f"c{i}": (tokenizer(t)["input_ids"], params) for i, t in enumerate(TEXTS)}
    )
    for i, want in enumerate(expected):
        np.testing.assert_allclose(got[f"c{i}"], want, atol=2e-5)
