"""What a checkpoint asks of pooling, read once at start: whether it pools at all (``--runner
auto``), what it computes (``--convert auto``: embed or classify) and how (``--pooler-config``,
else its sentence-transformers files, else the family's default).

A sentence-transformers checkpoint says it in ``modules.json`` (a ``Pooling`` module, maybe a
``Normalize`` one) and the pooling module's ``config.json`` (``pooling_mode_lasttoken``,
``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``). Without them a decoder pools its
last token and an encoder its first ([CLS]), normalised, as vLLM does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenline.model_source import ModelSource
from tokenline.settings.pooling import parse_pooler_config

log = logging.getLogger(__name__)

HEADLESS_SUFFIX = "Model"  # BertModel, Qwen3Model: no LM head, nothing but hidden states
CLASSIFY_SUFFIX = "ForSequenceClassification"
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "modernbert")
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


@dataclass(frozen=True)
class PoolingSetup:
    """How the scheduler pools: ``task`` (embed or classify), ``pooling_type`` (LAST, MEAN,
    CLS), whether embeddings are normalised, and whether the model is a bidirectional encoder
    (run whole, encoder.py) rather than a decoder (paged and chunked, engine.py)."""

    task: str
    pooling_type: str
    normalize: bool
    encoder: bool
    architecture: str
    # Matryoshka: the dimensions requests may ask for; None: any; []: the model is none
    matryoshka: list[int] | None


@dataclass(frozen=True)
class SentenceTransformersConfig:
    pooling_type: str | None  # None: a mode tokenline does not serve (max, weighted mean)
    normalize: bool


def sentence_transformers_config(root: Path) -> SentenceTransformersConfig | None:
    """The checkpoint's sentence-transformers pooling, None when it has no ``modules.json``."""
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
    if pooling is None:
        return SentenceTransformersConfig(None, normalize)
    config_file = root / pooling.get("path", "") / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    modes = [kind for key, kind in _ST_MODES.items() if config.get(key)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
    if len(modes) != 1 or len(others) != 1:
        return SentenceTransformersConfig(None, normalize)
    return SentenceTransformersConfig(modes[0], normalize)


def _local_root(source: ModelSource) -> Path | None:
    root = Path(source.path)
    if root.is_dir():
        return root
    try:  # a Hugging Face id: the two small files, when the repository has them
        from huggingface_hub import snapshot_download

        allow = ["modules.json", "*/config.json", "config.json"]
        return Path(snapshot_download(source.path, revision=source.revision, allow_patterns=allow))
    except Exception:  # offline, or no such files: the family's defaults apply
        return None


def runner_of(requested: str, source: ModelSource) -> str:
    """``--runner``: ``generate`` or ``pooling``; ``auto`` reads the architecture and files."""
    if requested != "auto":
        return requested
    try:
        config = source.load_config()
    except (ValueError, KeyError, OSError):
        return "generate"  # the generating runner refuses it with the reason
    architecture = (getattr(config, "architectures", None) or [""])[0]
    if architecture.endswith((CLASSIFY_SUFFIX, HEADLESS_SUFFIX)):
        return "pooling"
    root = _local_root(source)
    if root is not None and (root / "modules.json").is_file():
        return "pooling"
    return "generate"


def resolve_setup(source: ModelSource, convert: str, pooler_config: str | None) -> PoolingSetup:
    """The pooling the model is served with; raises SystemExit naming what is wrong."""
    config = source.load_config()
    architecture = (getattr(config, "architectures", None) or [""])[0]
    task = convert
    if task == "auto":
        task = "classify" if architecture.endswith(CLASSIFY_SUFFIX) else "embed"
    encoder = getattr(config, "model_type", "") in ENCODER_TYPES
    overrides = parse_pooler_config(pooler_config)
    st = None
    root = _local_root(source)
    if root is not None and task == "embed":
        st = sentence_transformers_config(root)
    if st is not None and st.pooling_type is None and "pooling_type" not in overrides:
        raise SystemExit(
            f"{source.spec}: its sentence-transformers pooling is not one tokenline serves "
            "(LAST, MEAN or CLS); set --pooler-config to choose one"
        )
    pooling_type = (st.pooling_type if st else None) or ("CLS" if encoder else "LAST")
    normalize = st.normalize if st is not None else task == "embed"
    pooling_type = str(overrides.get("pooling_type", pooling_type)).upper()
    normalize = bool(overrides.get("normalize", normalize))
    matryoshka: list[int] | None = []
    if getattr(config, "matryoshka_dimensions", None):
        matryoshka = [int(d) for d in config.matryoshka_dimensions]
    elif getattr(config, "is_matryoshka", False):
        matryoshka = None
    setup = PoolingSetup(task, pooling_type, normalize, encoder, architecture, matryoshka)
    log.info("pooling: %s", setup)
    return setup
