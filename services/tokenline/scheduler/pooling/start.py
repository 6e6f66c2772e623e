"""The scheduler process of a pooling model: the pooling set up from the checkpoint and the
flags, the model loaded and warmed up, the pooling engine joined to the ring."""

from __future__ import annotations

import dataclasses
import logging

from tokenline.lifecycle import Drain
from tokenline.model_source import ModelSource
from tokenline.scheduler.engine import EngineLimits
from tokenline.scheduler.pooling.config import PoolingSetup, resolve_setup
from tokenline.scheduler.pooling.encoder import EncoderRunner
from tokenline.scheduler.pooling.encoder_engine import EncoderEngine
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
    budget = options.max_num_batched_tokens
    if setup.encoder:  # bidirectional: each input run whole, no KV cache
        engine = encoder_engine(source, options, setup)
    else:
        engine = decoder_engine(source, options, setup, not settings.no_prefix_caching)
    ring = SyncRing("scheduler", settings.endpoints, settings.ring_security)
    log.info(
        "scheduler ready (pooling, %s, %s): %s, a step of up to %d tokens",
        setup.task,
        "encoder" if setup.encoder else "decoder",
        source.spec,
        budget,
    )
    serve_stage(PoolingStage(engine, settings.model_name), ring, drain)
    return 0


def decoder_engine(
    source: ModelSource, options: RunnerOptions, setup: PoolingSetup, prefix_caching: bool
) -> PoolingEngine:
    """A decoder over the paged KV cache, chunked as generation is."""
    # no decode steps: no decode buckets to capture
    options = dataclasses.replace(options, enforce_eager=True)
    runner = PoolingRunner(source, options, setup)
    budget = options.max_num_batched_tokens
    warm_up(runner, budget)
    limits = EngineLimits(options.max_model_len, options.max_num_seqs, budget)
    log.info("pooling decoder: %d KV blocks", runner.num_blocks)
    return PoolingEngine(runner, setup, limits, prefix_caching=prefix_caching)


def encoder_engine(
    source: ModelSource, options: RunnerOptions, setup: PoolingSetup
) -> EncoderEngine:
    """A BERT-style encoder through transformers' module, batched whole inputs a step."""
    try:
        runner = EncoderRunner(source, options, setup)
    except (OSError, ValueError) as exc:  # weights or a config transformers cannot read
        raise SystemExit(f"{source.spec}: the encoder did not load: {exc}") from None
    budget = options.max_num_batched_tokens
    runner.warm_up(budget)
    limits = EngineLimits(runner.max_model_len, options.max_num_seqs, budget)
    return EncoderEngine(runner, setup, limits)
