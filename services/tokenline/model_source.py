"""Where a stage finds its model: ``tiny``, a local directory, or a Hugging Face id."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tokenline import tiny_model

log = logging.getLogger(__name__)
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tokenline")


@dataclass(frozen=True)
class ModelSource:
    spec: str  # what the user passed to --model
    path: str  # a local directory or a Hugging Face id, for from_pretrained
    revision: str | None = None
    chat_template: str | None = None  # --chat-template's text, over the model's own

    def load_tokenizer(self):  # -> transformers.PreTrainedTokenizerBase
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.path, revision=self.revision)
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        return tokenizer

    def load_config(self):  # -> transformers.PretrainedConfig
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path, revision=self.revision)

    def max_model_len(self, override: int | None = None) -> int:
        """The context limit: --max-model-len if set, else the model config's.

        A sliding attention window does not shorten it: the layers that slide attend only to
        their window (the runner reads it from each layer), the others to everything.
        """
        if override:
            return override
        config = self.load_config().get_text_config()  # a multimodal model's decoder
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(config, attr, None)
            if value:
                return int(value)
        return 2048

    def eos_token_ids(self) -> list[int]:
        """Every EOS id the model declares, from its generation config and its tokenizer."""
        from transformers import GenerationConfig

        ids: set[int] = set()
        try:
            gen = GenerationConfig.from_pretrained(self.path, revision=self.revision)
            eos = gen.eos_token_id
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:
            pass
        eos = getattr(self.load_config(), "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return sorted(ids)


def resolve(
    model: str,
    cache_dir: str | None = None,
    revision: str | None = None,
    chat_template: str | None = None,
) -> ModelSource:
    """Turn a --model value into something ``from_pretrained`` loads (with ``chat_template``,
    --chat-template's file or text, as its template).

    ``tiny`` is built once into the cache directory; a URI (``hf://``, ``s3://``, ``https://``,
    ``pvc://``, ``oci://``) is fetched once into the cache directory, verified, and read from
    there (tokenline/fetch: every stage of ``serve`` calls this, and the fetch's lock makes
    one of them download while the rest wait); an existing directory is used as is; anything
    else is treated as a Hugging Face id (downloaded into HF_HOME on first use).
    """
    template = template_text(chat_template)
    if model == "tiny":
        path = tiny_model.ensure_cached(cache_dir or DEFAULT_CACHE_DIR)
        return ModelSource(spec=model, path=str(path), chat_template=template)
    if "://" in model:
        path = str(fetched(model, cache_dir))
        return ModelSource(spec=model, path=path, chat_template=template)
    if Path(model).is_dir():
        if not (Path(model) / "config.json").exists():
            raise SystemExit(
                f"--model {model}: the directory has no config.json; point it at a Hugging Face "
                "model directory or use --model tiny"
            )
        return ModelSource(spec=model, path=str(Path(model).resolve()), chat_template=template)
    return ModelSource(spec=model, path=model, revision=revision, chat_template=template)


def template_text(value: str | None) -> str | None:
    """--chat-template as vLLM takes it: a file's path, or the template itself."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise SystemExit(
        f"--chat-template {value}: no such file, and not a template (no {{{{ or {{% in it); "
        "pass a Jinja file's path or the template's text"
    )


def fetched(uri: str, cache_dir: str | None = None) -> Path:
    """Where the model at ``uri`` lies once fetched into ``cache_dir``/models (at once when a
    verified copy is there already). A bad URI or a failed fetch stops the stage with the
    fetch's reason, never a traceback."""
    from tokenline.fetch import FetchError, cache_name, fetch, parse_uri, redact

    try:
        target = Path(cache_dir or DEFAULT_CACHE_DIR) / "models" / cache_name(parse_uri(uri))
        return Path(fetch(uri, target).path)
    except FetchError as exc:
        raise SystemExit(f"--model {redact(uri)}: {exc}") from exc


def _template_of(config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        return "\n".join(t.get("template", "") for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else None


def _model_files(
    model: str, names: tuple[str, ...], cache_dir: str | None, revision: str | None
) -> list[Path]:
    """Those of the model's files ``names`` it has, read without loading a tokenizer or
    weights: from its directory, or from the Hub one by one. Raises OSError."""
    if "://" in model:
        model = str(fetched(model, cache_dir))
    if Path(model).is_dir():
        return [Path(model) / name for name in names if (Path(model) / name).exists()]
    from huggingface_hub import hf_hub_download

    paths = []
    for name in names:
        try:
            paths.append(Path(hf_hub_download(model, name, revision=revision)))
        except Exception:  # a file the repository does not have
            continue
    return paths


def chat_template_text(
    model: str,
    cache_dir: str | None = None,
    revision: str | None = None,
    chat_template: str | None = None,
) -> str | None:
    """The chat template's text, read from the model's files without loading a tokenizer (the
    api reads which tool-call format the model writes from it). None when there is none, or it
    cannot be read (logged)."""
    if chat_template is not None:
        return template_text(chat_template)
    if model == "tiny":
        return tiny_model.CHAT_TEMPLATE
    try:
        for path in _model_files(
            model, ("chat_template.jinja", "tokenizer_config.json"), cache_dir, revision
        ):
            if path.suffix == ".jinja":
                return path.read_text()
            template = _template_of(json.loads(path.read_text()))
            if template:
                return template
    except (OSError, ValueError) as exc:
        log.warning("could not read the chat template of %s: %s", model, exc)
    return None


def generation_config(
    model: str, cache_dir: str | None = None, revision: str | None = None
) -> dict:
    """The model's ``generation_config.json`` ({} when it has none; the tiny model's names no
    sampling values). Raises OSError or ValueError when it is there but cannot be read."""
    if model == "tiny":
        return {}
    paths = _model_files(model, ("generation_config.json",), cache_dir, revision)
    return json.loads(paths[0].read_text()) if paths else {}
