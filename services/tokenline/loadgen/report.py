"""Statistics over the records, and the tables printed at the end of a run.

Definitions (all client-side, successful requests only):

- TTFT: request sent -> first chunk that carries text.
- ITL (inter-token latency): gaps between successive chunks that carry text, pooled over
  requests. A server that packs several tokens into one chunk shows fewer, longer gaps.
- TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``; token-normalised, so it is
  comparable between servers that chunk differently.
- E2E: request sent -> end of stream.
- Output tokens: the final ``usage.completion_tokens`` when the server sends it, else the
  number of chunks that carried text.
- Throughput: output tokens (requests) of successful requests / seconds the target was under
  load (the sum of its phases).
- Tokens per chunk: per request, ``usage.completion_tokens / chunks`` (requests whose server
  sent usage). A server streams each step's tokens in one chunk, so under speculative decoding
  this is 1 + the guesses its steps kept: the request's accepted length as the client sees it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tokenline.loadgen.records import BenchResult

PERCENTILES = (50, 90, 99)
# Distinct prompts still share a chat template's first tokens; more than this is a rerun.
STALE_CACHE_SHARE = 0.1


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolating linearly between closest ranks
    (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class Dist:
    """Mean and percentiles of a latency, in seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist | None:
        if not values:
            return None
        return cls(
            count=len(values),
            mean=sum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
        )


@dataclass
class Summary:
    label: str
    base_url: str
    model: str
    completed: int
    failed: int
    duration: float
    output_tokens: int
    prompt_tokens: int | None  # None when the server reported no usage
    cached_tokens: int | None  # prompt tokens the server found cached; None: never reported
    output_throughput: float
    request_throughput: float
    mean_output_tokens: float
    short_outputs: int  # successful requests that ended before max_tokens
    tokens_source: str  # "usage", "chunks" or "mixed"
    ttft: Dist | None
    itl: Dist | None
    tpot: Dist | None
    e2e: Dist | None
    tokens_per_chunk: Dist | None  # per request; None without usage (then it is 1 by definition)
    errors: list[str]  # up to five distinct error messages


def summarize(result: BenchResult, label: str) -> Summary:
    """The numbers for one target, over all its rounds."""
    target = next(t for t in result.targets if t.label == label)
    records = result.records(label)
    ok = [r for r in records if r.ok]
    duration = result.duration(label)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached_counts = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    sources = {r.tokens_source for r in ok}
    errors: list[str] = []
    for record in records:
        if record.error is not None and record.error not in errors and len(errors) < 5:
            errors.append(record.error)
    return Summary(
        label=label,
        base_url=target.base_url,
        model=target.model,
        completed=len(ok),
        failed=len(records) - len(ok),
        duration=duration,
        output_tokens=output_tokens,
        prompt_tokens=sum(prompt_counts) if prompt_counts else None,
        cached_tokens=sum(cached_counts) if cached_counts else None,
        output_throughput=output_tokens / duration if duration > 0 else 0.0,
        request_throughput=len(ok) / duration if duration > 0 else 0.0,
        mean_output_tokens=output_tokens / len(ok) if ok else 0.0,
        short_outputs=sum(1 for r in ok if r.output_tokens < r.max_tokens),
        tokens_source=sources.pop() if len(sources) == 1 else ("mixed" if sources else "-"),
        ttft=Dist.of([r.ttft for r in ok if r.ttft is not None]),
        itl=Dist.of([gap for r in ok for gap in r.itl]),
        tpot=Dist.of([t for r in ok if (t := r.tpot) is not None]),
        e2e=Dist.of([r.e2e for r in ok if r.e2e is not None]),
        tokens_per_chunk=Dist.of(
            [r.output_tokens / r.chunks for r in ok if r.tokens_source == "usage" and r.chunks]
        ),
        errors=errors,
    )


# --- printing ---------------------------------------------------------------------------

LATENCIES = (("TTFT", "ttft"), ("ITL", "itl"), ("TPOT", "tpot"), ("E2E", "e2e"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _per_chunk(dist: Dist | None) -> str:
    if dist is None:
        return "- (no usage: one token a chunk is assumed)"
    return f"mean {dist.mean:.2f}, per request p50 {dist.p50:.2f} p90 {dist.p90:.2f}"


def format_summary(s: Summary) -> str:
    """One target's numbers as a small table."""
    prompt = "-" if s.prompt_tokens is None else str(s.prompt_tokens)
    if s.cached_tokens is not None and s.prompt_tokens:
        prompt += f" ({s.cached_tokens} cached, {s.cached_tokens / s.prompt_tokens:.0%})"
    lines = [
        f"== {s.label}: {s.base_url}  model {s.model}",
        f"requests            {s.completed} ok, {s.failed} failed in {s.duration:.2f} s",
        f"output tokens       {s.output_tokens} (mean {s.mean_output_tokens:.1f}/request, "
        f"counted from {s.tokens_source}; {s.short_outputs} short of max_tokens)",
        f"prompt tokens       {prompt}",
        f"output tokens/s     {s.output_throughput:.1f}",
        f"requests/s          {s.request_throughput:.2f}",
        f"tokens per chunk    {_per_chunk(s.tokens_per_chunk)}",
        f"{'latency (ms)':<18}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, attr in LATENCIES:
        dist: Dist | None = getattr(s, attr)
        cells = [None] * 4 if dist is None else [dist.mean, dist.p50, dist.p90, dist.p99]
        lines.append(f"{name:<18}" + "".join(f"{_ms(v):>10}" for v in cells))
    lines.extend(f"error: {message}" for message in s.errors)
    return "\n".join(lines)


@dataclass(frozen=True)
class Row:
    name: str
    get: Callable[[Summary], float | None]
    better: str  # "higher" or "lower"
    unit: str = ""


def _pct(attr: str, q: str) -> Callable[[Summary], float | None]:
    def get(s: Summary) -> float | None:
        dist = getattr(s, attr)
        return None if dist is None else getattr(dist, q) * 1000

    return get


COMPARE_ROWS: tuple[Row, ...] = (
    Row("output tokens/s", lambda s: s.output_throughput, "higher"),
    Row("requests/s", lambda s: s.request_throughput, "higher"),
    *(
        Row(f"{name} {q} (ms)", _pct(attr, q), "lower")
        for name, attr in LATENCIES
        for q in ("p50", "p90", "p99")
    ),
    Row("mean output tokens", lambda s: s.mean_output_tokens, "equal"),
    Row("failed requests", lambda s: float(s.failed), "lower"),
)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """``ours / theirs``; None when either is missing or ``theirs`` is zero."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def comparison(ours: Summary, theirs: Summary) -> dict[str, dict[str, Any]]:
    """Every compared metric: both values and the ratio ours/theirs."""
    table = {}
    for row in COMPARE_ROWS:
        a, b = row.get(ours), row.get(theirs)
        table[row.name] = {"ours": a, "theirs": b, "ratio": ratio(a, b), "better": row.better}
    return table


def format_comparison(ours: Summary, theirs: Summary) -> str:
    """Side by side, with the ratio ours/theirs and which direction is better."""

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    header = f"{'metric':<20}{ours.label:>12}{theirs.label:>12}{'ratio':>10}  better"
    lines = [f"== {ours.label} vs {theirs.label} (ratio = {ours.label}/{theirs.label})", header]
    for name, row in comparison(ours, theirs).items():
        lines.append(
            f"{name:<20}{cell(row['ours']):>12}{cell(row['theirs']):>12}"
            f"{cell(row['ratio']):>10}  {row['better']}"
        )
    return "\n".join(lines)


def run_warnings(result: BenchResult, summaries: list[Summary]) -> list[str]:
    """Things that make the numbers less comparable than they look."""
    warnings = list(result.warnings)
    for s in summaries:
        if s.short_outputs:
            warnings.append(
                f"{s.label}: {s.short_outputs} requests ended before max_tokens "
                "(does the server honour ignore_eos?)"
            )
        if s.tokens_source != "usage" and s.completed:
            warnings.append(
                f"{s.label}: no final usage chunk on some streams; tokens counted as chunks"
            )
    distinct = not result.config.get("shared_prefix_len") and result.config.get("turns", 1) == 1
    for s in summaries:
        if distinct and s.cached_tokens and s.prompt_tokens:
            share = s.cached_tokens / s.prompt_tokens
            if share > STALE_CACHE_SHARE:
                warnings.append(
                    f"{s.label}: {share:.0%} of prompt tokens were cached although the prompts "
                    "are distinct: the server remembers an earlier run with this --seed"
                )
    if len(summaries) == 2:
        a, b = (s.mean_output_tokens for s in summaries)
        if a and b and abs(a - b) / max(a, b) > 0.01:
            warnings.append(f"mean output tokens differ between targets: {a:.1f} vs {b:.1f}")
    return warnings


def format_report(result: BenchResult) -> str:
    """Everything printed at the end of a run."""
    summaries = [summarize(result, t.label) for t in result.targets]
    config = result.config
    load = (
        f"request rate {config['request_rate']}/s"
        if config["request_rate"] is not None
        else f"concurrency {config['concurrency']}"
    )
    head = (
        f"tokenline bench: {config['num_requests']} requests x {config['rounds']} round(s) per "
        f"target, {load}, prompt {config['prompt_len']} words, output {config['output_len']} "
        f"tokens, /{config['endpoint']}"
    )
    shape = []
    if config.get("shared_prefix_len"):
        shape.append(
            f"shared prefix {config['shared_prefix_len']} words in "
            f"{config['prefix_groups']} group(s)"
        )
    if config.get("turns", 1) > 1:
        shape.append(f"conversations of {config['turns']} turns")
    if shape:
        head += "\n" + ", ".join(shape)
    blocks = [head, *(format_summary(s) for s in summaries)]
    if len(summaries) == 2:
        blocks.append(format_comparison(*summaries))
    warnings = run_warnings(result, summaries)
    if warnings:
        blocks.append("\n".join(f"warning: {w}" for w in warnings))
    return "\n\n".join(blocks)


def result_json(result: BenchResult) -> dict[str, Any]:
    """The full result for ``--json-out``: config, summaries, comparison, phases, records."""
    summaries = [summarize(result, t.label) for t in result.targets]
    data: dict[str, Any] = {"summaries": {s.label: asdict(s) for s in summaries}}
    if len(summaries) == 2:
        data["comparison"] = comparison(*summaries)
    data.update(result.to_dict())
    data["warnings"] = run_warnings(result, summaries)
    return data
