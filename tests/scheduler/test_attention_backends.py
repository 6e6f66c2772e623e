"""Every attention backend against a plain reference: transformers' own forward over each
sequence's whole context. Per sampled position the logits agree to float32 tolerance, and the
greedy tokens are the reference's and the same for every backend, for plain decode, chunked
prefill (chunks that continue a prompt), prefix-cache hits and sliding-window models. The flex
backend runs here eagerly (torch's unfused flex_attention, which reads every slot and trusts
only the mask) and compiled (inductor's kernel, which reads only the listed blocks)."""

from __future__ import annotations

import pytest
import torch
from scheduler_testkit import FAMILIES, SLIDING, saved_family_model

from tokenline.model_source import ModelSource
from tokenline.protocol import SamplingParams
from tokenline.scheduler import attention
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner, RunnerOptions

BUILT = ["sdpa", "dense-cpu", "flex"]
MODELS = {
    "llama": FAMILIES["llama"],
    "qwen3": FAMILIES["qwen3"],
    **{name: SLIDING[name] for name in ("mistral-window-8", "qwen2-window-8-layer-1")},
}


def prompt(seed: int, n: int) -> list[int]:
    return [(7 * seed + 3 * j) % 290 + 5 for j in range(n)]


def scenario_decode(engine: Engine) -> None:
    """Prompts that fit one step each: the batch of first chunks, then decode together."""
    for i, n in enumerate((9, 14, 23)):
        engine.add(f"d{i}", prompt(i, n), greedy(12))
    run(engine)


def scenario_chunked_prefill(engine: Engine) -> None:
    """A 16-token budget cuts the prompts into chunks that continue them, beside decodes."""
    engine.limits.max_num_batched_tokens = 16
    engine.policy.max_num_batched_tokens = 16
    for i, n in enumerate((40, 27, 5)):
        engine.add(f"c{i}", prompt(i, n), greedy(10))
    run(engine)


def scenario_prefix_hits(engine: Engine) -> None:
    """Later prompts start with an earlier one's blocks: they start past a cache hit."""
    shared = prompt(1, 37)
    engine.add("first", shared, greedy(6))
    run(engine)
    engine.add("hit-a", shared[:32] + prompt(5, 9), greedy(10))
    engine.add("hit-b", shared + prompt(6, 4), greedy(10))
    run(engine)
    assert engine.prefix_cache_hits >= 64


def scenario_long_and_short(engine: Engine) -> None:
    """One context over four times the others' decodes beside them: on the dense rows it
    attends apart, over its own context, and the others over theirs."""
    for i, n in enumerate((150, 5, 9, 13)):
        engine.add(f"l{i}", prompt(i, n), greedy(12))
    run(engine)


# the paths each scenario must have gone through, besides decode
PATHS = {
    "decode": {"FirstChunkPrefill"},
    "chunked-prefill": {"FirstChunkPrefill", "ContinuedPrefill"},
    "prefix-hits": {"FirstChunkPrefill", "ContinuedPrefill"},
    "long-and-short": {"FirstChunkPrefill"},
}
DECODE_PATH = {"sdpa": "GatherDecode", "dense-cpu": "DenseDecode"}
# flex has one kind of batch for decode rows and for chunks: what each scenario must have used
FLEX_PARTS = {
    "decode": {1, 23},
    "chunked-prefill": {1, 16},
    "prefix-hits": {1, 37},
    "long-and-short": {1, 150},
}
SCENARIOS = {
    "decode": scenario_decode,
    "chunked-prefill": scenario_chunked_prefill,
    "prefix-hits": scenario_prefix_hits,
    "long-and-short": scenario_long_and_short,
}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def recorded_run(backend: str, path, scenario, compiled: bool = False):
    """Run ``scenario`` on a runner with ``backend``; return each sequence's tokens and the
    logits of every position it sampled at: {uid: {tokens known: logits}}."""
    runner = ModelRunner(
        ModelSource(spec="family", path=str(path)),
        RunnerOptions(
            device="cpu",
            dtype="float32",
            kv_cache_memory=2**20,
            torch_threads=1,
            attention_backend=backend,
            compile_layers=compiled,
        ),
    )
    assert runner.attention.name == backend
    logits_at: dict[str, dict[int, torch.Tensor]] = {}
    execute = runner.execute

    def recording(inputs, spans=()):
        logits, hidden = execute(inputs, spans)
        sampling = [c for c in inputs.chunks if c.samples]
        for chunk, row in zip(sampling, logits, strict=True):
            logits_at.setdefault(chunk.seq.uid, {})[chunk.start + chunk.num_tokens] = row.clone()
        return logits, hidden

    runner.execute = recording
    paths_used: set[str] = set()
    prepare = runner.attention.prepare

    def recording_prepare(step):
        metadata = prepare(step)
        if backend == "flex":  # the longest query count of each batch
            paths_used.update(part.shape[1] for part in metadata.parts)
        else:
            paths_used.update(type(path).__name__ for path, _ in metadata.parts)
            if any(getattr(getattr(m, "plan", None), "long_rows", None) for _, m in metadata.parts):
                paths_used.add("long rows apart")
        return metadata

    runner.attention.prepare = recording_prepare
    engine = Engine(runner, EngineLimits(256, max_num_batched_tokens=2048), eos_ids=[])
    seqs = {}
    add = engine.add

    def keeping_add(uid, ids, sampling, **kw):
        seqs[uid] = add(uid, ids, sampling, **kw)
        return seqs[uid]

    engine.add = keeping_add
    scenario(engine)
    tokens = {uid: seq.prompt_ids + seq.output_ids for uid, seq in seqs.items()}
    return tokens, logits_at, paths_used


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("model", list(MODELS))
def test_every_backend_matches_the_reference_forward(model, scenario, tmp_path):
    reference = saved_family_model(MODELS[model], tmp_path).eval()
    results = {name: recorded_run(name, tmp_path, SCENARIOS[scenario]) for name in BUILT}
    tokens = results[BUILT[0]][0]
    for name, (got_tokens, logits_at, paths_used) in results.items():
        if name == "flex":
            assert FLEX_PARTS[scenario] <= paths_used, paths_used
        else:
            assert paths_used - {"long rows apart"} == PATHS[scenario] | {DECODE_PATH[name]}
            if (name, scenario) == ("dense-cpu", "long-and-short"):
                assert "long rows apart" in paths_used
        assert got_tokens == tokens, f"{name}: greedy tokens differ from {BUILT[0]}'s"
        assert_matches_reference(reference, name, got_tokens, logits_at)


def assert_matches_reference(reference, name: str, got_tokens: dict, logits_at: dict) -> None:
    for uid, ids in got_tokens.items():
        with torch.inference_mode():
            want = reference(torch.tensor([ids])).logits[0].float()
        for known, got in logits_at[uid].items():
            torch.testing.assert_close(
                got, want[known - 1], rtol=1e-4, atol=1e-4, msg=f"{name} {uid} at {known}"
            )
            if known < len(ids):  # the token sampled here is the reference's argmax
                assert ids[known] == int(want[known - 1].argmax()), (name, uid, known)


@pytest.fixture
def fresh_compiler():
    """Each compiled runner starts from torch's compiler as a serving process does: one pool
    size, one map shape (a process of tests sees many, and inductor's CPU kernel miscompiles a
    mask over buffers whose shapes it has seen change)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("scenario", ["chunked-prefill", "prefix-hits"])
def test_compiled_flex_matches_the_reference_forward(scenario, tmp_path, fresh_compiler):
    """Inductor's flex kernel reads only the blocks each query tile lists: the lists must hold
    every block the mask lets a query see, past sliding windows too."""
    from torch._dynamo.utils import counters

    reference = saved_family_model(MODELS["mistral-window-8"], tmp_path).eval()
    eager = recorded_run("sdpa", tmp_path, SCENARIOS[scenario])
    compiled = counters["stats"]["unique_graphs"]
    tokens, logits_at, _ = recorded_run("flex", tmp_path, SCENARIOS[scenario], compiled=True)
    assert counters["stats"]["unique_graphs"] > compiled  # inductor built the kernel
    assert tokens == eager[0]
    assert_matches_reference(reference, "flex (compiled)", tokens, logits_at)


def test_auto_picks_flex_on_cuda_and_dense_rows_on_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention.backend_name("auto", cpu) == "dense-cpu"
    assert attention.backend_name("auto", cpu, dense_decode=False) == "sdpa"
    assert attention.backend_name("auto", cuda) == "flex"
    assert attention.backend_name("sdpa", cpu) == "sdpa"


def test_flex_pages_fit_the_gpu_kernels_key_tile():
    from tokenline.scheduler.attention.flex import CUDA_BLOCK_SIZE, flex_block_size

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [flex_block_size(cuda, n) for n in (16, 64, 100)] == [64, 64, 128]
    assert flex_block_size(cpu, 16) == 16
    assert CUDA_BLOCK_SIZE == 64
    shape = attention.AttentionShape(4, 2, 16, torch.float32, cpu, 16, None)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention.choose("flashattention-9", shape, torch.zeros(1, 32, 4, 16))


def test_attention_backend_flag_reaches_the_runner(tiny_source):
    from tokenline.cli import build_parser, settings_from
    from tokenline.scheduler.runner import ModelRunner, RunnerOptions

    cases = (("sdpa", "sdpa"), ("dense-cpu", "dense-cpu"), ("flex", "flex"), ("auto", "dense-cpu"))
    for flag, expected in cases:
        args = build_parser().parse_args(["scheduler", "--attention-backend", flag])
        settings = settings_from(args)
        runner = ModelRunner(
            tiny_source,
            RunnerOptions(
                device="cpu",
                dtype="float32",
                kv_cache_memory=2**20,
                attention_backend=settings.attention_backend,
            ),
        )
        assert runner.attention.name == expected, flag
