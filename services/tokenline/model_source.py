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

        self.refuse_own_code()
        tokenizer = AutoTokenizer.from_pretrained(self.path, revision=self.revision)
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        return tokenizer

    def load_config(self):  # -> transformers.PretrainedConfig
        from transformers import AutoConfig

        self.refuse_own_code()
        return AutoConfig.from_pretrained(self.path, revision=self.revision)

    def refuse_own_code(self) -> None:
        """Stop the stage (SystemExit, no traceback) when the model needs code of its own,
        which is never run; a config.json that cannot be read is left to the load to report."""
        from transformers import PretrainedConfig

        try:
            config, _ = PretrainedConfig.get_config_dict(self.path, revision=self.revision)
        except (OSError, ValueError):
            return
        refusal = own_code_refusal(config)
        if refusal:
            raise SystemExit(f"--model {self.spec}: {refusal}")

    def max_model_len(self, override: int | None = None) -> int:
        """The context limit: --max-model-len if set, else the model config's.

        A sliding attention window does not shorten it: the layers that slide attend only to
        their window (the runner reads it from each layer), the others to everything.
        """
        if override:
            return override
        config = self.load_config().get_text_config()  # a multimodal model's decoder
        exact = positions_computed_alike(config)
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(config, attr, None)
            if value:
                if exact is not None and exact < int(value):
                    log.warning(
                        "%s: serving %d positions, not %d: its rope frequencies change with a "
                        "sequence's length past that (see positions_computed_alike)",
                        self.spec,
                        exact,
                        int(value),
                    )
                    return exact
                return int(value)
        return exact or 2048

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


def positions_computed_alike(config) -> int | None:
    """How many positions a model's rotary embedding computes the same whatever else a step
    holds; None: all of them.

    transformers' ``dynamic`` and ``longrope`` rope types choose their frequencies from the
    longest position of each forward call (past ``max_position_embeddings``, and past
    ``original_max_position_embeddings``): a sequence run alone gets its own length's, while a
    batched step, a chunk of a prompt or a prefix computed for another request would get
    another's. Up to this many positions the frequencies never change, so a model is served
    exactly within them; the scheduler refuses a longer --max-model-len.
    """
    params = getattr(config, "rope_parameters", None) or {}
    by_type = [params] if "rope_type" in params else [p for p in params.values() if p]
    limits = []
    for rope in by_type:
        kind = rope.get("rope_type", "default")
        if "dynamic" in kind:  # transformers' own test of the type
            limits.append(int(config.max_position_embeddings))
        elif kind == "longrope":
            limits.append(int(rope["original_max_position_embeddings"]))
    return min(limits) if limits else None


#: The architectures tokenline runs with modules of its own (scheduler/models' NATIVE, which a
#: test keeps this the same as), named when a model is refused.
NATIVE_ARCHITECTURES = (
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


def own_code_refusal(config: dict) -> str | None:
    """Why the model of ``config`` (config.json's contents) cannot be served without running
    its own code, which tokenline never does; None when tokenline or transformers has a module
    for it (whether that module then runs it exactly is the scheduler's check)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    named = config.get("architectures") or []
    architecture = named[0] if named else "(no architectures)"
    model_type = config.get("model_type")
    known_type = model_type in CONFIG_MAPPING_NAMES
    # dir() lists transformers' classes without importing each one's module; with no
    # architecture named, the model_type's own class is the one loaded
    known_architecture = (
        not named or architecture in NATIVE_ARCHITECTURES or architecture in dir(transformers)
    )
    if known_type and known_architecture:
        return None
    auto_map = config.get("auto_map")
    if auto_map:
        why = (
            f"{architecture} (model_type {model_type!r}) needs the model's own code (config.json's "
            "auto_map), and tokenline never runs a model's own code: --trust-remote-code is "
            "accepted but runs none"
        )
    else:
        why = (
            f"{architecture} (model_type {model_type!r}) is not a model transformers "
            f"{transformers.__version__} knows, and tokenline has no module for it"
        )
    return (
        f"{why}. tokenline serves {', '.join(NATIVE_ARCHITECTURES)} with its own modules, and "
        "the other decoders transformers ships with transformers' modules (--model-impl "
        "transformers); serve one of those, or a checkpoint converted to one"
    )


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


def special_tokens(
    model: str, cache_dir: str | None = None, revision: str | None = None
) -> dict[str, int]:
    """The model's special added tokens, text to id, read from its tokenizer files without
    loading a tokenizer (the api writes a tool-call marker that is one as that exact token).
    {} when there are none, or they cannot be read (logged)."""
    if model == "tiny":
        return {}  # its tool-call markers are text
    try:
        for path in _model_files(
            model, ("tokenizer.json", "tokenizer_config.json"), cache_dir, revision
        ):
            data = json.loads(path.read_text())
            if path.name == "tokenizer.json":
                added = data.get("added_tokens") or []
            else:  # a slow tokenizer's files: added_tokens_decoder, keyed by id
                decoder = data.get("added_tokens_decoder") or {}
                added = [{**token, "id": int(i)} for i, token in decoder.items()]
            found = {t["content"]: int(t["id"]) for t in added if t.get("special")}
            if added:
                return found
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("could not read the special tokens of %s: %s", model, exc)
    return {}


def generation_config(
    model: str, cache_dir: str | None = None, revision: str | None = None
) -> dict:
    """The model's ``generation_config.json`` ({} when it has none; the tiny model's names no
    sampling values). Raises OSError or ValueError when it is there but cannot be read."""
    if model == "tiny":
        return {}
    paths = _model_files(model, ("generation_config.json",), cache_dir, revision)
    return json.loads(paths[0].read_text()) if paths else {}
