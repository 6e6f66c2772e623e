"""A model that neither path runs exactly is refused at start, with the architecture and the
reason, never half-loaded and never served wrong.

Each case is a small checkpoint written here: weights the native module does not compute with
or lacks, an architecture transformers does not know, features the attention kernels do not
compute (soft-capped scores), layers that keep state of their own (convolutions, state-space
layers), a model that mixes positions outside attention, quantized weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from scheduler_testkit import COMMON, FAMILIES, saved_family_model

from tokenline.model_source import ModelSource
from tokenline.scheduler.runner import ModelRunner, RunnerOptions


def _runner(path: Path, model_impl: str = "auto") -> ModelRunner:
    return ModelRunner(
        ModelSource(spec=path.name, path=str(path)),
        RunnerOptions(device="cpu", dtype="float32", kv_cache_memory=2**20, model_impl=model_impl),
    )


def _refusal(path: Path, model_impl: str = "auto") -> str:
    with pytest.raises(SystemExit) as refused:
        _runner(path, model_impl)
    return str(refused.value)


def _llama(path: Path) -> Path:
    saved_family_model(FAMILIES["llama"], path)
    return path


def _edit_weights(path: Path, edit) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_a_weight_the_native_module_does_not_compute_with_refuses_it(tmp_path):
    """A bias nobody reads would be a model served wrong without a word."""
    path = _llama(tmp_path / "extra")
    _edit_weights(path, lambda w: w.update({"model.layers.0.mlp.down_proj.bias": torch.ones(64)}))
    message = _refusal(path, "tokenline")
    assert "model.layers.0.mlp.down_proj.bias" in message and "does not compute with" in message
    # auto tries transformers' modules too, which leave it unmatched as well
    assert "unexpected_keys" in _refusal(path)


def test_a_weight_the_checkpoint_lacks_refuses_it(tmp_path):
    path = _llama(tmp_path / "missing")
    _edit_weights(path, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    message = _refusal(path, "tokenline")
    assert "model.layers.1.self_attn.qkv_proj.weight" in message and "lacks" in message
    assert "missing_keys" in _refusal(path)


def test_an_architecture_transformers_does_not_know_is_refused(tmp_path):
    path = _llama(tmp_path / "unknown")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="nosuchmodel", architectures=["NoSuchForCausalLM"])
    (path / "config.json").write_text(json.dumps(config))
    assert "nosuchmodel" in _refusal(path)


def test_a_family_without_a_native_module_is_refused_by_the_native_path(tmp_path):
    transformers.Phi3ForCausalLM(
        transformers.Phi3Config(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ).save_pretrained(tmp_path)
    message = _refusal(tmp_path, "tokenline")
    assert "Phi3ForCausalLM has no native module" in message
    assert "--model-impl transformers" in message
    assert _runner(tmp_path).model.implementation == "transformers"


def test_soft_capped_attention_scores_are_refused(tmp_path):
    """Gemma 2 caps every attention score; the attention kernels do not."""
    config = transformers.Gemma2Config(**{**COMMON, "head_dim": 16})
    transformers.Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    message = _refusal(tmp_path)
    assert "Gemma2ForCausalLM" in message and "softcap" in message


def test_layers_that_keep_state_of_their_own_are_refused(tmp_path):
    """LFM2's convolution layers carry state across positions that paged attention does not
    hold."""
    config = transformers.Lfm2Config(**COMMON, layer_types=["conv", "full_attention"])
    transformers.Lfm2ForCausalLM(config).save_pretrained(tmp_path)
    message = _refusal(tmp_path)
    assert "Lfm2ForCausalLM" in message and "1 of its 2 layers" in message


def test_a_model_that_mixes_positions_outside_attention_is_refused(tmp_path, monkeypatch):
    """The start-up check runs two sequences in one step against each alone: a model whose
    hidden states depend on other positions (here: a running sum over the flat batch, as a
    convolution or a recurrent layer would) fails it."""
    from tokenline.scheduler.models.generic import TransformersCausalLM

    path = _llama(tmp_path / "mixing")
    forward = TransformersCausalLM.forward

    def mixing(self, input_ids, context, rows):
        hidden = forward(self, input_ids, context, torch.arange(len(input_ids)))
        return (hidden + 0.1 * hidden.cumsum(0)).index_select(0, rows)

    monkeypatch.setattr(TransformersCausalLM, "forward", mixing)
    message = _refusal(path, "transformers")
    assert "mixes positions" in message


def test_quantized_checkpoints_are_refused(tmp_path):
    path = _llama(tmp_path / "quantized")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    assert "quantized checkpoints (gptq)" in _refusal(path)


def test_lora_needs_a_native_module(tmp_path):
    config = transformers.GraniteConfig(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.GraniteForCausalLM(config).save_pretrained(tmp_path)
    runner = _runner(tmp_path)
    with pytest.raises(SystemExit, match="takes no LoRA adapters"):
        runner.enable_lora(2, 8)
