"""The sharded runner: the same forward as `ModelRunner`, over one rank's shard.

Every rank holds a `ShardedModelRunner`. Rank 0 (the driver) is the engine's runner: each call
that runs the model (`execute`, `logits`, `release_decode_contexts`) is first sent to the
workers as a command on the control group, so every rank runs the same forward in lockstep;
the workers (``worker.py``) only follow. A failed collective cannot be undone (the ranks are
out of step), so any error inside a mirrored call ends the process at once: the watchdog and
the supervisor above it turn that into a restart, never a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from tokenline.model_source import ModelSource
from tokenline.scheduler import models
from tokenline.scheduler.kv_transfer.link import (
    KVLayout,
    NixlLink,
    ReadPlan,
    failure_reason,
    nixl_module,
)
from tokenline.scheduler.layers.linear import QKVLinear
from tokenline.scheduler.layers.placement import Placement
from tokenline.scheduler.parallel.group import COLLECTIVE_TIME, RANK_STEP_TIME, TensorParallel
from tokenline.scheduler.runner import ModelRunner, RunnerOptions, StepInputs

log = logging.getLogger(__name__)
_READ_POLL_S = 0.002  # how often rank 0 asks the workers whether their KV reads ended


@dataclasses.dataclass(frozen=True)
class _ChunkShape:
    """What `ModelRunner.execute` reads of a chunk on a worker: its row count."""

    num_tokens: int


def fatal(message: str, *args: object) -> None:
    """End the process now: a rank out of step cannot recover, and exit handlers could wait
    on a collective that will never complete."""
    log.critical(message, *args, exc_info=True)
    logging.shutdown()
    os._exit(1)


class ShardedModelRunner(ModelRunner):
    def __init__(
        self, source: ModelSource, tp: TensorParallel, options: RunnerOptions = RunnerOptions()
    ) -> None:
        self.tp = tp
        if options.compile_layers and tp.is_driver:  # said once, by rank 0
            log.warning("--compile is ignored with --tensor-parallel-size > 1")
        # every rank would replay its own graph in lockstep: not built yet, so steps run eagerly
        super().__init__(
            source, dataclasses.replace(options, compile_layers=False, enforce_eager=True)
        )
        self._lock = threading.RLock()  # one command (and its collectives) at a time
        self._last_command = time.monotonic()
        self._rank_labels = [str(r) for r in range(tp.world_size)]
        # a decode pod's reads: a worker's in flight and rank 0's record of those that ended
        self._kv_reader = ThreadPoolExecutor(1, thread_name_prefix="kv-read")
        self._kv_reads: dict[int, Future] = {}
        self._kv_reads_ended: dict[int, dict[int, tuple[int, str, str]]] = {}
        self._stopped = False  # the workers were told to stop: no command reaches them

    def _load_model(self, source: ModelSource, implementation: str) -> models.CausalLM:
        # every layer holds this rank's share and does its own collective (layers/)
        return models.load(source, implementation, Placement(self.device, self.dtype, self.tp))

    def _size_pool(self, kv_cache_memory: int | None, utilization: float, tokens: int) -> int:
        # Every rank must have the same blocks, as rank 0's block tables address them all.
        self.tp.wait_for_all()  # every shard loaded: from here, collectives are a step's
        return self.tp.agree_min(super()._size_pool(kv_cache_memory, utilization, tokens))

    # ── rank 0: mirror each model call to the workers ───────────────────────────────────────
    def execute(
        self, inputs: StepInputs, spans: Sequence[tuple[int, int, int]] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            try:
                self._send("execute", _step_message(inputs), list(spans))
                return self._timed_execute(inputs, spans)
            except Exception:
                fatal("tensor parallel: a step failed on rank 0; the stage exits")
                raise  # unreachable

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._lock:
            try:
                self._send("logits", tuple(hidden.shape))
                dist.broadcast(hidden.contiguous(), src=0, group=self.tp.device_group)
                return super().logits(hidden)
            except Exception:
                fatal("tensor parallel: logits failed on rank 0; the stage exits")
                raise

    def release_decode_contexts(self) -> None:
        with self._lock:
            try:
                self._send("release")
            except Exception:
                fatal("tensor parallel: a worker did not answer; the stage exits")
            super().release_decode_contexts()

    def heartbeat(self, idle_s: float, stopping: threading.Event) -> None:
        """Keep waiting workers inside their collective timeout while the engine is idle."""
        with self._lock:
            if not stopping.is_set() and time.monotonic() - self._last_command >= idle_s:
                try:
                    self._send("noop")
                except Exception:
                    fatal("tensor parallel: a worker did not answer; the stage exits")

    def kv_shares(
        self, name: str, layout: KVLayout, lent: bool
    ) -> tuple[KVLayout, list[tuple[bytes, KVLayout]]]:
        """Rank 0's layout of its KV heads, and each worker's NIXL agent (created now, over its
        own pool, kept for the process's life) with its layout: on a prefill pod a decode pod
        reads every rank (one-sided: nothing here acts on a read); on a decode pod each rank
        reads into its own (`start_kv_reads`). Raises SystemExit where the heads are not split
        across the ranks."""
        total = self.total_kv_heads()
        if total % self.tp.world_size:
            raise SystemExit(
                f"--kv-transfer-config: the model's {total} KV heads are replicated or split "
                f"unevenly across --tensor-parallel-size {self.tp.world_size}, so no rank's "
                "share is a slice another pod's ranks could read or fill; run the pod at a "
                f"tensor parallel size that divides {total}"
            )
        nixl_module()  # here first: a worker without NIXL would end the group instead
        with self._lock:
            try:
                self._send("kv_agent", name, layout, lent)
                return self._rank_layout(layout), self._share_kv(name, layout, lent)[1:]
            except Exception:
                fatal("tensor parallel: a worker did not lend its KV pool; the stage exits")
                raise  # unreachable

    def start_kv_reads(self, token: int, plan: ReadPlan) -> None:
        """A decode pod's read (pulls.py, its worker thread): each worker starts reading its
        heads of the plan's blocks from the peer's ranks on a thread of its own, into its own
        pool; rank 0 reads its share itself."""
        with self._lock:
            if self._stopped:  # the workers are gone: wait_kv_reads says so
                return
            try:
                self._send("kv_read", token, plan)
            except Exception:
                fatal("tensor parallel: a worker did not take a KV read; the stage exits")

    def wait_kv_reads(self, token: int, until: float) -> list[tuple[int, str, str]]:
        """Each worker's (bytes read, failure reason, message) of read ``token``, once all
        have ended; a worker still reading at ``until`` (time.monotonic()), or when the
        workers were stopped, is said "stuck"."""
        while True:
            ended = self._kv_reads_ended.get(token, {})
            if len(ended) == self.tp.world_size - 1 or time.monotonic() > until:
                break
            time.sleep(_READ_POLL_S)
            with self._lock:  # between steps: a step holds it
                if self._stopped:  # the workers are gone: nobody answers
                    break
                try:
                    self._send("kv_poll")
                    self._gather_kv_reads()
                except Exception:
                    fatal("tensor parallel: a worker did not say how its KV read went")
        ended = self._kv_reads_ended.pop(token, {})
        stuck = (0, "stuck", "a tensor-parallel rank's KV read did not end in time")
        return [ended.get(rank, stuck) for rank in range(1, self.tp.world_size)]

    def total_kv_heads(self) -> int:
        """The model's KV heads, all ranks together."""
        qkv = next(m for m in self.model.modules() if isinstance(m, QKVLinear))
        return qkv.total_kv_heads

    def stop_workers(self) -> None:
        with self._lock:
            self._send("stop")
            self._stopped = True

    def _send(self, *command: Any) -> None:
        self._last_command = time.monotonic()
        dist.broadcast_object_list([command], src=0, group=self.tp.control_group)

    # ── every rank ───────────────────────────────────────────────────────────────────────────
    def _timed_execute(
        self, inputs: StepInputs, spans: Sequence[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        out = super().execute(inputs, spans)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        timings = torch.tensor([time.perf_counter() - start, self.tp.take_collective_time()])
        # Each rank's step and collective time reach rank 0, which exports them; one small
        # gather on the control group per step.
        world = self.tp.world_size
        gathered = [torch.empty(2) for _ in range(world)] if self.tp.is_driver else None
        dist.gather(timings, gathered, dst=0, group=self.tp.control_group)
        if gathered is not None:
            for label, (step_s, collective_s) in zip(self._rank_labels, gathered, strict=True):
                RANK_STEP_TIME.labels(rank=label).observe(float(step_s))
                COLLECTIVE_TIME.labels(rank=label).observe(float(collective_s))
        return out

    # ── workers: follow rank 0's commands ───────────────────────────────────────────────────
    def receive(self) -> tuple[Any, ...]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.tp.control_group)
        return box[0]

    @torch.inference_mode()
    def follow(self, command: tuple[Any, ...]) -> bool:
        """Run one of rank 0's commands; False when told to stop."""
        kind = command[0]
        if kind == "execute":
            _, message, spans = command
            self._timed_execute(self._rebuild(message), spans)
        elif kind == "logits":
            hidden = torch.empty(command[1], dtype=self.dtype, device=self.device)
            dist.broadcast(hidden, src=0, group=self.tp.device_group)
            super().logits(hidden)
        elif kind == "kv_agent":
            self._share_kv(*command[1:])
        elif kind == "kv_read":
            _, token, plan = command
            self._kv_reads[token] = self._kv_reader.submit(self._read_kv, plan)
        elif kind == "kv_poll":
            self._gather_kv_reads()
        elif kind == "release":
            super().release_decode_contexts()
        elif kind == "stop":
            return False
        return True

    def _rank_layout(self, layout: KVLayout) -> KVLayout:
        heads = self.num_kv_heads
        return msgspec.structs.replace(
            layout,
            num_kv_heads=heads,
            kv_head_start=self.tp.rank * heads,
            total_kv_heads=heads * self.tp.world_size,
            tp_size=self.tp.world_size,
        )

    def _share_kv(self, name: str, layout: KVLayout, lent: bool) -> list[tuple[bytes, KVLayout]]:
        """Every rank: an agent over this rank's pool (rank 0's is the engine's own; ``lent``:
        other pods read it), its metadata and layout gathered on rank 0 (the others get [])."""
        share: tuple[bytes, KVLayout] | None = None
        if not self.tp.is_driver:
            self.kv_link = NixlLink(
                f"{name}-rank{self.tp.rank}", self.kv_cache, self._rank_layout(layout), lent
            )
            share = (self.kv_link.metadata, self.kv_link.layout)
        gathered: list | None = [None] * self.tp.world_size if self.tp.is_driver else None
        dist.gather_object(share, gathered, dst=0, group=self.tp.control_group)
        return gathered or []

    def _read_kv(self, plan: ReadPlan) -> tuple[int, str, str]:
        """A worker's share of a decode pod's read, on its reader thread."""
        try:
            return self.kv_link.read_all(plan), "", ""
        except Exception as exc:
            return 0, failure_reason(exc), str(exc)

    def _gather_kv_reads(self) -> None:
        """Every rank: the workers' reads that ended since the last poll, gathered on rank 0
        (kept by token until `wait_kv_reads` takes them)."""
        ended: dict[int, tuple[int, str, str]] = {}
        for token, future in list(self._kv_reads.items()):
            if future.done():
                ended[token] = future.result()
                del self._kv_reads[token]
        gathered: list | None = [None] * self.tp.world_size if self.tp.is_driver else None
        dist.gather_object(ended, gathered, dst=0, group=self.tp.control_group)
        for rank, results in enumerate(gathered or []):
            for token, result in (results or {}).items():
                self._kv_reads_ended.setdefault(token, {})[rank] = result

    def _rebuild(self, message: dict[str, Any]) -> StepInputs:
        """The driver's StepInputs, rebuilt as `ModelRunner.step_inputs` builds them from the
        flat batch (the attention metadata is computed here, not sent)."""
        step = _to_device(message["step"], self.device)
        chunks = [_ChunkShape(n) for n in message["chunk_tokens"]]
        return StepInputs(chunks, step, self.attention.prepare(step))


def _step_message(inputs: StepInputs) -> dict[str, Any]:
    """The flat batch on the CPU (every field, whatever step_inputs adds) and the chunks'
    row counts: all a worker needs to run the same forward."""
    return {
        "step": _to_device(inputs.step, torch.device("cpu")),
        "chunk_tokens": [chunk.num_tokens for chunk in inputs.chunks],
    }


def _to_device(step: Any, device: torch.device) -> Any:
    moved = {
        f.name: getattr(step, f.name).to(device)
        for f in dataclasses.fields(step)
        if isinstance(getattr(step, f.name), torch.Tensor)
    }
    return dataclasses.replace(step, **moved)
