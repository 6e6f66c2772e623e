"""Batched multi-LoRA serving is exact: for random PEFT adapters written by peft itself (ranks
4 to 16, different target modules, rslora), greedy tokens and every sampled row's logits
through the engine match ``PeftModel`` on transformers, for each adapter alone and for a
mixed batch of four adapters and the base model in the same steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_testkit import (
    MAX_TOKENS,
    lora_engine,
    peft_model,
    peft_model_at,
    reference_run,
    write_adapter,
)
from scheduler_testkit import PROMPTS, assert_idle, drain, greedy

from tokenline.scheduler.engine import Engine

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name → (rank, alpha, target modules, rslora)
ADAPTERS = {
    "qv4": (4, 8, ["q_proj", "v_proj"], False),
    "all16": (16, 32, ALL, True),
    "mlp8": (8, 16, ["gate_proj", "up_proj", "down_proj"], False),
    "ko4": (4, 4, ["k_proj", "o_proj", "down_proj"], False),
}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_source, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        name: write_adapter(tiny_source.path, root / name, seed, *spec)
        for seed, (name, spec) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def prompt_ids(encode) -> dict[str, list[int]]:
    return {f"p{i}": encode(text) for i, text in enumerate(PROMPTS[:3])}


@pytest.fixture(scope="module")
def references(tiny_source, adapter_dirs, prompt_ids, eos_ids) -> dict:
    """(adapter or "", prompt uid) → PEFT's tokens and logits."""
    refs = {}
    for name in ["", *ADAPTERS]:
        model = peft_model(tiny_source, adapter_dirs.get(name))
        for uid, ids in prompt_ids.items():
            refs[(name, uid)] = reference_run(model, ids, eos_ids)
    return refs


def record_logits(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """Every sampled row's logits, by uid, as the engine computes them."""
    seen: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(inputs, spans=()):
        logits, hidden = execute(inputs, spans)
        sampling = [c.seq.uid for c in inputs.chunks if c.samples]
        for uid, row in zip(sampling, logits, strict=True):
            seen.setdefault(uid, []).append(row.clone())
        return logits, hidden

    engine.runner.execute = recording
    return seen


def check(run, logits, requests, references) -> None:
    for uid, (name, prompt) in requests.items():
        tokens, ref_logits = references[(name, prompt)]
        assert run.tokens[uid] == tokens, f"{uid} ({name or 'base'}) diverged from PEFT"
        got = torch.stack(logits[uid])
        torch.testing.assert_close(got, ref_logits, atol=2e-4, rtol=1e-4)


def test_adapters_change_the_output(references, prompt_ids):
    """Guards the next tests: every adapter's greedy tokens differ from the base model's for
    some prompt, so a delta left out would be seen."""
    for name in ADAPTERS:
        assert any(references[(name, p)][0] != references[("", p)][0] for p in prompt_ids), name


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_alone_matches_peft(make_engine, adapter_dirs, references, prompt_ids, name):
    engine = lora_engine(make_engine, adapter_dirs)
    logits = record_logits(engine)
    requests = {}
    for prompt, ids in prompt_ids.items():
        uid = f"{name}-{prompt}"
        engine.add(uid, ids, greedy(MAX_TOKENS), lora=name)
        requests[uid] = (name, prompt)
    check(drain(engine), logits, requests, references)
    assert_idle(engine)


@pytest.mark.parametrize(
    "budget,backend",
    [(2048, "dense-cpu"), (5, "dense-cpu"), (2048, "sdpa"), (5, "flex")],
    ids=["whole", "chunked", "gather", "flex-chunked"],
)
def test_mixed_batch_of_four_adapters_and_base_matches_peft(
    make_engine, adapter_dirs, references, prompt_ids, budget, backend
):
    """Every prompt under every adapter and the base, all in the same steps: decode rows of
    five models share each step, and chunked prefill mixes prompt and decode rows (and the
    GPU's attention backends, gathered and read in place, see the same deltas)."""
    engine = lora_engine(
        make_engine, adapter_dirs, max_num_batched_tokens=budget, attention_backend=backend
    )
    logits = record_logits(engine)
    requests = {}
    for name in ["", *ADAPTERS]:
        for prompt, ids in prompt_ids.items():
            uid = f"{name or 'base'}-{prompt}"
            engine.add(uid, ids, greedy(MAX_TOKENS), lora=name)
            requests[uid] = (name, prompt)
    run = drain(engine)
    check(run, logits, requests, references)
    assert_idle(engine)


def test_adapters_taking_turns_in_two_slots_under_kv_preemption_keep_their_tokens(
    make_engine, adapter_dirs, prompt_ids
):
    """Four adapters through two device slots with a KV pool too small for everyone: slots
    change hands and preempted sequences recompute under their own adapter. The tokens are
    those of a roomy engine with a slot for every adapter (exact against PEFT above), run
    past EOS so that sequences grow into new blocks."""

    def run(**kw):
        engine = lora_engine(make_engine, adapter_dirs, **kw)
        for name in ["", *ADAPTERS]:
            for prompt, ids in prompt_ids.items():
                uid = f"{name or 'base'}-{prompt}"
                engine.add(uid, ids, greedy(24, ignore_eos=True), lora=name)
        drained = drain(engine)
        assert_idle(engine)
        return engine, drained.tokens

    _, roomy = run(max_loras=4)
    tight, tokens = run(max_loras=2, kv_blocks=6)
    assert tight.policy.num_preemptions > 0, "the pool was meant to force preemption"
    assert tokens == roomy


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize(
    ("family", "targets"),
    [
        ("qwen2", ALL),
        ("qwen3", ALL),
        ("mistral", ALL),
        ("gemma3", ALL),
        ("qwen3-moe", ATTENTION),
        ("mixtral", ATTENTION),
    ],
)
def test_adapters_on_other_families_match_peft(family, targets, tmp_path):
    """q/k/v biases (Qwen2), per-head q/k norms after the projections (Qwen3, Gemma 3) and
    Gemma's norms around attention and the MLP take the deltas where PEFT adds them: on the
    linear's output, before anything else. A mixture of experts takes them on its attention
    (its experts are refused, below)."""
    from scheduler_testkit import NATIVE, family_runner, saved_family_model

    from tokenline.scheduler.engine import EngineLimits
    from tokenline.scheduler.lora.options import LoraOptions

    saved_family_model(NATIVE[family], tmp_path / "base")
    adapter = write_adapter(str(tmp_path / "base"), tmp_path / "lora", 3, 8, 16, targets, False)
    runner = family_runner(family, tmp_path / "base")
    engine = Engine(runner, EngineLimits(256), eos_ids=[], lora=LoraOptions(max_rank=8))
    engine.loras.add("x", str(adapter))
    logits = record_logits(engine)
    prompt = [(7 * j) % 290 + 5 for j in range(11)]
    engine.add("lora", prompt, greedy(MAX_TOKENS), lora="x")
    engine.add("base", prompt, greedy(MAX_TOKENS))
    run = drain(engine)
    for uid, path in (("lora", adapter), ("base", None)):
        model = peft_model_at(str(tmp_path / "base"), path)
        tokens, ref_logits = reference_run(model, prompt, [])
        assert run.tokens[uid] == tokens, uid
        torch.testing.assert_close(torch.stack(logits[uid]), ref_logits, atol=2e-4, rtol=1e-4)
    assert run.tokens["lora"] != run.tokens["base"]


def test_an_adapter_of_the_experts_is_refused_with_why(tmp_path):
    import json

    from safetensors.torch import save_file
    from scheduler_testkit import MOE, family_runner, saved_family_model

    from tokenline.scheduler.lora.adapters import LoraError, load_adapter

    saved_family_model(MOE["qwen3-moe"], tmp_path / "base")
    runner = family_runner("qwen3-moe", tmp_path / "base")
    assert sorted(runner.lora_shape.dims) == sorted(ATTENTION)
    adapter = tmp_path / "experts"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    prefix = "base_model.model.model.layers.0.mlp.experts.3.gate_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.ones(4, 64),
            f"{prefix}.lora_B.weight": torch.ones(32, 4),
        },
        adapter / "adapter_model.safetensors",
    )
    with pytest.raises(LoraError, match="targets the experts of a mixture-of-experts layer"):
        load_adapter("experts", adapter, runner.lora_shape, max_rank=8)
