"""What a run is asked to do: its targets and the shape of the load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tokenline.loadgen.workload import LengthDist

Endpoint = Literal["completions", "chat"]

ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}


def normalize_base_url(url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` are one server."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


@dataclass
class TargetConfig:
    """One server under load."""

    label: str
    base_url: str
    model: str | None = None  # None: the first model the server lists at /v1/models
    ignore_eos: bool = True  # send `ignore_eos: true` so that max_tokens fixes output length
    extra_body: dict[str, Any] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)  # stopped while other targets are measured


@dataclass
class BenchConfig:
    """The load every target gets; identical for all targets of one run."""

    targets: list[TargetConfig]
    endpoint: Endpoint = "completions"
    num_requests: int = 48
    concurrency: int | None = 16  # None: unbounded (only with a request rate)
    request_rate: float | None = None  # None: closed loop at `concurrency`
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist(32, 32))
    output_len: LengthDist = field(default_factory=lambda: LengthDist(64, 64))
    shared_prefix_len: int = 0  # words every prompt starts with (0: distinct prompts)
    prefix_groups: int = 1  # different shared prefixes, requests spread evenly over them
    turns: int = 1  # user messages per conversation; each request resends the conversation
    reword_rounds: bool = True  # later rounds get new words: a prefix cache must not help
    seed: int = 0
    rounds: int = 1
    warmup: int = 1
    timeout: float = 300.0
    temperature: float | None = None
    include_usage: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if self.shared_prefix_len < 0:
            raise ValueError("the shared prefix length must be 0 or more")
        if self.prefix_groups < 1 or self.turns < 1:
            raise ValueError("prefix groups and turns must be at least 1")
        if self.prefix_groups > 1 and not self.shared_prefix_len:
            raise ValueError("prefix groups need a shared prefix length")
        if self.turns > 1 and self.endpoint != "chat":
            raise ValueError("a conversation (turns > 1) needs the chat endpoint")
        if self.num_requests % self.turns:
            raise ValueError(
                f"{self.num_requests} requests do not make whole conversations of {self.turns}"
            )

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary of the load (targets are recorded separately)."""
        return {
            "endpoint": self.endpoint,
            "num_requests": self.num_requests,
            "concurrency": self.concurrency,
            "request_rate": self.request_rate,
            "prompt_len": str(self.prompt_len),
            "output_len": str(self.output_len),
            "shared_prefix_len": self.shared_prefix_len,
            "prefix_groups": self.prefix_groups,
            "turns": self.turns,
            "reword_rounds": self.reword_rounds,
            "seed": self.seed,
            "rounds": self.rounds,
            "warmup": self.warmup,
            "timeout": self.timeout,
            "temperature": self.temperature,
            "include_usage": self.include_usage,
            "targets": [
                {
                    "label": t.label,
                    "base_url": t.base_url,
                    "ignore_eos": t.ignore_eos,
                    "extra_body": t.extra_body,
                }
                for t in self.targets
            ],
        }
