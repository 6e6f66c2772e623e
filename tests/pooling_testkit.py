"""Random-weight pooling models written by the tests, over the tiny model's tokenizer: a
Qwen3-Embedding-style decoder saved as sentence-transformers saves one (a headless
``Qwen3Model`` with ``modules.json`` and its pooling config) and a Qwen3 cross-encoder
(``Qwen3ForSequenceClassification``, one label)."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
ST_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens"}


def _config(tokenizer, **extra):
    from transformers import Qwen3Config

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return Qwen3Config(vocab_size=len(tokenizer), pad_token_id=pad, **CONFIG, **extra)


def write_embedder(tiny_dir: Path, out: Path, mode: str = "LAST", normalize: bool = True) -> Path:
    """A Qwen3-Embedding-style decoder at ``out``: sentence-transformers' layout, ``mode``
    pooling (LAST or MEAN), a Normalize module when ``normalize``."""
    import torch
    from transformers import AutoTokenizer, Qwen3Model

    if (out / "modules.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    torch.manual_seed(1)
    model = Qwen3Model(_config(tokenizer, matryoshka_dimensions=[16, 32, 64]))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules))
    pooling = {"word_embedding_dimension": CONFIG["hidden_size"]}
    pooling |= {key: False for key in ("pooling_mode_cls_token", "pooling_mode_max_tokens")}
    pooling |= {value: key == mode for key, value in ST_MODES.items()}
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    return out


def write_cross_encoder(tiny_dir: Path, out: Path) -> Path:
    """A Qwen3 cross-encoder at ``out``: ``Qwen3ForSequenceClassification`` with one label."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForSequenceClassification

    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    torch.manual_seed(2)
    model = Qwen3ForSequenceClassification(_config(tokenizer, num_labels=1))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
