"""The scheduler stage's side of tensor parallelism: which runner a process builds, and what
a worker node of a multi-node group runs instead of the stage."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tokenline.model_source import ModelSource
from tokenline.scheduler.engine import default_token_budget
from tokenline.scheduler.parallel.worker import RunnerArgs, backend_for, serve_node, start

log = logging.getLogger(__name__)


def runner_args(settings, source: ModelSource) -> RunnerArgs:
    threads = settings.torch_threads
    if threads is None and settings.device != "cuda":
        # On CPU the ranks share the cores: each takes its part, not all but one.
        import os

        ranks = ranks_per_node(settings)
        threads = max(1, ((os.cpu_count() or 2) - 1) // ranks)
    return RunnerArgs(
        source,
        device=settings.device,
        dtype=settings.dtype,
        block_size=settings.block_size,
        kv_cache_memory=settings.kv_cache_memory,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        torch_threads=threads,
        attention_backend=settings.attention_backend,
        model_impl=settings.model_impl,
        max_model_len=source.max_model_len(settings.max_model_len),
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens
        or default_token_budget("cuda" if backend_for(settings.device) == "nccl" else "cpu"),
    )


def ranks_per_node(settings) -> int:
    size, nodes = settings.tensor_parallel_size, settings.nnodes
    if size % nodes:
        raise SystemExit(f"--tensor-parallel-size {size} is not a multiple of --nnodes {nodes}")
    return size // nodes


def driver_runner(settings, source: ModelSource):
    """Rank 0's runner, with this node's other ranks spawned and watched."""
    if getattr(settings, "enable_lora", False):
        # the adapters' weights and calls are not sharded nor mirrored to the workers yet
        raise SystemExit("--enable-lora is not supported with --tensor-parallel-size > 1 yet")
    if settings.compile:
        log.warning("--compile is ignored with --tensor-parallel-size > 1")
    driver = start(
        runner_args(settings, source),
        settings.tensor_parallel_size,
        timeout_s=settings.distributed_timeout,
        master_addr=settings.master_addr if settings.nnodes > 1 else "127.0.0.1",
        master_port=settings.master_port,
        local_ranks=ranks_per_node(settings),
    )
    return driver.runner


def runner_type(settings, source: ModelSource, single: Callable[..., Any]) -> Callable[..., Any]:
    """What the stage calls to build its runner: ``single`` (ModelRunner) for one device;
    with tensor parallelism, a builder of rank 0's runner from ``settings`` (the runner's
    arguments are the same settings, read once here for every rank)."""
    if settings.tensor_parallel_size == 1:
        return single
    return lambda *_args, **_kwargs: driver_runner(settings, source)


def run_worker_node(settings, source: ModelSource) -> int:
    """A node other than the leader: its ranks follow the leader's rank 0; no ring."""
    if settings.master_port is None:
        raise SystemExit("a worker node needs --master-port (the leader's rendezvous port)")
    return serve_node(
        runner_args(settings, source),
        settings.tensor_parallel_size,
        settings.node_rank,
        ranks_per_node(settings),
        settings.master_addr,
        settings.master_port,
        settings.distributed_timeout,
    )
