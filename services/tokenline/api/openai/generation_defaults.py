"""Sampling defaults from the model's generation config, as ``vllm serve`` applies them.

Models ship recommended sampling values in ``generation_config.json`` (Qwen3: temperature 0.6,
top_p 0.95, top_k 20). With ``--generation-config auto`` (the default, vLLM's) a request that
leaves one of those fields out gets the model's value; a value the request sends always wins.
``vllm`` ignores the file (the API's own defaults), a directory reads its
``generation_config.json`` instead, and ``--override-generation-config`` (JSON) sets values over
either.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenline.model_source import generation_config
from tokenline.settings import Settings

log = logging.getLogger(__name__)

# the generation config's names, which are the request fields they stand in for
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_BOUNDS = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (-1, 2**31 - 1),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 100.0),
}


def request_defaults(settings: Settings) -> dict[str, Any]:
    """The sampling values a request gets for the fields it leaves out. Raises SystemExit,
    naming the flag, for a config that cannot be read or a value out of its field's range."""
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
    if settings.override_generation_config:
        try:
            overrides = json.loads(settings.override_generation_config)
        except ValueError as exc:
            raise SystemExit(f"--override-generation-config is not JSON ({exc})") from None
        unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
        if not isinstance(overrides, dict) or unknown:
            raise SystemExit(
                f"--override-generation-config sets {unknown or overrides!r}; it takes a JSON "
                f"object of {', '.join(SAMPLING_KEYS)}"
            )
        defaults.update(overrides)
    for key, value in defaults.items():
        low, high = _BOUNDS[key]
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not low <= value <= high:
            raise SystemExit(
                f"the generation config's {key} is {value!r}; it must be in {low}..{high}"
            )
    if defaults:
        log.info("request defaults from the generation config (%s): %s", source, defaults)
    return defaults
