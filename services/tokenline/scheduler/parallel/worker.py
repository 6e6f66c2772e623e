"""Starting a tensor-parallel group: rank 0 in the scheduler stage, the others as workers.

On one node the scheduler spawns ranks 1..N-1 itself (``start``). Across nodes (a
LeaderWorkerSet), each worker pod runs ``tokenline tp-worker``, which spawns that node's ranks
and joins the leader's group (``serve_node``). Failure is made loud and fast both ways: rank 0
watches its worker processes and exits the moment one dies; a worker whose collective fails
(rank 0 gone, a peer gone, a timeout) exits too; and rank 0 sends a heartbeat while idle, so
a waiting worker's collective timeout only fires when rank 0 really stopped.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenline.model_source import ModelSource
from tokenline.scheduler.parallel.group import GroupSpec, free_port, join, leave
from tokenline.scheduler.parallel.runner import ShardedModelRunner, fatal
from tokenline.scheduler.runner import RunnerOptions

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 0.2


def backend_for(device: str) -> str:
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def build_runner(
    source: ModelSource, options: RunnerOptions, spec: GroupSpec, rank: int, local_rank: int
) -> ShardedModelRunner:
    """A rank's runner. Every rank builds it from the same source and options (picklable:
    spawned workers receive them), so every rank profiles the same forward (warm_up.py)."""
    if spec.backend == "nccl":
        torch.cuda.set_device(local_rank)  # "cuda" below means this rank's device
    return ShardedModelRunner(source, join(spec, rank), options)


def worker_main(
    source: ModelSource, options: RunnerOptions, spec: GroupSpec, rank: int, local_rank: int
) -> None:
    """A worker rank: build the shard, then follow rank 0 until told to stop."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s"
    )
    parent = os.getppid()
    try:
        runner = build_runner(source, options, spec, rank, local_rank)
        while runner.follow(runner.receive()):
            if os.getppid() != parent:  # spawned by a stage that is gone
                fatal("tensor parallel rank %d: its parent exited", rank)
    except Exception:
        fatal("tensor parallel rank %d failed; exiting so the group restarts", rank)
    leave()
    # Skip the interpreter's teardown: gloo's threads, destroyed with the process's statics
    # while still joinable, abort it ("terminate called without an active exception", -6),
    # which a worker node would report as a failed rank.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(
    source: ModelSource, options: RunnerOptions, spec: GroupSpec, ranks: range,
    first_local: int = 0,
) -> list:  # fmt: skip
    """Start ``ranks`` as processes of this host (local ranks from ``first_local``)."""
    context = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
    processes = []
    for offset, rank in enumerate(ranks):
        process = context.Process(
            target=worker_main,
            args=(source, options, spec, rank, first_local + offset),
            name=f"tp-rank{rank}",
            daemon=True,  # they die with the stage, whatever ends it
        )
        process.start()
        processes.append(process)
    return processes


def watch(
    processes, on_death: Callable[[str], None], stopping: threading.Event
) -> threading.Thread:
    """A thread that calls ``on_death`` as soon as one of ``processes`` exits, unless they
    were told to stop."""

    def loop() -> None:
        while not stopping.is_set():
            for process in processes:
                if not process.is_alive() and not stopping.is_set():
                    on_death(f"{process.name} exited with {process.exitcode}")
                    return
            time.sleep(WATCH_INTERVAL_S)

    thread = threading.Thread(target=loop, name="tp-watchdog", daemon=True)
    thread.start()
    return thread


def _exit_stage(reason: str) -> None:
    log.critical("tensor parallel: %s; the scheduler stage exits", reason)
    logging.shutdown()
    os._exit(1)


def heartbeat(
    runner: ShardedModelRunner, timeout_s: float, stopping: threading.Event
) -> threading.Thread:
    interval = max(0.5, min(30.0, timeout_s / 4))

    def loop() -> None:
        while not stopping.wait(interval / 2):
            runner.heartbeat(interval, stopping)

    thread = threading.Thread(target=loop, name="tp-heartbeat", daemon=True)
    thread.start()
    return thread


@dataclass
class Driver:
    """Rank 0's runner with its workers, watchdog and heartbeat."""

    runner: ShardedModelRunner
    processes: list
    stopping: threading.Event

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers and leave the group (tests; a stage just exits)."""
        self.stopping.set()
        self.runner.stop_workers()
        for process in self.processes:
            process.join(timeout_s)
        leave()


def start(
    source: ModelSource,
    options: RunnerOptions,
    size: int,
    timeout_s: float = 300.0,
    on_death: Callable[[str], None] = _exit_stage,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    local_ranks: int | None = None,
) -> Driver:
    """Rank 0 here and ranks 1..``local_ranks``-1 spawned on this host; the other ranks (on
    other nodes) join at ``master_addr``:``master_port``."""
    local = size if local_ranks is None else local_ranks
    spec = GroupSpec(size, master_addr, master_port or free_port(), backend_for(options.device),
                     timeout_s)  # fmt: skip
    processes = spawn(source, options, spec, range(1, local), first_local=1)
    stopping = threading.Event()
    # A stage that exits on its own (drained) ends its daemonic workers at exit: that death
    # is expected. Registered after multiprocessing's own exit hook, so it runs before it.
    atexit.register(stopping.set)
    watch(processes, on_death, stopping)
    runner = build_runner(source, options, spec, 0, 0)
    heartbeat(runner, timeout_s, stopping)
    return Driver(runner, processes, stopping)


def serve_node(
    source: ModelSource, options: RunnerOptions, size: int, node_rank: int, ranks_per_node: int,
    master_addr: str, master_port: int, timeout_s: float = 300.0,
) -> int:  # fmt: skip
    """A worker node of a multi-node group: spawn this node's ranks and wait for them; exit
    non-zero as soon as one fails (the pod restarts, and rank 0 sees its collective fail)."""
    spec = GroupSpec(size, master_addr, master_port, backend_for(options.device), timeout_s)
    first = node_rank * ranks_per_node
    processes = spawn(source, options, spec, range(first, min(first + ranks_per_node, size)))
    while True:
        for process in processes:
            if not process.is_alive():
                if process.exitcode == 0 and not any(p.is_alive() for p in processes):
                    return 0
                if process.exitcode != 0:
                    log.critical("%s exited with %s", process.name, process.exitcode)
                    return 1
        time.sleep(WATCH_INTERVAL_S)
