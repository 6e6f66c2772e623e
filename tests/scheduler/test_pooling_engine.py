"""The pooling engine against the models' own code: a Qwen3-Embedding-style decoder's
embeddings equal sentence-transformers' (LAST and MEAN pooling, alone and batched, long inputs
chunked through the paged KV cache), and a Qwen3 cross-encoder's logits equal transformers'."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pooling_testkit import write_cross_encoder, write_embedder

from tokenline.model_source import ModelSource
from tokenline.protocol import PoolingParams
from tokenline.scheduler.engine import EngineLimits
from tokenline.scheduler.pooling.config import resolve_setup, runner_of
from tokenline.scheduler.pooling.engine import PoolingEngine
from tokenline.scheduler.pooling.engine_base import WrongRunner
from tokenline.scheduler.pooling.model import PoolingRunner
from tokenline.scheduler.runner import RunnerOptions

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog near the river in the morning light.",
    "你好 世界 🙂",
    "a",
]
LONG = " ".join(["request queue world and the river in the morning light"] * 12)
BUDGET = 32  # tokens per step: LONG takes several chunks


def engine_for(path: Path, convert: str = "auto") -> PoolingEngine:
    source = ModelSource(spec=path.name, path=str(path))
    setup = resolve_setup(source, convert, None)
    options = RunnerOptions(
        device="cpu",
        dtype="float32",
        kv_cache_memory=2**20,
        torch_threads=1,
        enforce_eager=True,
        max_num_batched_tokens=BUDGET,
    )
    runner = PoolingRunner(source, options, setup)
    return PoolingEngine(runner, setup, EngineLimits(512, 8, BUDGET))


def drain(engine: PoolingEngine, requests: dict[str, tuple[list[int], PoolingParams]]):
    """Add every request, run steps until none is held; the vectors by uid and the steps."""
    for uid, (ids, params) in requests.items():
        engine.add(uid, ids, params)
    out, steps = {}, 0
    while engine.has_work():
        steps += 1
        for reply in engine.step():
            assert reply.finish_reason == "stop", reply
            assert reply.prompt_tokens == len(requests[reply.uid][0])
            out[reply.uid] = np.frombuffer(reply.pooled, dtype="<f4")
        assert steps < 200
    assert engine.pool.num_referenced == 0, "KV blocks held after every request ended"
    assert not engine.states and not engine.held_uids()
    return out, steps


@pytest.fixture(scope="module")
def tiny_dir(model_cache) -> Path:
    from tokenline import tiny_model

    return tiny_model.ensure_cached(model_cache)


@pytest.fixture(scope="module", params=["LAST", "MEAN"])
def embedder(request, tiny_dir, tmp_path_factory) -> Path:
    return write_embedder(tiny_dir, tmp_path_factory.mktemp(request.param), request.param)


def test_the_checkpoint_says_it_pools_and_how(embedder, tiny_dir):
    source = ModelSource(spec="e", path=str(embedder))
    assert runner_of("auto", source) == "pooling"
    assert runner_of("auto", ModelSource(spec="tiny", path=str(tiny_dir))) == "generate"
    setup = resolve_setup(source, "auto", None)
    assert setup.task == "embed" and setup.normalize and not setup.encoder
    assert setup.pooling_type == embedder.name.rstrip("0123456789")
    assert setup.matryoshka == [16, 32, 64]
    override = resolve_setup(source, "auto", '{"pooling_type": "cls", "normalize": false}')
    assert (override.pooling_type, override.normalize) == ("CLS", False)


def test_embeddings_equal_sentence_transformers_alone_batched_and_chunked(embedder):
    from sentence_transformers import SentenceTransformer

    oracle = SentenceTransformer(str(embedder), device="cpu")
    texts = [*TEXTS, LONG]
    expected = oracle.encode(texts, batch_size=1)
    tokenizer = oracle.tokenizer
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert len(ids[-1]) > 3 * BUDGET  # the long input is chunked
    engine = engine_for(embedder)
    params = PoolingParams(task="embed")
    for i in (0, len(texts) - 1):  # alone
        got, steps = drain(engine, {"alone": (ids[i], params)})
        np.testing.assert_allclose(got["alone"], expected[i], atol=2e-5)
    assert steps > 3  # the long one ran chunk by chunk
    batched, _ = drain(engine, {f"r{i}": (ids[i], params) for i in range(len(texts))})
    for i in range(len(texts)):
        np.testing.assert_allclose(batched[f"r{i}"], expected[i], atol=2e-5)
    # Matryoshka: cut, then normalised again
    cut, _ = drain(engine, {"cut": (ids[1], PoolingParams(task="embed", dimensions=32))})
    want = torch.nn.functional.normalize(torch.tensor(expected[1][:32]), dim=-1).numpy()
    np.testing.assert_allclose(cut["cut"], want, atol=2e-5)


def test_a_request_of_the_other_kind_is_refused_by_name(embedder):
    engine = engine_for(embedder)
    with pytest.raises(WrongRunner, match="--runner pooling"):
        engine.add("g", [1, 2], None)
    with pytest.raises(WrongRunner, match="not classify"):
        engine.add("c", [1, 2], PoolingParams(task="classify"))
    with pytest.raises(ValueError, match="dimensions 48"):
        engine.add("d", [1, 2], PoolingParams(task="embed", dimensions=48))
    assert not engine.held_uids()


def test_an_abort_ends_the_request_and_frees_its_blocks(embedder):
    engine = engine_for(embedder)
    engine.add("a", list(range(1, 100)), PoolingParams())
    engine.step()  # its first chunk holds blocks
    assert engine.pool.num_referenced > 0
    assert engine.abort("a")
    (reply,) = engine.step()
    assert reply.finish_reason == "abort" and not reply.pooled
    assert engine.pool.num_referenced == 0 and not engine.states


def test_cross_encoder_scores_equal_transformers(tiny_dir, tmp_path_factory):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = write_cross_encoder(tiny_dir, tmp_path_factory.mktemp("cross"))
    source = ModelSource(spec="ce", path=str(path))
    assert runner_of("auto", source) == "pooling"
    assert resolve_setup(source, "auto", None).task == "classify"
    tokenizer = AutoTokenizer.from_pretrained(path)
    oracle = AutoModelForSequenceClassification.from_pretrained(path).eval()
    query = "where does the fox sleep"
    pairs = [tokenizer(query, doc)["input_ids"] for doc in [*TEXTS, LONG]]
    with torch.no_grad():
        expected = [oracle(torch.tensor([p])).logits[0].numpy() for p in pairs]
    engine = engine_for(path)
    params = PoolingParams(task="classify")
    got, _ = drain(engine, {f"p{i}": (p, params) for i, p in enumerate(pairs)})
    for i, want in enumerate(expected):
        np.testing.assert_allclose(got[f"p{i}"], want, atol=2e-5)
