"""Before the scheduler joins the ring: every path a step can take runs once (the largest
prefill chunk, a decode step, each decode bucket), over scratch blocks no request can read; and
on a GPU the KV pool is what ``--gpu-memory-utilization`` leaves after the weights and the
largest prefill chunk's measured activations."""

from __future__ import annotations

import pytest

from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner, RunnerOptions
from tokenline.scheduler.warm_up import kv_pool_bytes, prefill_tokens, warm_up

GiB = 2**30


def _tokens(runner: ModelRunner) -> dict[str, list[int]]:
    engine = Engine(runner, EngineLimits(256, max_num_batched_tokens=32), eos_ids=[])
    for i in range(5):
        prompt = [(11 * i + 3 * j) % 250 + 5 for j in range(5 + 9 * i)]
        engine.add(f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.uid, []).extend(out.token_ids)
    assert engine.pool.num_free == engine.pool.num_blocks - 1  # warm-up left nothing held
    return tokens


@pytest.mark.parametrize(
    "options",
    [{}, {"attention_backend": "flex", "cuda_graph_sizes": [1, 2, 4, 8]}],
    ids=["dense-cpu", "flex-padded"],
)
def test_warming_up_changes_nothing_a_request_sees(tiny_source, options):
    def runner() -> ModelRunner:
        return ModelRunner(
            tiny_source,
            RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=2**21, **options),
        )

    cold = _tokens(runner())
    warm = runner()
    assert warm_up(warm, max_num_batched_tokens=64) >= 0
    assert _tokens(warm) == cold


def test_the_largest_prefill_chunk_fits_the_context_and_the_pool(tiny_source):
    runner = ModelRunner(
        tiny_source, RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=2**20)
    )
    assert prefill_tokens(runner, 64) == 64
    assert prefill_tokens(runner, 10**6) == min(
        runner.max_model_len - 1, (runner.num_blocks - 2) * runner.block_size
    )


def test_the_pool_gets_what_utilization_leaves_after_weights_and_activations():
    # an 80 GiB device with 20 GiB in use (weights, context) and a 3 GiB activation peak
    assert kv_pool_bytes(80 * GiB, 60 * GiB, 0.9, 3 * GiB) == int(72 * GiB) - 20 * GiB - 3 * GiB
    assert kv_pool_bytes(80 * GiB, 10 * GiB, 0.9, 3 * GiB) == 0  # nothing left


def test_a_pool_too_small_for_one_block_is_refused_at_start(tiny_source):
    with pytest.raises(SystemExit, match="no room for a KV cache"):
        ModelRunner(tiny_source, RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=1024))
