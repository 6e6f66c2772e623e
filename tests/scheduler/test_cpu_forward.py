"""The forward on CPU: projections in oneDNN's packed layout, the dtype ``auto`` picks, and
greedy tokens that stay transformers' in bfloat16 as in float32.

A real model's decode step reads every weight once, so how its GEMMs stream the weights decides
the step's time (benchmarks/README.md, "The forward at real sizes"); these tests hold the fast
path in place and its answers exact.
"""

from __future__ import annotations

import json

import pytest
import torch
from scheduler_testkit import FAMILIES, MOE, family_runner, saved_family_model

from tokenline.model_source import ModelSource
from tokenline.protocol import SamplingParams
from tokenline.scheduler import runner as runner_module
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.models import base as models_base
from tokenline.scheduler.runner import checkpoint_dtype, pick_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _projections(model) -> list:
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    return [attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj, model.lm_head]


@pytest.fixture(params=["cache-sized", "past-the-caches"])
def model_size(request, monkeypatch) -> str:
    """The tests' models are small; past the caches is where the threshold says it is."""
    if request.param == "past-the-caches":
        monkeypatch.setattr(models_base, "CACHE_SIZED_WEIGHTS", 0)
    return request.param


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied-head"])
def test_a_dense_models_projections_and_lm_head_are_packed_for_onednn(tied, model_size, tmp_path):
    config, module, extra = FAMILIES["llama"]
    saved_family_model((config, module, {**extra, "tie_word_embeddings": tied}), tmp_path)
    model = family_runner("llama", tmp_path).model
    one, two = torch.zeros(1, 64), torch.zeros(2, 64)
    for projection in _projections(model):
        if model_size == "cache-sized":  # plain for one row, packed from two
            assert not projection.weight_for(one).is_mkldnn
            assert projection.weight_for(two).is_mkldnn
        else:
            assert projection.weight_for(one).is_mkldnn
    if tied:  # the embedding looks up its plain rows; the head reads a packed copy
        assert model.lm_head.packed is not None
    assert not model.model.embed_tokens.weight.is_mkldnn


def test_an_moe_router_keeps_its_plain_weight(tmp_path):
    """Routing picks the top experts of the router's logits: a tie broken another way by
    another kernel would change which experts run, so the router is not repacked."""
    saved_family_model(MOE["qwen3-moe"], tmp_path)
    runner = family_runner("qwen3-moe", tmp_path)
    layer = runner.model.model.layers[0]
    assert not layer.mlp.gate.weight.is_mkldnn and getattr(layer.mlp.gate, "packed", None) is None
    assert layer.self_attn.qkv_proj.packed is not None


def test_moe_experts_are_packed_for_the_cpu_loop(model_size, tmp_path):
    saved_family_model(MOE["qwen3-moe"], tmp_path)
    experts = family_runner("qwen3-moe", tmp_path).model.model.layers[0].mlp.experts
    assert experts.packed13 is not None and experts.packed2 is not None
    assert all(w.is_mkldnn for w in experts.packed13 + experts.packed2)
    if model_size == "past-the-caches":  # held once: the stacked weights are gone
        assert experts.w13.numel() == experts.w2.numel() == 0
    else:  # single rows read the plain stacked weights
        assert experts.packed_from_rows == 2 and experts.w13.numel() > 0


@pytest.mark.parametrize("family", list(MOE))
def test_moe_greedy_tokens_with_packed_experts_are_transformers_tokens(
    family, model_size, tmp_path
):
    model = saved_family_model(MOE[family], tmp_path).eval()
    engine = Engine(
        family_runner(family, tmp_path), EngineLimits(256, max_num_batched_tokens=16), eos_ids=[]
    )
    prompts = {f"p{i}": [(7 * i + j) % 290 + 5 for j in range(9 + 5 * i)] for i in range(3)}
    got = _greedy(engine, prompts, 8)
    for uid, ids in prompts.items():
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )  # fmt: skip
        assert got[uid] == out[0, len(ids) :].tolist(), (family, uid)


def _greedy(engine: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    for uid, ids in prompts.items():
        engine.add(uid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    got: dict[str, list[int]] = {uid: [] for uid in prompts}
    while engine.has_work():
        for out in engine.step():
            got[out.uid] += out.token_ids
    return got


# bfloat16 rounds a logit to 1/128 of its power of two: two tokens whose logits are that close
# are a tie that kernel order breaks, in transformers as here (vLLM's tests compare the same way)
BF16_TIE = 2**-6


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_greedy_tokens_are_transformers_bfloat16_tokens(family, model_size, tmp_path):
    """Equal token for token; where they part, transformers' own logits at that step hold a
    tie of both tokens within bf16 rounding, and the comparison ends there."""
    import transformers

    saved_family_model(FAMILIES[family], tmp_path)
    reference = getattr(transformers, FAMILIES[family][1])
    model = reference.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    runner = family_runner(family, tmp_path, dtype="bfloat16")
    assert runner.model.model.layers[0].mlp.down_proj.weight_for(torch.zeros(2, 64)).is_mkldnn
    engine = Engine(runner, EngineLimits(256, max_num_batched_tokens=16), eos_ids=[])
    prompts = {f"p{i}": [(11 * i + j) % 290 + 5 for j in range(7 + 4 * i)] for i in range(6)}
    got = _greedy(engine, prompts, 10)
    compared = 0
    for uid, ids in prompts.items():
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        want = out.sequences[0, len(ids) :].tolist()
        for step, (ours, theirs) in enumerate(zip(got[uid], want, strict=True)):
            if ours != theirs:
                logits = out.scores[step][0].float()
                gap = (logits[theirs] - logits[ours]).item()
                assert gap <= BF16_TIE * logits[theirs].abs().item(), (family, uid, step, gap)
                break
            compared += 1
    assert compared >= 30, "too few tokens compared before the first tie"


@pytest.mark.parametrize(
    ("device", "checkpoint", "fast_bf16", "picked"),
    [
        (CPU, torch.bfloat16, True, torch.bfloat16),
        (CPU, torch.float16, True, torch.bfloat16),
        (CPU, torch.bfloat16, False, torch.float32),  # emulated bf16 is slower than fp32
        (CPU, torch.float32, True, torch.float32),  # written to be served in fp32
        (CPU, None, True, torch.float32),
        (CUDA, torch.float16, False, torch.float16),
        (CUDA, torch.bfloat16, False, torch.bfloat16),
        (CUDA, torch.float32, False, torch.bfloat16),
    ],
)
def test_dtype_auto(device, checkpoint, fast_bf16, picked, monkeypatch):
    monkeypatch.setattr(runner_module, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert pick_dtype("auto", device, checkpoint) == picked
    assert pick_dtype("float32", device, checkpoint) == torch.float32  # asked: given


def test_the_checkpoint_dtype_is_read_from_its_config(tmp_path):
    saved_family_model(FAMILIES["llama"], tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert checkpoint_dtype(ModelSource(spec="m", path=str(tmp_path))) == torch.float32
    config["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_dtype(ModelSource(spec="m", path=str(tmp_path))) == torch.bfloat16
    assert checkpoint_dtype(ModelSource(spec="m", path=str(tmp_path / "missing"))) is None


@pytest.mark.parametrize(("megabytes", "threads"), [(12, 7), (63, 7), (64, 8), (270, 8)])
def test_default_torch_threads_follow_the_weights_size(megabytes, threads, monkeypatch):
    """A tiny model's step is mostly the other stages' kind of work: they keep a core. A model
    whose weights outgrow the caches streams them every step: every core reads."""
    monkeypatch.setattr(runner_module, "usable_cores", lambda: 8)
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(
        torch.empty(megabytes << 19, dtype=torch.bfloat16, device="meta")
    )
    assert runner_module.default_torch_threads(model) == threads


def test_a_single_core_keeps_one_thread(monkeypatch):
    monkeypatch.setattr(runner_module, "usable_cores", lambda: 1)
    assert runner_module.default_torch_threads(torch.nn.Linear(2, 2)) == 1
