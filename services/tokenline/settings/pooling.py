"""Embeddings and reranking: whether the scheduler generates or pools (vLLM's ``--runner``),
what a pooling model computes (vLLM's ``--convert``) and how it pools (vLLM's
``--pooler-config``). ``auto`` reads the checkpoint (scheduler/pooling/config.py).
"""

from __future__ import annotations

import argparse
import json

from tokenline.settings.declaration import SCHEDULER, CheckedText, CrdField, Setting

POOLING_TYPES = ("LAST", "MEAN", "CLS")


def parse_pooler_config(text: str | None) -> dict:
    """The keys of a ``--pooler-config`` (empty: none given); raises ArgumentTypeError."""
    if not text:
        return {}
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--pooler-config is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError("--pooler-config must be a JSON object")
    unknown = sorted(set(config) - {"pooling_type", "normalize"})
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--pooler-config: unknown keys {unknown}; tokenline reads pooling_type and normalize"
        )
    kind = config.get("pooling_type")
    if kind is not None and str(kind).upper() not in POOLING_TYPES:
        raise argparse.ArgumentTypeError(
            f"--pooler-config: pooling_type {kind!r}; use one of {', '.join(POOLING_TYPES)}"
        )
    if "normalize" in config and not isinstance(config["normalize"], bool):
        raise argparse.ArgumentTypeError("--pooler-config: normalize must be true or false")
    return config


class PoolerConfigText(CheckedText):
    """vLLM's ``--pooler-config`` JSON (``pooling_type``: LAST, MEAN or CLS; ``normalize``),
    checked when read, so a bad one fails at start naming the key, and kept as its text."""

    check = staticmethod(parse_pooler_config)


POOLING: tuple[Setting, ...] = (
    Setting(
        "runner",
        default="auto",
        help="generate text, or pool prompts into embeddings and scores (/v1/embeddings, "
        "/rerank, /score, /classify); auto: pooling for a sequence-classification or headless "
        "(*Model) architecture or a sentence-transformers checkpoint, else generate",
        stages=SCHEDULER,
        crd=CrdField(
            "model.runner",
            "generate (chat and completions) or pooling (embeddings, rerank, score); auto "
            "reads the checkpoint.",
        ),
        choices=("auto", "generate", "pooling"),
    ),
    Setting(
        "convert",
        default="auto",
        help="what a pooling model computes: embed (vectors) or classify (a sequence-"
        "classification head's scores, for /rerank, /score and /classify); auto: classify for a "
        "*ForSequenceClassification architecture, else embed",
        stages=SCHEDULER,
        choices=("auto", "embed", "classify"),
    ),
    Setting(
        "pooler-config",
        PoolerConfigText,
        help='how a pooling model pools, as vLLM takes it: {"pooling_type": "LAST"|"MEAN"|'
        '"CLS", "normalize": true|false}; unset: the checkpoint\'s sentence-transformers '
        "config, else LAST (decoders) or CLS (encoders), normalised",
        stages=SCHEDULER,
    ),
)
