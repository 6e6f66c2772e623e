"""Progress: a log line at most every few seconds, and the bytes-fetched counter.

``Progress`` is pure (the clock is passed in) so its rate limiting is tested without sleeping;
the fetcher logs the lines it returns.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter

# The contract name from DESIGN.md ("model delivery"). Labelled by scheme only: a URI label would
# grow without bound on a cluster that rolls models.
MODEL_FETCH_BYTES = Counter(
    "tokenline_model_fetch_bytes",
    "Model bytes received while fetching (a file restarted from zero counts twice).",
    ["scheme"],
)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


class Progress:
    """Bytes done of a total, and the rate over the last interval."""

    def __init__(
        self, label: str, total: int | None, interval: float, clock: Callable[[], float]
    ) -> None:
        self.label = label
        self.total = total
        self.interval = interval
        self.clock = clock
        self.done = 0  # bytes of the model now on disk and verified or being written
        self.received = 0  # bytes off the network (resumed bytes are not received again)
        self.start = clock()
        self._last_time = self.start
        self._last_done = 0

    def skip(self, n: int) -> None:
        """Bytes already on disk from an earlier run (a verified file, a partial being resumed)."""
        self.done += n
        self._last_done += n

    def advance(self, n: int) -> str | None:
        """Count ``n`` received bytes; return a line to log when one is due."""
        self.done += n
        self.received += n
        now = self.clock()
        if now - self._last_time < self.interval:
            return None
        line = self.line(now)
        self._last_time, self._last_done = now, self.done
        return line

    def rewind(self, n: int) -> None:
        """A partial file was thrown away (the server ignored Range, or it failed verification)."""
        self.done -= n
        self._last_done = min(self._last_done, self.done)

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed = max(now - self._last_time, 1e-9)
        rate = (self.done - self._last_done) / elapsed
        if self.total:
            pct = 100.0 * self.done / self.total
            amount = f"{human_bytes(self.done)} / {human_bytes(self.total)} ({pct:.0f}%)"
        else:
            amount = human_bytes(self.done)
        eta = ""
        if self.total and rate > 0 and self.done < self.total:
            eta = f", about {int((self.total - self.done) / rate)} s left"
        return f"fetch {self.label}: {amount} at {human_bytes(rate)}/s{eta}"

    def summary(self) -> str:
        elapsed = max(self.clock() - self.start, 1e-9)
        return (
            f"fetch {self.label}: {human_bytes(self.done)} in place, {human_bytes(self.received)} "
            f"received in {elapsed:.1f} s ({human_bytes(self.received / elapsed)}/s)"
        )
