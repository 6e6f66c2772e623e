"""Every family tokenline serves computes what transformers computes.

Small random models of each architecture are built from a config (no download), saved in
Hugging Face format and loaded through the same path as a real model: the native modules
(Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral, Gemma 3) and transformers' own modules with
tokenline's attention (Granite, Phi-3, OLMo-2, which have no native module). Greedy tokens
equal transformers' ``generate`` alone and in a mixed batch with chunked prefill, after a
prefix-cache hit, past sliding windows; logits stay within float32 and bfloat16 rounding.
"""

from __future__ import annotations

import pytest
import torch
from scheduler_testkit import (
    COMMON,
    GEMMA,
    GENERIC,
    NATIVE,
    SLIDING,
    family_runner,
    generate_greedy,
    saved_family_model,
)

from tokenline.model_source import ModelSource
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner, RunnerOptions

ALL = {**NATIVE, **GENERIC}
MAX_TOKENS = 12


def _expected_path(family: str) -> str:
    return "transformers" if family in GENERIC else "tokenline"


def _generate(model, ids: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    return generate_greedy(model, ids, max_new_tokens)


def _run(engine: Engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    for uid, ids in prompts.items():
        engine.add(uid, ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    got: dict[str, list[int]] = {uid: [] for uid in prompts}
    while engine.has_work():
        for out in engine.step():
            got[out.uid] += out.token_ids
    return got


def _greedy_against_transformers(
    family, spec, tmp_path, dense_decode: bool = True, model_impl: str = "auto"
) -> None:
    model = saved_family_model(spec, tmp_path)
    runner = family_runner(family, tmp_path, dense_decode, model_impl=model_impl)
    expected = _expected_path(family) if model_impl == "auto" else model_impl
    assert runner.model.implementation == expected
    # a 16-token budget: prompts are prefilled in chunks, next to other prompts' decode tokens
    engine = Engine(runner, EngineLimits(256, max_num_batched_tokens=16), eos_ids=[])
    prompts = {f"p{i}": [(7 * i + j) % 290 + 5 for j in range(9 + 5 * i)] for i in range(3)}
    batched = _run(engine, prompts)
    alone = _run(engine, {"alone": prompts["p2"]})["alone"]
    for uid, ids in prompts.items():
        assert batched[uid] == _generate(model, ids), (family, uid)
    assert alone == batched["p2"]


@pytest.mark.parametrize("family", list(ALL))
def test_greedy_matches_transformers_for_each_family(family, tmp_path):
    _greedy_against_transformers(family, ALL[family], tmp_path)


@pytest.mark.parametrize("dense_decode", [True, False], ids=["dense-decode", "gather-decode"])
@pytest.mark.parametrize("family", [*SLIDING, *GEMMA])
def test_sliding_window_layers_match_transformers_past_the_window(family, dense_decode, tmp_path):
    spec = {**SLIDING, **GEMMA}[family]
    _greedy_against_transformers(family, spec, tmp_path, dense_decode)


def test_a_native_family_on_transformers_modules_gives_the_same_tokens(tmp_path):
    """--model-impl transformers runs any decoder; on Llama it agrees with the native module."""
    _greedy_against_transformers("llama", NATIVE["llama"], tmp_path, model_impl="transformers")


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral", "gemma3", "granite"])
def test_a_prefix_cache_hit_gives_transformers_tokens(family, tmp_path):
    """The second prompt starts with the first one's 40 tokens: two full blocks come from the
    cache and only the rest is computed, over K/V the first request left in the pool."""
    model = saved_family_model(ALL[family], tmp_path)
    engine = Engine(family_runner(family, tmp_path), EngineLimits(256), eos_ids=[])
    first = [(11 * j) % 290 + 5 for j in range(40)]
    second = [*first, 17, 29, 31]
    assert _run(engine, {"first": first})["first"] == _generate(model, first)
    hits = engine.prefix_cache_hits
    assert _run(engine, {"second": second})["second"] == _generate(model, second)
    assert engine.prefix_cache_hits - hits >= 32


def test_the_window_is_read_per_layer_from_the_model(tmp_path):
    import transformers

    config = transformers.Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    runner = ModelRunner(
        ModelSource(spec="qwen2", path=str(tmp_path)),
        RunnerOptions(device="cpu", kv_cache_memory=2**20),
    )
    assert runner.window == 8
    assert runner._slides == [False, True]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dense_decode", [True, False], ids=["dense-decode", "gather-decode"])
@pytest.mark.parametrize("family", list(ALL))
def test_logits_follow_transformers(family, dense_decode, dtype, tmp_path):
    """A prompt's logits and the decode step's after it, against transformers' own forward in
    the same dtype: float32 within rounding of a different kernel order, bfloat16 (what GPUs
    run) within bf16 rounding; a wrong rotation, norm or routing is off by whole logits."""
    from tokenline.scheduler.kv_cache import BlockPool
    from tokenline.scheduler.policy import Chunk
    from tokenline.scheduler.sequence import Sequence

    model = saved_family_model(ALL[family], tmp_path)
    torch_dtype = getattr(torch, dtype)
    reference = type(model).from_pretrained(tmp_path, dtype=torch_dtype).eval()
    runner = family_runner(family, tmp_path, dense_decode, dtype=dtype)
    tolerance = 1e-4 if dtype == "float32" else 0.1
    ids = [(7 * j) % 290 + 5 for j in range(20)]
    seq = Sequence(uid="a", prompt_ids=ids, sampling=SamplingParams(max_tokens=2), max_tokens=2)
    pool = BlockPool(runner.num_blocks, runner.block_size)
    pool.grow(seq, len(ids) + 1)

    def logits_against_reference(chunk: Chunk) -> torch.Tensor:
        got = runner.forward([chunk])[0]
        with torch.inference_mode():
            want = reference(torch.tensor([ids + seq.output_ids])).logits[0, -1].float()
        assert (got - want).abs().max() < tolerance * want.std(), (family, chunk.start)
        return got

    first = logits_against_reference(Chunk(seq, 0, len(ids)))  # the prompt
    seq.num_computed = len(ids)
    seq.output_ids.append(int(first.argmax()))
    logits_against_reference(Chunk(seq, len(ids), 1))  # the decode step after it


def test_a_multimodal_gemma3_checkpoint_serves_its_text_on_transformers_modules(tmp_path):
    """Gemma 3 4B-27B are saved as Gemma3ForConditionalGeneration (a vision tower beside the
    decoder, the sizes in text_config): its text runs on transformers' modules, checked at
    start like any other, and gives transformers' tokens."""
    import transformers

    text = {**COMMON, **GEMMA["gemma3"][2]}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=297,
        eoi_token_index=298,
        image_token_index=299,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)
    model.save_pretrained(tmp_path)
    runner = family_runner("gemma3-multimodal", tmp_path)
    assert runner.model.describe() == "Gemma3ForConditionalGeneration (transformers)"
    assert runner.window == 8 and runner._slides == [True, False]
    engine = Engine(runner, EngineLimits(256, max_num_batched_tokens=16), eos_ids=[])
    prompts = {f"p{i}": [(7 * i + j) % 290 + 5 for j in range(9 + 5 * i)] for i in range(2)}
    got = _run(engine, prompts)
    for uid, ids in prompts.items():
        assert got[uid] == _generate(model, ids), uid
