"""Where an engine step's time goes, phase by phase: what `Engine.step` records and the
scheduler stage exports as ``tokenline_step_phase_seconds``."""

from __future__ import annotations

import time
from dataclasses import dataclass

STEP_PHASES = ("schedule", "inputs", "forward", "sample", "outputs")


@dataclass
class StepTimes:
    """Where one step's time went, in seconds, phase by phase (`STEP_PHASES`).

    On a GPU ``forward`` is the time to queue the step's kernels: waiting for them shows in
    ``sample``, whose tokens are the step's first copy back to the host."""

    schedule: float = 0.0
    inputs: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    outputs: float = 0.0
    sequences: int = 0  # the step's batch: sequences computed

    @property
    def host(self) -> float:
        """Everything but the forward."""
        return self.schedule + self.inputs + self.sample + self.outputs


def lap(mark: float) -> tuple[float, float]:
    """Seconds since ``mark``, and the new mark."""
    now = time.perf_counter()
    return now - mark, now
