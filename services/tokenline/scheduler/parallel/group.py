"""The tensor-parallel process group and its timed collectives.

Two groups over the same ranks: ``device`` (NCCL on CUDA, gloo on CPU) carries the forward's
all-reduces and gathers; ``control`` (always gloo, on the CPU) carries rank 0's commands and
the workers' timings, so the control path never needs a device tensor. Both have a collective
timeout: a rank that stops answering raises on the others instead of hanging them.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from prometheus_client import Histogram

log = logging.getLogger(__name__)

# Per-step collective and step times; buckets from tens of microseconds (gloo on one machine,
# NVLink) to a second (a straggling rank across nodes).
_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
            0.025, 0.05, 0.1, 0.25, 1.0)  # fmt: skip
COLLECTIVE_TIME = Histogram(
    "tokenline_collective_seconds",
    "Time each tensor-parallel rank spent in all-reduces and gathers during one forward step; "
    "a rank that waits much longer than the others is waiting for a slow peer.",
    ["rank"],
    buckets=_BUCKETS,
)
RANK_STEP_TIME = Histogram(
    "tokenline_tp_rank_step_seconds",
    "Time of one forward step on each tensor-parallel rank, collectives included.",
    ["rank"],
    buckets=_BUCKETS,
)


# How long ranks wait for each other to load their shards (the pod's startup probe bounds
# loading too); a step's collectives have the shorter --distributed-timeout.
STARTUP_TIMEOUT_S = 3600.0


def free_port() -> int:
    """A TCP port free on this host now, for the group's rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class GroupSpec:
    """How a rank joins its group: picklable, handed to spawned workers."""

    world_size: int
    master_addr: str
    master_port: int
    backend: str  # "nccl" or "gloo"
    timeout_s: float


@dataclass
class TensorParallel:
    """This rank's place in the group, and the collectives the sharded layers call."""

    rank: int
    world_size: int
    device_group: object
    control_group: object
    collective_s: float = 0.0  # time in collectives since the last `take_collective_time`
    _timing: bool = field(default=True, repr=False)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.all_reduce(tensor, group=self.device_group)
        self.collective_s += time.perf_counter() - start
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the last dimension, in rank order."""
        start = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        self.collective_s += time.perf_counter() - start
        return torch.cat(parts, dim=-1)

    def take_collective_time(self) -> float:
        spent, self.collective_s = self.collective_s, 0.0
        return spent

    def wait_for_all(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait, up to ``timeout_s``, until every rank gets here: ranks load their shards at
        different speeds, longer than a step's collective may take (a rank that dies while
        loading is the watchdog's)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.monitored_barrier(group=self.control_group, timeout=timeout, wait_all_ranks=True)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV pool every rank can hold)."""
        tensor = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(tensor.item())


def join(spec: GroupSpec, rank: int) -> TensorParallel:
    """Join the group as ``rank`` (rank 0 hosts the rendezvous store)."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # NCCL honours the timeout
    init = f"tcp://{spec.master_addr}:{spec.master_port}"
    dist.init_process_group(
        spec.backend, init_method=init, rank=rank, world_size=spec.world_size, timeout=timeout
    )
    device_group = dist.group.WORLD
    control_group = (
        dist.new_group(backend="gloo", timeout=timeout) if spec.backend != "gloo" else device_group
    )
    log.info("tensor parallel: rank %d of %d joined (%s)", rank, spec.world_size, spec.backend)
    return TensorParallel(rank, spec.world_size, device_group, control_group)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
