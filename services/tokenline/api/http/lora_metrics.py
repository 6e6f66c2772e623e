"""``vllm:lora_requests_info`` on the api port, as vLLM emits it, for LoRA-aware endpoint pickers.

The Gateway API Inference Extension's picker reads it from the pool's target port (the api's)
to send a request where its adapter is already resident: labels ``max_lora``,
``running_lora_adapters`` and ``waiting_lora_adapters`` (adapter names joined by commas), value
the time of the status in Unix seconds (vLLM's ``set_to_current_time``). The api copies it from
the scheduler's status in each returning heartbeat, so it is at most a heartbeat old.

vLLM leaves every label set it ever emitted behind, and the picker takes the newest; here only
the current one is kept, so a scrape shows the pod's LoRA state once, never a stale one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import Gauge

from tokenline import protocol

LORA_REQUESTS_INFO = Gauge(
    "vllm:lora_requests_info",
    "Running stats on LoRA requests: the adapters of running and waiting requests and the "
    "adapters resident at once, in labels; the value is when they were reported (Unix seconds).",
    ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
)


class LoraInfo:
    """Keeps ``vllm:lora_requests_info`` at the scheduler's latest reported LoRA state."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._labels: tuple[str, str, str] | None = None

    def update(self, scheduler: protocol.StageStatus | None) -> None:
        if scheduler is None:
            return  # a heartbeat without the scheduler's status: keep what was known
        if scheduler.max_loras <= 0:  # LoRA is off there (or a scheduler without it)
            self._drop()
            return
        labels = (
            str(scheduler.max_loras),
            ",".join(scheduler.lora_waiting),
            ",".join(scheduler.lora_running),
        )
        if labels != self._labels:
            self._drop()
            self._labels = labels
        LORA_REQUESTS_INFO.labels(*labels).set(self._clock())

    def _drop(self) -> None:
        if self._labels is not None:
            LORA_REQUESTS_INFO.remove(*self._labels)
            self._labels = None
