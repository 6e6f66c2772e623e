"""The PNG of a run: TTFT, ITL and E2E distributions and output throughput over time."""

from __future__ import annotations

import math
from pathlib import Path

from tokenline.loadgen.records import BenchResult, RequestRecord


def throughput_series(
    records: list[RequestRecord], bin_s: float, end: float
) -> tuple[list[float], list[float]]:
    """Output tokens/s in bins of ``bin_s`` seconds of run time, from chunk arrival times.

    A chunk counts ``output_tokens / chunks`` tokens, so the series sums to the token total
    even when the server packs several tokens per chunk. Returns (bin starts, rates).
    """
    bins = [0.0] * max(1, math.ceil(end / bin_s))
    for record in records:
        if not record.ok or not record.chunks:
            continue
        weight = record.output_tokens / record.chunks
        for offset in record.chunk_times:
            index = min(int((record.start + offset) / bin_s), len(bins) - 1)
            bins[index] += weight
    return [i * bin_s for i in range(len(bins))], [tokens / bin_s for tokens in bins]


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def write_plot(result: BenchResult, path: str | Path) -> None:
    """Write a 2x2 PNG: TTFT, ITL and E2E CDFs per target, and throughput over run time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_ttft, ax_itl), (ax_e2e, ax_tput) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    end = max((p.start + p.duration for p in result.phases), default=1.0)
    bin_s = max(0.25, end / 120)

    for i, target in enumerate(result.targets):
        color = colors[i % len(colors)]
        ok = [r for r in result.records(target.label) if r.ok]
        series = {
            ax_ttft: [r.ttft * 1000 for r in ok if r.ttft is not None],
            ax_itl: [gap * 1000 for r in ok for gap in r.itl],
            ax_e2e: [r.e2e for r in ok if r.e2e is not None],
        }
        for ax, values in series.items():
            if values:
                ax.step(*_cdf(values), where="post", color=color, label=target.label)
        starts, rates = throughput_series(ok, bin_s, end)
        ax_tput.step(starts, rates, where="post", color=color, label=target.label)
        for phase in result.phases:
            if phase.target == target.label:
                ax_tput.axvspan(phase.start, phase.start + phase.duration, color=color, alpha=0.08)

    for ax, title, xlabel in (
        (ax_ttft, "time to first token", "ms"),
        (ax_itl, "inter-token latency (gap between text chunks)", "ms"),
        (ax_e2e, "end-to-end latency", "s"),
    ):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests" if ax is not ax_itl else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    ax_tput.set_title(f"output throughput ({bin_s:.2f} s bins; shaded: each target's phases)")
    ax_tput.set_xlabel("run time (s)")
    ax_tput.set_ylabel("tokens/s")
    ax_tput.grid(alpha=0.3)
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    config = result.config
    fig.suptitle(
        f"tokenline bench: {config['num_requests']} requests x {config['rounds']} round(s), "
        f"output {config['output_len']} tokens, /{config['endpoint']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
