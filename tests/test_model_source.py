"""The context limit is the model's own, or --max-model-len; a sliding attention window does
not shorten it (the runner applies the window per layer: tests/scheduler/test_model_families)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from tokenline.model_source import resolve

SMALL = {"num_hidden_layers": 4, "max_position_embeddings": 4096}


def _model_dir(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(
    "config",
    [
        MistralConfig(sliding_window=1024, **SMALL),
        Qwen2Config(use_sliding_window=True, sliding_window=512, max_window_layers=2, **SMALL),
        Qwen2Config(use_sliding_window=False, **SMALL),
        LlamaConfig(**SMALL),
    ],
    ids=["mistral-sliding", "qwen2-sliding", "qwen2-full", "llama"],
)
def test_the_limit_is_the_models_positions_window_or_not(tmp_path, config):
    source = resolve(_model_dir(tmp_path, config))
    assert source.max_model_len() == 4096
    assert source.max_model_len(2048) == 2048


def test_the_chat_template_is_read_without_loading_a_tokenizer(tmp_path):
    import json

    from tokenline import tiny_model
    from tokenline.model_source import chat_template_text

    assert chat_template_text("tiny") == tiny_model.CHAT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert chat_template_text(str(tmp_path)) == "{{ messages }}"
    named = [{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert chat_template_text(str(tmp_path)) == "A\nB"
    (tmp_path / "chat_template.jinja").write_text("<tool_call>")
    assert chat_template_text(str(tmp_path)) == "<tool_call>"
    assert chat_template_text(str(tmp_path / "missing")) is None
