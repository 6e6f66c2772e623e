"""What a checkpoint's config says beyond its architecture's name decides how it is computed,
as it does in transformers:

- transformers chooses a model's code by config.json's ``model_type``; a checkpoint that names
  a native class over another model_type (Mistral's window, Granite's multipliers) is that
  other model, and runs on transformers' modules;
- a checkpoint that stores an LM head unlike its embedding keeps that head, even where the
  config ties the two (transformers warns and does not tie them);
- rope types whose frequencies follow each forward call's longest sequence (``dynamic``,
  ``longrope``) are served only as far as those frequencies stay fixed.

Each case is a small random checkpoint written here; the oracle is transformers' own model of
it, loaded by ``AutoModelForCausalLM`` as any user of transformers would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from scheduler_testkit import FAMILIES, family_runner, generate_greedy, saved_family_model

from tokenline.model_source import ModelSource, positions_computed_alike
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner, RunnerOptions

MAX_TOKENS = 10
# longer than the window the edited configs set, so a window read or ignored shows; with their
# tokens, within the shortest context served here (32)
PROMPTS = {f"p{i}": [(5 * i + 7 * j) % 290 + 5 for j in range(10 + 4 * i)] for i in range(3)}


def _tokens(runner: ModelRunner) -> dict[str, list[int]]:
    """Greedy tokens of PROMPTS in one batch, prefilled in 16-token chunks beside decodes."""
    limits = EngineLimits(runner.max_model_len, max_num_batched_tokens=16)
    engine = Engine(runner, limits, eos_ids=[])
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for uid, ids in PROMPTS.items():
        engine.add(uid, ids, sampling)
    got: dict[str, list[int]] = {uid: [] for uid in PROMPTS}
    while engine.has_work():
        for out in engine.step():
            got[out.uid] += out.token_ids
    return got


def _transformers_tokens(path: Path) -> dict[str, list[int]]:
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return {uid: generate_greedy(reference, ids, MAX_TOKENS) for uid, ids in PROMPTS.items()}


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _refusal(path: Path, model_impl: str = "auto", max_model_len: int | None = None) -> str:
    with pytest.raises(SystemExit) as refused:
        _runner(path, model_impl, max_model_len)
    return str(refused.value)


def _runner(path: Path, model_impl: str = "auto", max_model_len: int | None = None):
    return ModelRunner(
        ModelSource(spec=path.name, path=str(path)),
        RunnerOptions(
            device="cpu",
            dtype="float32",
            kv_cache_memory=2**20,
            torch_threads=1,
            model_impl=model_impl,
            max_model_len=max_model_len,
        ),
    )


# ── model_type, not the architecture's name ───────────────────────────────────────────────────
OTHER_MODEL_TYPES = {
    # Mistral slides every layer's attention; Llama's module would attend to everything
    "llama-named-mistral": ("llama", {"model_type": "mistral", "sliding_window": 8}),
    # Granite scales embeddings, scores, residuals and logits
    "llama-named-granite": (
        "llama",
        {
            "model_type": "granite",
            "embedding_multiplier": 12.0,
            "attention_multiplier": 0.1,
            "residual_multiplier": 0.2,
            "logits_scaling": 8.0,
        },
    ),
}


@pytest.mark.parametrize("case", sorted(OTHER_MODEL_TYPES))
def test_a_native_class_over_another_model_type_runs_as_that_model(case, tmp_path):
    family, changes = OTHER_MODEL_TYPES[case]
    saved_family_model(FAMILIES[family], tmp_path)
    _edit_config(tmp_path, **changes)
    runner = family_runner(family, tmp_path)
    assert runner.model.implementation == "transformers"
    assert _tokens(runner) == _transformers_tokens(tmp_path)
    message = _refusal(tmp_path, "tokenline")
    assert f"model_type is {changes['model_type']!r}" in message


def test_each_native_module_claims_the_model_type_transformers_gives_its_class():
    """The check above refuses no family's own checkpoints."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tokenline.scheduler.models import NATIVE

    for name, cls in NATIVE.items():
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cls.model_type] == name


# ── a stored head unlike the tied embedding ───────────────────────────────────────────────────
@pytest.mark.parametrize("distinct", [True, False], ids=["distinct-head", "same-head"])
def test_a_stored_lm_head_unlike_the_embedding_is_used_as_transformers_does(distinct, tmp_path):
    config_name, model_name, extra = FAMILIES["llama"]
    saved_family_model((config_name, model_name, {**extra, "tie_word_embeddings": True}), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    torch.manual_seed(1)
    head = torch.randn_like(embedding) * 3 if distinct else embedding.clone()
    weights["lm_head.weight"] = head
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    runner = family_runner("llama", tmp_path)
    assert runner.model.implementation == "tokenline"
    assert (runner.model.lm_head.tied is None) is distinct
    assert _tokens(runner) == _transformers_tokens(tmp_path)


# ── rope frequencies that follow the longest sequence ─────────────────────────────────────────
LONG_ROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + i / 16 for i in range(8)],
    "long_factor": [2.0 + i / 4 for i in range(8)],
    "original_max_position_embeddings": 32,
    "rope_theta": 10_000.0,
}
DYNAMIC_ROPE = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0}


@pytest.mark.parametrize(
    ("rope", "trained", "alike"),
    [(DYNAMIC_ROPE, 48, 48), (LONG_ROPE, 128, 32)],
    ids=["dynamic", "longrope"],
)
def test_rope_that_follows_the_longest_sequence_is_served_where_it_stays_fixed(
    rope, trained, alike, tmp_path
):
    """Past ``alike`` positions a short request batched with a long one would be rotated with
    the long one's frequencies: the context stops there by default, and a longer
    --max-model-len is refused with the one that works."""
    config_name, model_name, extra = FAMILIES["llama"]
    spec = (config_name, model_name, {**extra, "rope_parameters": rope})
    saved_family_model(spec, tmp_path)
    _edit_config(tmp_path, max_position_embeddings=trained)
    source = ModelSource(spec="rope", path=str(tmp_path))
    assert positions_computed_alike(source.load_config()) == alike
    assert source.max_model_len() == alike
    runner = _runner(tmp_path)
    assert runner.max_model_len == alike
    assert _tokens(runner) == _transformers_tokens(tmp_path)
    message = _refusal(tmp_path, max_model_len=alike + 1)
    assert f"--max-model-len {alike} or less" in message
    assert _runner(tmp_path, max_model_len=alike // 2).max_model_len == alike // 2


def test_fixed_rope_types_keep_the_whole_context(tmp_path):
    config_name, model_name, extra = FAMILIES["llama"]
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0}
    saved_family_model((config_name, model_name, {**extra, "rope_parameters": rope}), tmp_path)
    source = ModelSource(spec="linear", path=str(tmp_path))
    assert positions_computed_alike(source.load_config()) is None
    assert source.max_model_len() == 256
