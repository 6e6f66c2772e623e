"""Shared by the LoRA tests: random PEFT adapters written by peft, PEFT's own greedy run as
the reference, and engines with adapters loaded."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenline.scheduler.engine import Engine
from tokenline.scheduler.lora.options import LoraOptions

MAX_TOKENS = 12


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


def peft_model(tiny_source, adapter: Path | None):
    """The tiny model on transformers, with ``adapter`` applied by peft (None: the base)."""
    return peft_model_at(tiny_source.path, adapter)


def peft_model_at(base_path: str, adapter: Path | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
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


def lora_engine(
    make_engine, adapter_dirs: dict[str, Path], max_loras: int = 4, max_rank: int = 16, **kw
) -> Engine:
    """An engine over ``make_engine``'s runner with LoRA on and ``adapter_dirs`` loaded."""
    base = make_engine(**kw)
    engine = Engine(
        base.runner,
        base.limits,
        base.eos_ids,
        base.prefix_caching,
        lora=LoraOptions(max_loras=max_loras, max_rank=max_rank, max_cpu_loras=8),
    )
    for name, path in adapter_dirs.items():
        engine.loras.add(name, str(path))
    return engine
