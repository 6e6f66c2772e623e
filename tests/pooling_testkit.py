"""Random-weight pooling models written by the tests. Over the tiny model's tokenizer: a
Qwen3-Embedding-style decoder saved as sentence-transformers saves one (a headless
``Qwen3Model`` with ``modules.json`` and its pooling config) and a Qwen3 cross-encoder
(``Qwen3ForSequenceClassification``, one label). Over a WordPiece tokenizer built offline: a
BERT embedder (sentence-transformers' layout, CLS or MEAN pooling), a BERT cross-encoder and a
BERT classifier of several labels (``BertForSequenceClassification``)."""

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
ST_MODES = {
    "LAST": "pooling_mode_lasttoken",
    "MEAN": "pooling_mode_mean_tokens",
    "CLS": "pooling_mode_cls_token",
}


def write_sentence_transformers_files(
    out: Path, mode: str, normalize: bool, dimension: int, max_seq_length: int
) -> None:
    """sentence-transformers' files beside a saved model: ``modules.json`` (Transformer,
    Pooling, Normalize when ``normalize``), ``1_Pooling/config.json`` asking ``mode`` (LAST,
    MEAN or CLS) and ``sentence_bert_config.json``."""
    kinds = ["Transformer", "Pooling"] + (["Normalize"] if normalize else [])
    paths = ["", "1_Pooling", "2_Normalize"]
    modules = [
        {"idx": i, "name": str(i), "path": paths[i], "type": f"sentence_transformers.models.{k}"}
        for i, k in enumerate(kinds)
    ]
    for module in modules[1:]:
        (out / module["path"]).mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules))
    pooling = {"word_embedding_dimension": dimension, "pooling_mode_max_tokens": False}
    pooling |= {value: key == mode for key, value in ST_MODES.items()}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    config = {"max_seq_length": max_seq_length}
    (out / "sentence_bert_config.json").write_text(json.dumps(config))


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
    write_sentence_transformers_files(out, mode, normalize, CONFIG["hidden_size"], 512)
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


# ── BERT-style encoders ──────────────────────────────────────────────────────────────────────────
BERT_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,  # short, so that a test can pass the limit cheaply
    type_vocab_size=2,
)
BERT_WORDS = (
    "the quick brown fox jumps over lazy dog near river in morning light where does sleep "
    "hello world request queue and a of to is it that for on with as was at by this be"
).split()


def bert_tokenizer(vocab_size: int | None = None, max_length: int | None = None):
    """A BERT-style WordPiece tokenizer built offline (``tokenizers``): lower-cased, split on
    punctuation, [CLS] A [SEP] B [SEP] with B's segment 1, unknown words in word pieces;
    grown to ``vocab_size`` pieces (a real model's embedding table) with made-up ones."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,!?'-")
    vocab = [*specials, *letters, *("##" + c for c in letters), *BERT_WORDS, "##s", "##ing"]
    vocab = list(dict.fromkeys(vocab))
    alnum = letters[:36]
    pieces = (f"##{a}{b}{c}" for a in alnum for b in alnum for c in alnum)
    grown = dict.fromkeys(vocab)
    while vocab_size and len(grown) < vocab_size:
        grown.setdefault(next(pieces))
    vocab = list(grown)
    model = models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]")
    tok = Tokenizer(model)
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = vocab.index("[CLS]"), vocab.index("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tok.decoder = decoders.WordPiece()
    limit = max_length or BERT_CONFIG["max_position_embeddings"]
    return BertTokenizerFast(tokenizer_object=tok, model_max_length=limit)


def _bert(model_cls, seed: int, **extra):
    import torch
    from transformers import BertConfig

    tokenizer = bert_tokenizer()
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), pad_token_id=0, **BERT_CONFIG, **extra)
    model = model_cls(config)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)
    return model.eval(), tokenizer


def write_bert_embedder(out: Path, mode: str = "CLS", normalize: bool = True) -> Path:
    """A BERT embedder at ``out`` as sentence-transformers saves one: ``BertModel``,
    ``modules.json`` and ``1_Pooling/config.json`` asking ``mode`` (CLS or MEAN) pooling."""
    from transformers import BertModel

    if (out / "modules.json").exists():
        return out
    model, tokenizer = _bert(BertModel, 3, matryoshka_dimensions=[16, 32, 64])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    limit = BERT_CONFIG["max_position_embeddings"]
    write_sentence_transformers_files(out, mode, normalize, BERT_CONFIG["hidden_size"], limit)
    return out


def write_bert_classifier(out: Path, labels: list[str] | None = None) -> Path:
    """``BertForSequenceClassification`` at ``out``: a cross-encoder (one label) when
    ``labels`` is None, else a classifier of those labels (config.id2label)."""
    from transformers import BertForSequenceClassification

    if (out / "config.json").exists():
        return out
    extra = {"num_labels": 1}
    if labels:
        extra = {
            "num_labels": len(labels),
            "id2label": dict(enumerate(labels)),
            "label2id": {label: i for i, label in enumerate(labels)},
        }
    model, tokenizer = _bert(BertForSequenceClassification, 4 if labels else 5, **extra)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
