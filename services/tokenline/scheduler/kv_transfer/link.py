"""The KV pool as NIXL sees it: one registered region, read block by block by a remote agent.

The runner's pool is one tensor ``(layers, slots, 2 * kv_heads, head_dim)``, so a block of a
layer is one contiguous run of ``block_size`` slots: a read is a list of (address, length)
pairs, one a layer and run of consecutive blocks, from the remote pool into this one. NIXL's
UCX backend moves host memory over TCP or shared memory and device memory over RDMA/NVLink;
the scheduler never waits on it (pulls.py runs reads on a worker thread).

Under tensor parallelism, on either side, a rank holds a slice of the model's KV heads: each
reading rank reads, from each rank of the peer, the heads both hold (`KVLayout.heads`); a
rank's slot row is then read as one K and one V segment instead of whole.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

log = logging.getLogger(__name__)
# How often a lending pod's agent is progressed: connections from readers wait for it, and
# over TCP each read does too; each progress is a few microseconds.
LENDER_PROGRESS_S = 0.002


class KVLayout(msgspec.Struct, kw_only=True):
    """What two pods must agree on before one reads the other's blocks, and where they lie."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    tp_size: int
    num_slots: int = 0  # the pool's slots (addresses are computed from it)
    base: int = 0  # the pool's address in its owner's memory
    device_id: int = 0
    # Under tensor parallelism a rank holds KV heads [kv_head_start, + num_kv_heads) of the
    # model's total_kv_heads (0: as many as this rank holds, a TP=1 pool, or an older peer).
    kv_head_start: int = 0
    total_kv_heads: int = 0

    @property
    def all_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads

    def mismatch(self, owner: KVLayout) -> str:
        """Why ``owner``'s pool (one rank's) cannot be read into this one; "" when it can."""
        for name in ("model", "dtype", "block_size", "num_layers", "head_dim"):
            ours, theirs = getattr(self, name), getattr(owner, name)
            if ours != theirs:
                return f"{name} differs: {theirs} there, {ours} here"
        if self.all_kv_heads != owner.all_kv_heads:
            return f"num_kv_heads differs: {owner.all_kv_heads} there, {self.all_kv_heads} here"
        for side, layout in (("prefill", owner), ("decode", self)):
            if layout.num_kv_heads * layout.tp_size != layout.all_kv_heads:  # replicated
                return (
                    f"the {side} pod's {layout.tp_size} ranks do not split its "
                    f"{layout.all_kv_heads} KV heads evenly"
                )
        return ""

    @property
    def heads(self) -> range:
        """The model's KV heads this pool holds."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

    @property
    def row_bytes(self) -> int:
        element = torch.empty((), dtype=_DTYPES[self.dtype]).element_size()
        return 2 * self.num_kv_heads * self.head_dim * element

    def block_runs(self, blocks: list[int], peer: list[int]) -> list[tuple[int, int, int]]:
        """``(first block, first peer block, count)`` runs where both sides are consecutive."""
        runs: list[tuple[int, int, int]] = []
        for ours, theirs in zip(blocks, peer, strict=True):
            if runs and runs[-1][0] + runs[-1][2] == ours and runs[-1][1] + runs[-1][2] == theirs:
                first, peer_first, count = runs[-1]
                runs[-1] = (first, peer_first, count + 1)
            else:
                runs.append((ours, theirs, 1))
        return runs

    def descriptors(self, runs: list[tuple[int, int, int]], side: int) -> np.ndarray:
        """NIXL's (address, length, device) rows of ``runs``' blocks on ``side`` (0: first
        element of each run, 1: second), every layer."""
        row, bs = self.row_bytes, self.block_size
        rows = []
        for layer in range(self.num_layers):
            layer_base = self.base + layer * self.num_slots * row
            for run in runs:
                rows.append((layer_base + run[side] * bs * row, run[2] * bs * row, self.device_id))
        return np.array(rows, dtype=np.uint64).reshape(-1, 3)

    def head_descriptors(
        self, runs: list[tuple[int, int, int]], side: int, first_head: int, heads: int
    ) -> np.ndarray:
        """NIXL's rows of KV heads [first_head, + heads) of ``runs``' slots on ``side``: a K
        and a V segment a layer and slot (a slot's row is all its K heads, then all its V
        heads), layers outermost, in the same order on both sides of a read."""
        element = self.row_bytes // (2 * self.num_kv_heads * self.head_dim)
        head_bytes = self.head_dim * element
        bs = self.block_size
        slots = np.concatenate(
            [np.arange(run[side] * bs, (run[side] + run[2]) * bs, dtype=np.uint64) for run in runs]
        )
        layers = np.arange(self.num_layers, dtype=np.uint64) * np.uint64(self.num_slots)
        halves = np.array([first_head, self.num_kv_heads + first_head], dtype=np.uint64)
        starts = (
            (layers[:, None, None] + slots[None, :, None]) * np.uint64(self.row_bytes)
            + halves[None, None, :] * np.uint64(head_bytes)
            + np.uint64(self.base)
        ).reshape(-1)
        rows = np.empty((starts.size, 3), dtype=np.uint64)
        rows[:, 0] = starts
        rows[:, 1] = heads * head_bytes
        rows[:, 2] = self.device_id
        return rows


_DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16)}


def nixl_module():
    """NIXL's Python API: the ``nixl`` package (GPU nodes) or the CUDA-variant wheel that
    holds it (``nixl-cu12``, installed without its CUDA dependencies on CPU nodes)."""
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    raise SystemExit(
        "--kv-transfer-config: NIXL is not installed; pip install nixl (on CPU nodes "
        "`pip install --no-deps nixl-cu12`)"
    )


class TransferStuck(RuntimeError):
    """A read that failed and could not be cancelled: NIXL may still write into its blocks."""


@dataclass(frozen=True)
class ReadPlan:
    """One prompt's read, as every rank of a decode pod carries it out (each its own heads)."""

    agents: list[tuple[bytes, KVLayout]]  # the peer's ranks: NIXL metadata and layout
    peer_blocks: list[int]
    blocks: list[int]  # ours, in the same order
    # time.monotonic() by which every rank's read ends, set when the prefill pod granted it
    # (its pin runs from there): a clock every rank of a one-node group shares
    deadline: float


def failure_reason(error: BaseException) -> str:
    """A failed read's label in the failures metric."""
    if isinstance(error, TransferStuck):
        return "stuck"
    return "timeout" if isinstance(error, TimeoutError) else "transfer"


class NixlLink:
    """This pod's NIXL agent over its KV pool.

    Without NIXL's own progress thread: its Python API starts that thread with no delay between
    polls, so it spins a core even while idle, the core a decode pod's steps need. A reader
    drives its reads itself (`read` polls the transfer's state); a pool that others read
    (``lent``) is driven by a thread of ours every ``LENDER_PROGRESS_S``, which its readers'
    connections and (over TCP) their reads need."""

    def __init__(
        self, name: str, kv_cache: torch.Tensor, layout: KVLayout, lent: bool = False
    ) -> None:
        api = nixl_module()
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # two threads call it
        )
        self.agent = api.nixl_agent(name, config)
        self.mem = "VRAM" if kv_cache.is_cuda else "DRAM"
        device = kv_cache.device.index or 0
        nbytes = kv_cache.numel() * kv_cache.element_size()
        self.agent.register_memory([(kv_cache.data_ptr(), nbytes, device, "")], self.mem)
        self.kv_cache = kv_cache  # kept alive as long as it is registered
        self.layout = msgspec.structs.replace(
            layout, num_slots=kv_cache.shape[1], base=kv_cache.data_ptr(), device_id=device
        )
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._peers: dict[bytes, str] = {}  # remote metadata -> its agent's name
        self._closed = threading.Event()
        if lent:
            threading.Thread(target=self._progress, name="kv-progress", daemon=True).start()

    def _progress(self) -> None:
        while not self._closed.wait(LENDER_PROGRESS_S):
            try:
                self.agent.get_new_notifs()  # progresses the agent's UCX workers
            except Exception as exc:  # never fatal to the pod: its readers' reads fail
                log.warning("kv transfer: progressing the NIXL agent failed: %s", exc)

    def close(self) -> None:
        self._closed.set()

    def read(
        self,
        peer_metadata: bytes,
        peer: KVLayout,
        peer_blocks: list[int],
        blocks: list[int],
        timeout_s: float,
    ) -> int:
        """Copy the peer's blocks into ours; returns the bytes read. Raises TimeoutError or
        RuntimeError (the transfer failed)."""
        mine, theirs_heads = self.layout.heads, peer.heads
        first, stop = max(mine.start, theirs_heads.start), min(mine.stop, theirs_heads.stop)
        if first >= stop:  # another rank of this pod holds the heads that rank lends
            return 0
        name = self._peers.get(peer_metadata)
        if name is None:
            name = self._peers[peer_metadata] = self.agent.add_remote_agent(peer_metadata)
        runs = self.layout.block_runs(blocks, peer_blocks)
        if mine == theirs_heads:  # whole rows: a run a layer
            ours, theirs = self.layout.descriptors(runs, 0), peer.descriptors(runs, 1)
        else:  # the heads both hold: their K and V, slot by slot
            heads = stop - first
            ours = self.layout.head_descriptors(runs, 0, first - mine.start, heads)
            theirs = peer.head_descriptors(runs, 1, first - theirs_heads.start, heads)
        local = self.agent.get_xfer_descs(ours, self.mem)
        remote = self.agent.get_xfer_descs(theirs, self.mem)
        handle = self.agent.initialize_xfer("READ", local, remote, name)
        done = False
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"reading {len(blocks)} KV blocks took over {timeout_s:g} s")
                time.sleep(0.0005)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError(f"NIXL failed to read {len(blocks)} KV blocks")
            done = True
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as exc:
                if not done:  # still in flight, and NIXL could not cancel it
                    raise TransferStuck(f"a KV read could not be cancelled ({exc})") from None
                log.warning("a finished KV read's NIXL handle could not be released: %s", exc)
        head_row_bytes = peer.row_bytes // peer.num_kv_heads
        return len(blocks) * peer.block_size * head_row_bytes * (stop - first) * peer.num_layers

    def read_all(self, plan: ReadPlan) -> int:
        """`read` from every rank of the peer, by the plan's deadline; a failure forgets them
        all, so the next read connects anew."""
        read = 0
        try:
            for metadata, peer in plan.agents:
                left = max(0.001, plan.deadline - time.monotonic())
                read += self.read(metadata, peer, plan.peer_blocks, plan.blocks, left)
        except Exception:
            for metadata, _ in plan.agents:
                self.forget(metadata)
            raise
        return read

    def forget(self, peer_metadata: bytes) -> None:
        """Drop a peer (it refused, or a read from it failed): the next read connects anew."""
        name = self._peers.pop(peer_metadata, None)
        if name is not None:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:
                pass
