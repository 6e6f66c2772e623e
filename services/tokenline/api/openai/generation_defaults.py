"""Sampling defaults from the model's generation config, as ``vllm serve`` applies them.

Models ship recommended sampling values in ``generation_config.json`` (Qwen3: temperature 0.6,
top_p 0.95, top_k 20). With ``--generation-config auto`` (the default, vLLM's) a request that
leaves one of those fields out gets the model's value; a value the request sends always wins.
``vllm`` ignores the file (the API's own defaults), a directory reads its
``generation_config.json`` instead, and ``--override-generation-config`` (JSON) sets values over
either. ``max_new_tokens`` is transformers' name for a request's ``max_tokens``: the default of
a request that sends none, and, as vLLM 0.32 reads it, a cap on every request's when it comes
from a directory's file or from the override (never from the model's own file under auto).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenline.model_source import generation_config
from tokenline.settings import Settings

log = logging.getLogger(__name__)

# the generation config's names: the request fields they stand in for, and max_new_tokens
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_new_tokens",
)
_BOUNDS = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (-1, 2**31 - 1),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 100.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "max_new_tokens": (1, 2**31 - 1),
}


@dataclass(frozen=True)
class GenerationDefaults:
    """``values``: request field -> what a request that leaves it out gets (``max_tokens``
    for the config's max_new_tokens); ``max_tokens_cap``: no request runs past it."""

    values: dict[str, Any] = field(default_factory=dict)
    max_tokens_cap: int | None = None

    def max_tokens(self, sent: int | None) -> int | None:
        """A request's max_tokens (None: to the end of the context) for the one it sent."""
        wanted = self.values.get("max_tokens") if sent is None else sent
        if self.max_tokens_cap is None:
            return wanted
        return self.max_tokens_cap if wanted is None else min(wanted, self.max_tokens_cap)


def request_defaults(settings: Settings) -> GenerationDefaults:
    """What a request gets for the fields it leaves out. Raises SystemExit, naming the flag,
    for a config that cannot be read or a value out of its field's range."""
    source = settings.generation_config
    try:
        if source == "vllm":
            config: dict = {}
        elif source == "auto":
            config = generation_config(settings.model, settings.model_cache_dir, settings.revision)
        else:
            path = Path(source) / "generation_config.json"
            config = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--generation-config {source}: cannot read it ({exc})") from None
    defaults = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    overrides: dict = {}
    if settings.override_generation_config:
        try:
            overrides = json.loads(settings.override_generation_config)
        except ValueError as exc:
            raise SystemExit(f"--override-generation-config is not JSON ({exc})") from None
        unknown = sorted(set(overrides) - set(SAMPLING_KEYS)) if isinstance(overrides, dict) else []
        if not isinstance(overrides, dict) or unknown:
            raise SystemExit(
                f"--override-generation-config sets {unknown or overrides!r}; it takes a JSON "
                f"object of {', '.join(SAMPLING_KEYS)}"
            )
        defaults.update(overrides)
        # null unsets a value of the file's (vLLM's way to lift a model's max_new_tokens)
        defaults = {key: value for key, value in defaults.items() if value is not None}
    for key, value in defaults.items():
        low, high = _BOUNDS[key]
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if key == "max_new_tokens":
            number = isinstance(value, int) and not isinstance(value, bool)
        if not number or not low <= value <= high:
            raise SystemExit(
                f"the generation config's {key} is {value!r}; it must be in {low}..{high}"
            )
    # vLLM's override_max_tokens: a directory's file caps every request; under auto and vllm
    # only the override does, and the model's own max_new_tokens is a default alone
    capping = defaults if source not in ("auto", "vllm") else overrides
    cap = capping.get("max_new_tokens")
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults:
        log.info("request defaults from the generation config (%s): %s", source, defaults)
    if cap is not None:
        log.info("no request runs past %d tokens (the generation config's max_new_tokens)", cap)
    return GenerationDefaults(defaults, cap)
