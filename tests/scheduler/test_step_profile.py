"""The engine's per-step profile: each step that runs the model accounts for its phases, and
the scheduler stage exports them as histograms."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY

from tokenline import protocol
from tokenline.scheduler.stage import SchedulerStage
from tokenline.scheduler.step_times import STEP_PHASES, StepTimes
from tokenline.stage_runtime import StageRuntime


def _count(phase: str) -> float:
    return REGISTRY.get_sample_value("tokenline_step_phase_seconds_count", {"phase": phase}) or 0


def _sum(phase: str) -> float:
    return REGISTRY.get_sample_value("tokenline_step_phase_seconds_sum", {"phase": phase}) or 0


def test_a_step_that_runs_the_model_times_every_phase(make_engine, encode):
    engine = make_engine()
    idle = engine.last_step_times
    engine.step()  # nothing to run: the profile of the last real step stays
    assert engine.last_step_times is idle
    for uid in ("a", "b", "c"):
        engine.add(uid, encode("profile " + uid), protocol.SamplingParams(max_tokens=3))
    engine.step()
    times = engine.last_step_times
    assert times is not idle and times.sequences == 3
    assert all(getattr(times, phase) > 0 for phase in STEP_PHASES)
    assert times.host == times.schedule + times.inputs + times.sample + times.outputs


def test_the_stage_exports_one_observation_per_phase_per_model_step(make_engine, encode):
    sent: list = []
    stage = SchedulerStage(make_engine(), "tiny")
    runtime = StageRuntime(stage, sent.append)
    before = {phase: (_count(phase), _sum(phase)) for phase in STEP_PHASES}
    batches_before = REGISTRY.get_sample_value("tokenline_step_sequences_count") or 0
    request = protocol.Tokenized(
        uid="prof-1",
        prompt_ids=encode("a profiled request"),
        sampling=protocol.SamplingParams(max_tokens=4, ignore_eos=True),
        timeout_s=30,
    )
    runtime.process([(time.monotonic(), request)])
    steps = 0
    while stage.engine.has_work():
        runtime.step()
        steps += 1
    assert steps >= 4  # a prefill and decodes
    for phase in STEP_PHASES:
        count, total = before[phase]
        assert _count(phase) - count == steps
        assert _sum(phase) > total
    assert (
        REGISTRY.get_sample_value("tokenline_step_sequences_count") or 0
    ) - batches_before == steps
    assert isinstance(stage.engine.last_step_times, StepTimes)
