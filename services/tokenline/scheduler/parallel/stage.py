"""The scheduler stage's side of tensor parallelism: rank 0's runner with its workers, each
rank's share of the runner's options, and what a worker node of a multi-node group runs
instead of the stage."""

from __future__ import annotations

import dataclasses
import logging

from tokenline.cores import usable_cores
from tokenline.model_source import ModelSource
from tokenline.scheduler.parallel.runner import ShardedModelRunner
from tokenline.scheduler.parallel.worker import serve_node, start
from tokenline.scheduler.runner import RunnerOptions

log = logging.getLogger(__name__)


def rank_options(settings, options: RunnerOptions) -> RunnerOptions:
    """The options every rank builds its runner with: the stage's, except that on CPU the
    ranks of a node share its cores, each taking its part (not all but one)."""
    if options.torch_threads is not None or settings.device == "cuda":
        return options
    threads = max(1, (usable_cores() - 1) // ranks_per_node(settings))
    return dataclasses.replace(options, torch_threads=threads)


def ranks_per_node(settings) -> int:
    size, nodes = settings.tensor_parallel_size, settings.nnodes
    if size % nodes:
        raise SystemExit(f"--tensor-parallel-size {size} is not a multiple of --nnodes {nodes}")
    return size // nodes


def driver_runner(settings, source: ModelSource, options: RunnerOptions) -> ShardedModelRunner:
    """Rank 0's runner, with this node's other ranks spawned and watched."""
    if getattr(settings, "enable_lora", False):
        # the adapters' weights and calls are not sharded nor mirrored to the workers yet
        raise SystemExit("--enable-lora is not supported with --tensor-parallel-size > 1 yet")
    driver = start(
        source,
        rank_options(settings, options),
        settings.tensor_parallel_size,
        timeout_s=settings.distributed_timeout,
        master_addr=settings.master_addr if settings.nnodes > 1 else "127.0.0.1",
        master_port=settings.master_port,
        local_ranks=ranks_per_node(settings),
    )
    return driver.runner


def run_worker_node(settings, source: ModelSource, options: RunnerOptions) -> int:
    """A node other than the leader: its ranks follow the leader's rank 0; no ring."""
    if settings.master_port is None:
        raise SystemExit("a worker node needs --master-port (the leader's rendezvous port)")
    return serve_node(
        source,
        rank_options(settings, options),
        settings.tensor_parallel_size,
        settings.node_rank,
        ranks_per_node(settings),
        settings.master_addr,
        settings.master_port,
        settings.distributed_timeout,
    )
