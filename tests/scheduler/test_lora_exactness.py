"""Batched multi-LoRA serving is exact: for random PEFT adapters written by peft itself (ranks
4 to 16, different target modules, rslora), greedy tokens and every sampled row's logits
through the engine match ``PeftModel`` on transformers, for each adapter alone and for a
mixed batch of four adapters and the base model in the same steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scheduler_testkit import PROMPTS, assert_idle, drain, greedy

from tokenline.scheduler.engine import Engine, LoraOptions

MAX_TOKENS = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name → (rank, alpha, target modules, rslora)
ADAPTERS = {
    "qv4": (4, 8, ["q_proj", "v_proj"], False),
    "all16": (16, 32, ALL, True),
    "mlp8": (8, 16, ["gate_proj", "up_proj", "down_proj"], False),
    "ko4": (4, 4, ["k_proj", "o_proj", "down_proj"], False),
}


def write_adapter(base_path: str, out: Path, seed: int, rank, alpha, targets, rslora) -> Path:
    """A random adapter with nonzero A and B, saved by peft in its own format."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,  # B is random too, so the delta is not zero
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)
    return out


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


def peft_model(tiny_source, adapter: Path | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_source.path, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


def reference_run(model, prompt: list[int], eos_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """PEFT's greedy tokens (stopping after an EOS, as the engine does) and the logits that
    chose each of them, from one forward over the prompt and the tokens."""
    with torch.inference_mode():
        ids = list(prompt)
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
            if ids[-1] in eos_ids:
                break
        tokens = ids[len(prompt) :]
        logits = model(input_ids=torch.tensor([ids])).logits[0, len(prompt) - 1 : -1]
    return tokens, logits.float()


@pytest.fixture(scope="module")
def references(tiny_source, adapter_dirs, prompt_ids, eos_ids) -> dict:
    """(adapter or "", prompt uid) → PEFT's tokens and logits."""
    refs = {}
    for name in ["", *ADAPTERS]:
        model = peft_model(tiny_source, adapter_dirs.get(name))
        for uid, ids in prompt_ids.items():
            refs[(name, uid)] = reference_run(model, ids, eos_ids)
    return refs


def lora_engine(make_engine, adapter_dirs, max_loras: int = 4, **kw) -> Engine:
    base = make_engine(**kw)
    engine = Engine(
        base.runner,
        base.limits,
        base.eos_ids,
        base.prefix_caching,
        lora=LoraOptions(max_loras=max_loras, max_rank=16, max_cpu_loras=8),
    )
    for name, path in adapter_dirs.items():
        engine.loras.add(name, str(path))
    return engine


def record_logits(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """Every sampled row's logits, by uid, as the engine computes them."""
    seen: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(prepared, spans=()):
        logits, hidden = execute(prepared, spans)
        sampling = [c.seq.uid for c in prepared.chunks if c.samples]
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


@pytest.mark.parametrize("budget", [2048, 5], ids=["whole", "chunked"])
def test_mixed_batch_of_four_adapters_and_base_matches_peft(
    make_engine, adapter_dirs, references, prompt_ids, budget
):
    """Every prompt under every adapter and the base, all in the same steps: decode rows of
    five models share each step, and chunked prefill mixes prompt and decode rows."""
    engine = lora_engine(make_engine, adapter_dirs, max_num_batched_tokens=budget)
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
