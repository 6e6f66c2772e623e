"""``--speculative-config``: vLLM's JSON, read once at start into a `SpeculativeConfig`.

Only what tokenline runs is accepted: a method it does not have, or a key it would ignore, is
refused at start with what to do instead, never served as something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenline.protocol import SamplingParams

METHODS = ("ngram", "draft_model", "eagle3")
# vLLM's methods that need a model next to the target; refused here with this reason
NOT_YET = {
    "eagle": "EAGLE heads",
    "medusa": "Medusa heads",
    "mtp": "multi-token-prediction layers",
    "deepseek_mtp": "multi-token-prediction layers",
}
_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
}
_DRAFT_KEYS = {"method", "model", "num_speculative_tokens", "disable_by_batch_size"}
MAX_SPECULATIVE_TOKENS = 16
_MODEL_OF = {
    "draft_model": "the draft model (a smaller model with the target's vocabulary)",
    "eagle3": "the EAGLE-3 head (trained for the target)",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    # vLLM's: no proposals while more sequences than this run (None: at any batch size)
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model, eagle3: the draft's or head's path or HF id


def parse(text: str | None) -> SpeculativeConfig | None:
    """The config a ``--speculative-config`` value asks for; None when it is unset or empty.
    Raises ValueError naming the key at fault."""
    if not text or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--speculative-config is not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError('--speculative-config must be a JSON object, e.g. {"method": "ngram"}')
    method = raw.get("method", "ngram" if "prompt_lookup_max" in raw else None)
    if method in NOT_YET:
        raise ValueError(
            f"--speculative-config method {method!r} needs {NOT_YET[method]}, which tokenline "
            'does not run; use {"method": "ngram", "num_speculative_tokens": 4}'
        )
    if method not in METHODS:
        raise ValueError(
            f"--speculative-config method {method!r} is unknown; use one of {list(METHODS)}"
        )
    keys = _KEYS if method == "ngram" else _DRAFT_KEYS
    unknown = sorted(set(raw) - keys)
    if unknown:
        raise ValueError(
            f"--speculative-config keys {unknown} are not used by the {method} method; "
            f"it takes {sorted(keys)}"
        )
    model = raw.get("model")
    if method != "ngram" and (not isinstance(model, str) or not model):
        raise ValueError(
            f'--speculative-config method "{method}" needs "model": {_MODEL_OF[method]}\'s '
            "path or Hugging Face id"
        )
    tokens = _count(raw, "num_speculative_tokens", None)
    if tokens is None:
        raise ValueError("--speculative-config needs num_speculative_tokens, e.g. 4")
    if not 1 <= tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"--speculative-config num_speculative_tokens {tokens}: use 1 to "
            f"{MAX_SPECULATIVE_TOKENS}"
        )
    # vLLM's defaults: either bound stands for the other; neither, 5
    low = _count(raw, "prompt_lookup_min", None)
    high = _count(raw, "prompt_lookup_max", None)
    low, high = (low or high or 5), (high or low or 5)
    if not 1 <= low <= high:
        raise ValueError(
            f"--speculative-config prompt_lookup_min {low} and prompt_lookup_max {high}: "
            "need 1 <= min <= max"
        )
    most = _count(raw, "disable_by_batch_size", None)
    if most is not None and most < 1:
        raise ValueError(f"--speculative-config disable_by_batch_size {most}: use 1 or more")
    return SpeculativeConfig(method, tokens, low, high, most, model)


def _count(raw: dict, key: str, default: int | None) -> int | None:
    value = raw.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"--speculative-config {key} must be an integer, not {value!r}")
    return value


def speculation_serves(sampling: SamplingParams) -> bool:
    """Whether a request's tokens may be proposed and verified several at a time. Not with a
    grammar (its mask follows each token) nor with penalties (they count each row's output):
    those requests take one token per step, beside speculating ones."""
    return (
        sampling.grammar is None
        and sampling.repetition_penalty == 1.0
        and not sampling.frequency_penalty
        and not sampling.presence_penalty
    )
