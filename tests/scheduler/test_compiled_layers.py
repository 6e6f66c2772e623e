"""--compile: the layers' dense tail compiled with torch.compile gives the eager engine's
tokens. It is for GPUs: on a CPU whose GEMMs take packed weights the layers stay eager over
them, which measured faster than the compiled tail over plain weights (benchmarks/README.md);
the tail is checked here with packing off."""

from __future__ import annotations

import pytest
from scheduler_testkit import PROMPTS, drain, greedy

from tokenline import tiny_model
from tokenline.scheduler import runner as runner_module
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner, RunnerOptions

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompt_ids(encode) -> dict[str, list[int]]:
    return {f"p{i}": encode(text) for i, text in enumerate(PROMPTS)}


def _engine(tiny_source, eos_ids, compile_layers: bool) -> Engine:
    runner = ModelRunner(
        tiny_source, RunnerOptions(device="cpu", dtype="float32", compile_layers=compile_layers)
    )
    limits = EngineLimits(tiny_model.MAX_POSITIONS, max_num_batched_tokens=7)
    return Engine(runner, limits, eos_ids)


def test_compiled_layer_tails_give_the_eager_tokens(tiny_source, eos_ids, prompt_ids, monkeypatch):
    monkeypatch.setattr(runner_module, "packs_weights", lambda place: False)
    runs = {}
    for compiled in (False, True):
        engine = _engine(tiny_source, eos_ids, compiled)
        assert engine.runner.compiled_layers is compiled
        for uid, ids in prompt_ids.items():  # 7-token steps: many different token counts
            engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True))
        runs[compiled] = drain(engine).tokens
    assert runs[True] == runs[False]


def test_on_a_cpu_that_packs_weights_compile_keeps_the_packed_eager_layers(tiny_source, eos_ids):
    engine = _engine(tiny_source, eos_ids, compile_layers=True)
    assert engine.runner.compiled_layers is False
    projection = engine.runner.model.model.layers[0].mlp.down_proj
    assert projection.packed is not None or projection.weight.is_mkldnn
