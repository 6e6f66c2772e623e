"""--compile: on a CPU the decoder's layers run as one graph compiled by inductor, with frozen
weights and attention outside the graph (layers/compiled.py). It gives transformers' greedy
tokens for every Llama-style family (biases, per-head q/k norms, sliding windows), its logits
follow transformers' in float32 and bfloat16, it gives the eager engine's tokens over steps of
every token count, and steps with LoRA rows run eagerly. On a GPU --compile compiles each
layer's tail (`layer_tail`), checked here on CPU by calling it."""

from __future__ import annotations

import pytest
import torch
from scheduler_testkit import (
    FAMILIES,
    MOE,
    PROMPTS,
    SLIDING,
    drain,
    family_runner,
    generate_greedy,
    greedy,
    saved_family_model,
)
from torch._dynamo.utils import counters

from tokenline import tiny_model
from tokenline.model_source import ModelSource
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.models.llama import layer_tail
from tokenline.scheduler.runner import ModelRunner, RunnerOptions

MAX_TOKENS = 12
COMPILED = {
    "llama": FAMILIES["llama"],
    "qwen3": FAMILIES["qwen3"],  # per-head q/k norms
    "qwen2-window-8-layer-1": SLIDING["qwen2-window-8-layer-1"],  # biases, a sliding layer
}


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each compiled runner starts from torch's compiler as a serving process does (one model
    to a process: a test process's many would reach dynamo's recompilation limit)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def prompt_ids(encode) -> dict[str, list[int]]:
    return {f"p{i}": encode(text) for i, text in enumerate(PROMPTS)}


def _runner(source: ModelSource, compiled: bool, dtype: str = "float32") -> ModelRunner:
    options = RunnerOptions(
        device="cpu", dtype=dtype, kv_cache_memory=2**20, compile_layers=compiled
    )
    return ModelRunner(source, options)


def _assert_compiled(runner: ModelRunner) -> None:
    """--compile took effect, and the layers ran as one graph (dynamo neither broke it nor
    fell back to eager)."""
    assert runner.compiled_layers and runner.model.compiled is not None
    assert counters["stats"]["unique_graphs"] >= 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not counters["recompile_limit"], dict(counters["recompile_limit"])


@pytest.mark.parametrize("family", list(COMPILED))
def test_compiled_layers_give_transformers_greedy_tokens(family, tmp_path):
    model = saved_family_model(COMPILED[family], tmp_path)
    runner = family_runner(family, tmp_path, compile_layers=True)
    # a 16-token budget: prompts are prefilled in chunks next to other prompts' decode rows
    engine = Engine(runner, EngineLimits(256, max_num_batched_tokens=16), eos_ids=[])
    prompts = {f"p{i}": [(7 * i + j) % 290 + 5 for j in range(9 + 5 * i)] for i in range(3)}
    for uid, ids in prompts.items():
        engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True))
    got = drain(engine).tokens
    _assert_compiled(runner)
    for uid, ids in prompts.items():
        assert got[uid] == generate_greedy(model, ids, MAX_TOKENS), (family, uid)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_logits_follow_transformers(dtype, tmp_path):
    """A prompt's logits and the decode step's after it, as test_model_families checks the
    eager forward: float32 within rounding of another kernel order, bfloat16 within bf16's."""
    from tokenline.scheduler.kv_cache import BlockPool
    from tokenline.scheduler.policy import Chunk
    from tokenline.scheduler.sequence import Sequence

    model = saved_family_model(FAMILIES["qwen3"], tmp_path)
    reference = type(model).from_pretrained(tmp_path, dtype=getattr(torch, dtype)).eval()
    runner = family_runner("qwen3", tmp_path, dtype=dtype, compile_layers=True)
    tolerance = 1e-4 if dtype == "float32" else 0.1
    ids = [(7 * j) % 290 + 5 for j in range(20)]
    seq = Sequence(uid="a", prompt_ids=ids, sampling=SamplingParams(max_tokens=2), max_tokens=2)
    BlockPool(runner.num_blocks, runner.block_size).grow(seq, len(ids) + 1)

    def against_reference(chunk: Chunk) -> torch.Tensor:
        got = runner.forward([chunk])[0]
        with torch.inference_mode():
            want = reference(torch.tensor([ids + seq.output_ids])).logits[0, -1].float()
        assert (got - want).abs().max() < tolerance * want.std(), (dtype, chunk.start)
        return got

    first = against_reference(Chunk(seq, 0, len(ids)))
    seq.num_computed = len(ids)
    seq.output_ids.append(int(first.argmax()))
    against_reference(Chunk(seq, len(ids), 1))
    _assert_compiled(runner)


def test_compiled_layers_give_the_eager_tokens_over_every_step_size(
    tiny_source, eos_ids, prompt_ids
):
    """7-token steps: prefill chunks, decode rows and mixes of them, many token counts."""
    runs = {}
    for compiled in (False, True):
        runner = _runner(tiny_source, compiled)
        engine = Engine(runner, EngineLimits(tiny_model.MAX_POSITIONS, 7), eos_ids)
        for uid, ids in prompt_ids.items():
            engine.add(uid, ids, greedy(MAX_TOKENS, ignore_eos=True))
        runs[compiled] = drain(engine).tokens
    _assert_compiled(runner)
    assert runs[True] == runs[False]


def test_compiled_layers_leave_the_weights_plain_for_inductor_to_pack(tiny_source):
    """Inductor packs the graph's weights; the LM head, outside the graph, is packed as ever."""
    runner = _runner(tiny_source, compiled=True)
    projection = runner.model.model.layers[0].mlp.down_proj
    assert projection.packed is None and not projection.weight.is_mkldnn
    head = runner.model.lm_head
    assert head.packed is not None or head.weight.is_mkldnn
    eager = _runner(tiny_source, compiled=False).model.model.layers[0].mlp.down_proj
    assert eager.packed is not None or eager.weight.is_mkldnn


def test_a_step_with_lora_rows_runs_the_layers_eagerly(tiny_source, monkeypatch):
    """The graph has no LoRA deltas: a step whose rows use an adapter must not enter it."""
    runner = _runner(tiny_source, compiled=True)
    runner.enable_lora(max_loras=1, max_rank=4)
    entered = []
    monkeypatch.setattr(
        runner.model.compiled, "_compiled", lambda h, cos, sin: entered.append(1) or h
    )
    engine = Engine(runner, EngineLimits(tiny_model.MAX_POSITIONS, 64), eos_ids=[])
    seq = engine.add("plain", [5, 6, 7], greedy(2, ignore_eos=True))
    drain(engine)
    assert entered and seq.output_ids  # the plain steps went through the graph
    entered.clear()
    seq = engine.add("adapted", [5, 6, 7], greedy(2, ignore_eos=True))
    seq.lora_slot = 0
    drain(engine)
    assert not entered and len(seq.output_ids) == 2


def test_the_gpu_layer_tail_is_the_eager_tail():
    """`layer_tail` (compiled per layer on a GPU) computes o_proj, residual, RMSNorm and the
    SiLU MLP as the eager layers do."""
    from tokenline.scheduler.layers.linear import RowLinear
    from tokenline.scheduler.layers.mlp import GatedMLP
    from tokenline.scheduler.layers.norm import RMSNorm
    from tokenline.scheduler.layers.placement import Placement

    place = Placement(torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    o = RowLinear(32, 16, False, place, "heads")
    norm, mlp = RMSNorm(16, 1e-6, place), GatedMLP(16, 24, "silu", place)
    for param in (o.weight, norm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight):
        param.data.normal_()
    residual, attn = torch.randn(5, 16), torch.randn(5, 32)
    hidden = o(attn, residual)
    want = mlp(norm(hidden), hidden)
    got = layer_tail(
        residual,
        attn,
        (o.weight, None),
        norm.weight,
        norm.eps,
        (mlp.gate_up_proj.weight, None),
        (mlp.down_proj.weight, None),
    )
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_with_flex_on_a_cpu_only_flex_is_compiled(tiny_source, dtype):
    """Flex's CPU kernel, compiled afresh for each shape inside the layers' graph, fails to
    build: with flex, the layers stay eager (over packed weights where oneDNN packs the dtype;
    it does not pack float16) and flex alone is compiled."""
    runner = ModelRunner(
        tiny_source,
        RunnerOptions(device="cpu", dtype=dtype, attention_backend="flex", compile_layers=True),
    )
    assert runner.attention.compiled and not runner.compiled_layers
    projection = runner.model.model.layers[0].mlp.down_proj
    packed = projection.packed is not None or projection.weight.is_mkldnn
    assert packed is (dtype == "float32")


def test_warm_up_compiles_every_graph_a_step_needs(tmp_path):
    """Two graphs, one row and any other count, both built by warm-up: serving compiles nothing
    more (a recompilation stalls every stream for as long as the warm-up took). The warm-up
    prefill is 2 * head_dim rows, cos's stride, which duck sizing would have tied it to."""
    from tokenline.scheduler.warm_up import warm_up

    saved_family_model(FAMILIES["qwen3"], tmp_path)  # head_dim 32
    runner = family_runner("qwen3", tmp_path, compile_layers=True)
    warm_up(runner, 64)
    built = counters["stats"]["unique_graphs"]
    assert built == 2
    engine = Engine(runner, EngineLimits(256, max_num_batched_tokens=24), eos_ids=[])
    for i in range(5):  # steps of 1 to 24 rows: prefill chunks, decode rows and both
        engine.add(f"p{i}", [(5 * i + j) % 290 + 5 for j in range(3 + 7 * i)], greedy(6))
    drain(engine)
    assert counters["stats"]["unique_graphs"] == built


@pytest.fixture
def no_cpp_compiler(tmp_path):
    """Inductor searching only a C++ compiler that does not exist; the path it tried."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpp_builder

    missing = str(tmp_path / "no-such-c++")
    cpp_builder.cpp_compiler_search.cache_clear()  # it remembers the compiler it found
    try:
        with inductor_config.patch({"cpp.cxx": (None, missing)}):
            yield missing
    finally:
        cpp_builder.cpp_compiler_search.cache_clear()


def test_compile_without_a_cpp_compiler_stops_at_start_saying_what_to_do(
    tiny_source, no_cpp_compiler
):
    """With no C++ compiler, inductor would fail at warm-up's first step with a page of its
    traceback; the runner refuses first, naming the compiler it tried and the way out."""
    with pytest.raises(SystemExit) as stopped:
        _runner(tiny_source, compiled=True)
    _runner(tiny_source, compiled=False)  # the eager layers need no compiler
    message = str(stopped.value)
    assert message.startswith("--compile on a CPU builds its kernels with a C++ compiler")
    assert f"tried: {no_cpp_compiler}" in message and "serve without --compile" in message


def test_a_model_compile_leaves_eager_needs_no_compiler(tmp_path, no_cpp_compiler):
    """--compile on a family with no compiled path (a mixture of experts) runs eagerly, as it
    did before the compiler check: nothing is compiled, so no compiler is needed."""
    saved_family_model(MOE["qwen3-moe"], tmp_path)
    runner = family_runner("qwen3-moe", tmp_path, compile_layers=True)
    assert not runner.compiled_layers
