"""The context limit respects a model's sliding attention window: the runner attends over the
whole context, which matches such a model only inside its window."""

from __future__ import annotations

import logging

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from tokenline.model_source import resolve, sliding_window

SMALL = {"num_hidden_layers": 4, "max_position_embeddings": 4096}


def _model_dir(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(
    "config, window",
    [
        (MistralConfig(sliding_window=1024, **SMALL), 1024),
        (MistralConfig(sliding_window=None, **SMALL), None),
        (
            Qwen2Config(use_sliding_window=True, sliding_window=512, max_window_layers=2, **SMALL),
            512,
        ),
        (Qwen2Config(use_sliding_window=False, sliding_window=512, **SMALL), None),
        (LlamaConfig(**SMALL), None),
    ],
    ids=["mistral", "mistral-full", "qwen2-sliding", "qwen2-full", "llama"],
)
def test_sliding_window_is_read_from_each_family(config, window):
    assert sliding_window(config) == window


def test_a_sliding_model_is_limited_to_its_window_with_a_warning(tmp_path, caplog):
    source = resolve(_model_dir(tmp_path, MistralConfig(sliding_window=1024, **SMALL)))
    with caplog.at_level(logging.WARNING, logger="tokenline.model_source"):
        assert source.max_model_len() == 1024
    assert "sliding-window attention (1024 tokens)" in caplog.text


def test_a_longer_max_model_len_than_the_window_is_refused_with_what_to_use(tmp_path):
    source = resolve(_model_dir(tmp_path, MistralConfig(sliding_window=1024, **SMALL)))
    assert source.max_model_len(1000) == 1000
    with pytest.raises(SystemExit, match="use --max-model-len 1024 or less"):
        source.max_model_len(2048)


def test_a_model_without_a_window_keeps_its_own_limit(tmp_path):
    source = resolve(_model_dir(tmp_path, Qwen2Config(use_sliding_window=False, **SMALL)))
    assert source.max_model_len() == 4096
    assert source.max_model_len(8192) == 8192
