"""Decode steps padded into fixed buffers (what a captured CUDA graph replays) compute what the
unpadded steps compute.

On this CPU machine the padded path runs eagerly over the same buffers a graph would replay
(only the capture itself needs a GPU): across batches that move between buckets as sequences
finish, past a sliding window, with seeded sampling, and with the compiled flex kernel; steps it
cannot take (prefill, LoRA rows, more sequences than the largest bucket) run unpadded.
"""

from __future__ import annotations

import pytest
import torch
from scheduler_testkit import SLIDING, saved_family_model

from tokenline.model_source import ModelSource
from tokenline.protocol import SamplingParams
from tokenline.scheduler.decode_graphs import capture_sizes
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner, RunnerOptions


def _runner(source, **kw) -> ModelRunner:
    kw.setdefault("attention_backend", "flex")
    return ModelRunner(
        source, RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=2**21, **kw)
    )


def _run(runner: ModelRunner, sampling: SamplingParams, count: int = 7) -> tuple[dict, dict]:
    """Tokens and every sampled row's logits per uid; prompts of different lengths finish at
    different steps, so the decode batch shrinks through the buckets."""
    engine = Engine(runner, EngineLimits(256, max_num_batched_tokens=32), eos_ids=[])
    logits: dict[str, list[torch.Tensor]] = {}
    execute = runner.execute
    buckets: list[int] = []

    def recording(inputs, spans=()):
        out = execute(inputs, spans)
        buckets.append(inputs.bucket)
        sampling_chunks = [c for c in inputs.chunks if c.samples]
        for chunk, row in zip(sampling_chunks, out[0], strict=True):
            logits.setdefault(chunk.seq.uid, []).append(row.clone())
        return out

    runner.execute = recording
    for i in range(count):
        prompt = [(7 * i + 3 * j) % 250 + 5 for j in range(6 + 5 * i)]
        params = SamplingParams(**{**sampling.__struct_fields_dict__(), "max_tokens": 6 + 3 * i})
        engine.add(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.uid, []).extend(out.token_ids)
    return tokens, {"logits": logits, "buckets": buckets}


def _struct_fields(self) -> dict:
    return {f: getattr(self, f) for f in self.__struct_fields__}


SamplingParams.__struct_fields_dict__ = _struct_fields  # the test's copy of a request

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=1, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)


def _same(padded, unpadded) -> None:
    (tokens, got), (want_tokens, want) = padded, unpadded
    assert tokens == want_tokens
    for uid, rows in want["logits"].items():
        for mine, theirs in zip(got["logits"][uid], rows, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_padded_decode_gives_the_unpadded_tokens_and_logits(tiny_source, sampling):
    unpadded = _run(_runner(tiny_source), sampling)
    padded = _run(_runner(tiny_source, cuda_graph_sizes=[1, 2, 4, 8]), sampling)
    _same(padded, unpadded)
    used = set(padded[1]["buckets"]) - {0}
    assert {8, 4, 2, 1} <= used, used  # seven sequences finishing one by one
    assert set(unpadded[1]["buckets"]) == {0}


def test_padded_decode_past_a_sliding_window(tmp_path):
    saved_family_model(SLIDING["mistral-window-8"], tmp_path)
    source = ModelSource(spec="mistral", path=str(tmp_path))
    unpadded = _run(_runner(source), GREEDY, count=4)
    padded = _run(_runner(source, cuda_graph_sizes=[4]), GREEDY, count=4)
    _same(padded, unpadded)


def test_padded_decode_with_the_compiled_flex_kernel(tiny_source):
    torch._dynamo.reset()  # a serving process's compiler: one pool size (test_attention_backends)
    unpadded = _run(_runner(tiny_source), GREEDY, count=3)
    padded = _run(_runner(tiny_source, cuda_graph_sizes=[4], compile_layers=True), GREEDY, count=3)
    _same(padded, unpadded)


def test_steps_the_buckets_cannot_take_run_unpadded(tiny_source):
    """Prefill chunks, and more sequences than the largest bucket."""
    runner = _runner(tiny_source, cuda_graph_sizes=[2])
    assert runner.graphs.sizes == [1, 2]
    _, seen = _run(runner, GREEDY, count=4)
    buckets = seen["buckets"]
    assert buckets[0] == 0  # the first step prefills
    assert 0 in buckets[1:] and 2 in buckets and 1 in buckets  # 4 and 3 rows run unpadded


def test_capture_sizes_follow_vllm():
    assert capture_sizes(None, 256) == [1, 2, 4, *range(8, 513, 8)]
    assert capture_sizes(None, 4) == [1, 2, 4, 8]
    assert capture_sizes([20], 256) == [1, 2, 4, 8, 16]
    assert capture_sizes([3, 1, 64], 256) == [1, 3, 64]


def test_enforce_eager_and_backends_without_fixed_buffers_run_unpadded(tiny_source, tmp_path):
    assert _runner(tiny_source, cuda_graph_sizes=[4], enforce_eager=True).graphs is None
    assert _runner(tiny_source, cuda_graph_sizes=[4], attention_backend="sdpa").graphs is None
    assert _runner(tiny_source).graphs is None  # no GPU and no sizes asked for
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    dynamic = _runner(ModelSource(spec="dyn", path=str(tmp_path)), cuda_graph_sizes=[4])
    assert dynamic.graphs is None
    assert "rotary" in dynamic.model.graph_refusal()


def test_the_flags_reach_the_runner():
    from tokenline.cli import build_parser, settings_from

    args = build_parser().parse_args(
        ["scheduler", "--cuda-graph-sizes", "1,2, 4", "--enforce-eager"]
    )
    settings = settings_from(args)
    assert settings.cuda_graph_sizes == "1,2,4" and settings.enforce_eager is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler", "--cuda-graph-sizes", "0,4"])
