"""Results: one record per request, one phase per (target, round), one result per run.

Times are seconds. ``start`` values are offsets from the run's start; ``chunk_times`` are
offsets from the request's own start. All come from ``time.perf_counter``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request as the client saw it."""

    target: str
    round: int
    index: int
    prompt_words: int
    max_tokens: int
    start: float = 0.0
    ttft: float | None = None  # request sent -> first chunk with text
    e2e: float | None = None  # request sent -> end of stream
    output_tokens: int = 0  # from the final `usage` when the server sends one, else `chunks`
    tokens_source: str = "chunks"  # "usage" or "chunks"
    chunks: int = 0  # chunks that carried text
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent
    conversation: int = 0
    turn: int = 0
    finish_reason: str | None = None
    status_code: int | None = None
    error: str | None = None
    itl: list[float] = field(default_factory=list)  # gaps between successive text chunks
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: ``(e2e - ttft) / (output_tokens - 1)``."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class Phase:
    """One target running the whole workload once (one round)."""

    target: str
    round: int
    start: float
    duration: float
    records: list[RequestRecord]


@dataclass
class TargetInfo:
    label: str
    base_url: str
    model: str


@dataclass
class BenchResult:
    """A whole run: its configuration, its targets and the phases in the order they ran."""

    config: dict[str, Any]
    targets: list[TargetInfo]
    phases: list[Phase] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def records(self, label: str) -> list[RequestRecord]:
        return [r for phase in self.phases if phase.target == label for r in phase.records]

    def duration(self, label: str) -> float:
        """Seconds the target spent under load: the sum of its phases."""
        return sum(phase.duration for phase in self.phases if phase.target == label)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
