"""The scheduler process of a pooling model: the pooling set up from the checkpoint and the
flags, the model loaded and warmed up, the pooling engine joined to the ring."""

from __future__ import annotations

import dataclasses
import logging

from tokenline.lifecycle import Drain
from tokenline.model_source import ModelSource
from tokenline.scheduler.engine import EngineLimits
from tokenline.scheduler.pooling.config import resolve_setup
from tokenline.scheduler.pooling.engine import PoolingEngine
from tokenline.scheduler.pooling.model import PoolingRunner
from tokenline.scheduler.pooling.stage import PoolingStage
from tokenline.scheduler.runner import RunnerOptions
from tokenline.scheduler.warm_up import warm_up
from tokenline.settings import Settings
from tokenline.stage_runtime import serve_stage
from tokenline.transport import SyncRing

log = logging.getLogger(__name__)


def run(settings: Settings, source: ModelSource, options: RunnerOptions, drain: Drain) -> int:
    """Serve ``source`` as a pooling model; returns the exit status."""
    if settings.tensor_parallel_size > 1:
        raise SystemExit("--runner pooling runs on one device; drop --tensor-parallel-size")
    if settings.enable_lora or settings.speculative_config:
        raise SystemExit("--runner pooling serves no LoRA adapters and no speculative decoding")
    try:
        setup = resolve_setup(source, settings.convert, settings.pooler_config)
    except ValueError as exc:  # a config.json transformers cannot read
        raise SystemExit(f"{source.spec}: {exc}") from None
    # no decode steps: no decode buckets to capture
    options = dataclasses.replace(options, enforce_eager=True)
    runner = PoolingRunner(source, options, setup)
    budget = options.max_num_batched_tokens
    warm_up(runner, budget)
    limits = EngineLimits(options.max_model_len, options.max_num_seqs, budget)
    engine = PoolingEngine(runner, setup, limits, prefix_caching=not settings.no_prefix_caching)
    ring = SyncRing("scheduler", settings.endpoints, settings.ring_security)
    log.info(
        "scheduler ready (pooling, %s): %s, %d KV blocks",
        setup.task,
        source.spec,
        runner.num_blocks,
    )
    serve_stage(PoolingStage(engine, settings.model_name), ring, drain)
    return 0
