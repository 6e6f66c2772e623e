"""What bounds an engine: the context, the sequences and tokens of a step, and how long past
its deadline a request is kept."""

from __future__ import annotations

from dataclasses import dataclass

from tokenline.settings import BY_FLAG


@dataclass
class EngineLimits:
    max_model_len: int
    max_num_seqs: int = BY_FLAG["max-num-seqs"].default
    max_num_batched_tokens: int = 2048


DEADLINE_MARGIN_S = 2.0


def default_token_budget(device_type: str) -> int:
    """Per-step token budget: large steps feed a GPU. On CPU a step's time grows with its
    tokens (prefill is compute-bound), and a request that arrives waits for the step in
    flight: 128-token steps measured both faster and kinder to time-to-first-token than 256
    (benchmarks/README.md)."""
    return 2048 if device_type == "cuda" else 128
