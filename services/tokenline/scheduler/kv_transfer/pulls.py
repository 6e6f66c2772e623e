"""The decode pod's side: a request whose prompt a prefill pod computed reads that KV instead
of computing it, and never holds the decode loop up while it does.

On arrival the request's prompt is looked up in the local prefix cache; the full blocks it
lacks are taken from the pool and read from the prefill pod's on a worker thread (NIXL, after
a side-channel handshake that checks the two pools agree, and a claim the prefill pod must
grant: the request's blocks it will read and a digest of the prompt they hold). Meanwhile the
request waits here, outside the batch, as one whose grammar is being built does. Once read, the
blocks are cached under their names and the request joins the batch policy, which admits it
like any other: the blocks are prefix hits, so only the last, partial block is computed here.
This pod holds a reference to the blocks until the request is admitted, so nothing evicts them
in between. On a tensor-parallel pod every rank reads its own share of the heads into its own
pool (`RankReads`, the sharded runner); the blocks go back only once every rank has ended.

A read that fails (an unreachable or dead prefill pod, a peer without the service's
side-channel keys, a refused handshake or claim, a transfer error or timeout) gives the request
back for a local prefill (``recompute``) or ends it with ``kv_load_failed`` (``fail``); either
way its blocks go back, and a live prefill pod of this service is told to let go of its own,
unless the claim was refused: those may be another request's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import count
from typing import Protocol

from tokenline.protocol import KVTransferParams
from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.kv_transfer.config import KVTransferConfig
from tokenline.scheduler.kv_transfer.ledger import prefix_digest
from tokenline.scheduler.kv_transfer.link import NixlLink, ReadPlan, failure_reason
from tokenline.scheduler.kv_transfer.side_channel import (
    Claim,
    Grant,
    Release,
    SideChannelClient,
    Unauthenticated,
    Welcome,
)
from tokenline.scheduler.sequence import Sequence, Status

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 5.0
# After a peer was unreachable, reads from it fail at once for this long, rather than each
# waiting out a handshake's timeout in the worker's queue in front of other peers' reads.
UNREACHABLE_MEMORY_S = 10.0
# The addresses are clients' input, so at most this many are remembered; past it the oldest go
# first (such a peer costs one handshake's timeout again, no more).
UNREACHABLE_PEERS = 256
# How long past a read's deadline the other ranks of a tensor-parallel pod may take to say
# theirs ended; one that has not by then may still be writing: its blocks stay out of use.
RANK_GRACE_S = 5.0
_WORST = ("stuck", "timeout", "transfer")  # a read failed on several ranks: said as the first
RankRead = tuple[int, str, str]  # bytes read, failure reason ("" when none), its message


class RankReads(Protocol):
    """The other ranks of a tensor-parallel pod (the sharded runner): each reads its own
    share of the KV heads into its own pool, on a thread of its own."""

    def start_kv_reads(self, token: int, plan: ReadPlan) -> None: ...

    def wait_kv_reads(self, token: int, until: float) -> list[RankRead]: ...


class _Unreachable:
    """Peers that did not answer lately, each for UNREACHABLE_MEMORY_S, UNREACHABLE_PEERS at
    most: nothing a client names stays past its memory time."""

    def __init__(self) -> None:
        self._since: OrderedDict[tuple[str, int], float] = OrderedDict()  # oldest first

    def __contains__(self, peer: tuple[str, int]) -> bool:
        self._forget_old()
        return peer in self._since

    def __len__(self) -> int:
        self._forget_old()
        return len(self._since)

    def note(self, peer: tuple[str, int]) -> None:
        self._since.pop(peer, None)  # to the end: the order stays that of the times
        self._since[peer] = time.monotonic()
        self._forget_old()
        while len(self._since) > UNREACHABLE_PEERS:
            self._since.popitem(last=False)

    def forget(self, peer: tuple[str, int]) -> None:
        self._since.pop(peer, None)

    def _forget_old(self) -> None:
        horizon = time.monotonic() - UNREACHABLE_MEMORY_S
        while self._since and next(iter(self._since.values())) <= horizon:
            self._since.popitem(last=False)


class PullFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # the failures metric's label


@dataclass(eq=False)
class _Pull:
    seq: Sequence
    params: KVTransferParams
    first_index: int  # the first block of the prompt read (those before were cached here)
    blocks: list[int]  # this pool's blocks the read fills (empty until there is room)
    future: Future | None = None
    started: float = 0.0
    dropped: bool = False  # aborted while the read ran: its blocks go back once it ends


class Pulls:
    def __init__(
        self,
        pool: BlockPool,
        config: KVTransferConfig,
        link: NixlLink,
        ranks: RankReads | None = None,
    ) -> None:
        self.pool = pool
        self.config = config
        self.link = link
        self.ranks = ranks
        self._tokens = count()  # names each read to the other ranks
        self._client = SideChannelClient(config.side_channel_keys)  # the worker thread's
        self._welcomes: dict[tuple[str, int], Welcome] = {}  # the worker's too
        self._unreachable = _Unreachable()  # the worker's too
        self._dropped = 0  # aborted reads still in flight, named apart in ``pending``
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        self.pending: dict[str, _Pull] = {}  # waiting for room or for the read
        self._admitting: dict[str, _Pull] = {}  # read, in the policy, blocks still held here
        # since the stage last took them: bytes read, seconds per read, failures by reason
        self.bytes_read = 0
        self.seconds: list[float] = []
        self.failures: Counter[str] = Counter()

    # ── arrival ───────────────────────────────────────────────────────────────────────────────
    def arrive(self, seq: Sequence, params: KVTransferParams) -> bool:
        """True: ``seq`` waits here for its read; False: nothing to read, it joins at once."""
        bs = self.pool.block_size
        wanted = min(len(params.remote_block_ids or ()), (len(seq.prompt_ids) - 1) // bs)
        cached = len(self.pool.lookup(seq)) if not seq.scores_prompt else wanted
        if cached >= wanted:  # all here already (or every position must be computed anyway)
            self._release_remote(params, seq)
            return False
        seq.cached_tokens = cached * bs  # the prompt tokens this pod had, not those it reads
        self.pending[seq.uid] = _Pull(seq, params, cached, [])
        self._start(self.pending[seq.uid], wanted)
        return True

    def _start(self, pull: _Pull, wanted: int | None = None) -> None:
        bs = self.pool.block_size
        if wanted is None:
            lent = len(pull.params.remote_block_ids or ())
            wanted = min(lent, (len(pull.seq.prompt_ids) - 1) // bs)
        count = wanted - pull.first_index
        if self.pool.num_free < count + self.pool.blocks_for(bs):  # room for the rest too
            return  # retried each step until blocks free up
        pull.blocks = self.pool.take(count)
        peer_blocks = pull.params.remote_block_ids[pull.first_index : wanted]
        pull.started = time.monotonic()
        pull.future = self._worker.submit(
            self._read, pull.params, pull.seq, pull.first_index, peer_blocks, pull.blocks
        )

    # ── the worker thread ─────────────────────────────────────────────────────────────────────
    def _read(
        self,
        params: KVTransferParams,
        seq: Sequence,  # only its prompt and adapter are read here, both fixed
        first: int,
        peer_blocks: list[int],
        blocks: list[int],
    ) -> int:
        host, port = params.remote_host or "", int(params.remote_port or 0)
        welcome = self._welcomes.get((host, port))
        if welcome is not None and welcome.engine_id != params.remote_engine_id:
            welcome = None  # another pod (a restart) at the same address: shake hands anew
        grant: Grant | None = None
        try:
            if welcome is None:
                welcome = self._hello(host, port)
            claim = Claim(
                params.remote_request_id or "",
                first,
                list(peer_blocks),
                prefix_digest(
                    seq.prompt_ids[: (first + len(peer_blocks)) * self.pool.block_size], seq.lora
                ),
                self.config.pull_timeout_s,
            )
            grant = self._claim(host, port, claim)
            # the prefill pod holds the blocks as long as it pinned them, no longer
            deadline = time.monotonic() + min(self.config.pull_timeout_s, grant.pinned_s)
            read = self._read_every_rank(ReadPlan(welcome.agents(), peer_blocks, blocks, deadline))
        except PullFailed as failure:
            if failure.reason in ("claim_refused", "expired"):
                raise  # the peer is sound; the blocks may be another request's: no release
            self._welcomes.pop((host, port), None)
            if welcome is not None:
                for metadata, _ in welcome.agents():
                    self.link.forget(metadata)
            # a live peer of ours lets its blocks go at once; one that failed the handshake
            # hears nothing more from this pod
            if failure.reason not in ("unreachable", "unauthenticated"):
                self._release(params, seq, 0, grant.token if grant else b"")
            raise
        self._release(params, seq, read, grant.token)
        return read

    def _read_every_rank(self, plan: ReadPlan) -> int:
        """Each rank of this pod reads its heads of the plan's blocks from every rank of the
        peer (rank 0 here, a tensor-parallel pod's workers beside it); raises PullFailed with
        the worst failure once every rank has ended."""
        token = next(self._tokens)
        if self.ranks is not None:
            self.ranks.start_kv_reads(token, plan)
        results: list[RankRead] = []
        try:
            results.append((self.link.read_all(plan), "", ""))
        except Exception as exc:  # NIXL's errors: a dead or restarted peer
            results.append((0, failure_reason(exc), str(exc)))
        if self.ranks is not None:  # they write into these blocks too: all end first
            results += self.ranks.wait_kv_reads(token, plan.deadline + RANK_GRACE_S)
        failures = [(reason, message) for _, reason, message in results if reason]
        if failures:
            reason, message = min(failures, key=lambda failure: _WORST.index(failure[0]))
            if reason == "transfer":
                message = f"reading the prompt's KV failed: {message}"
            raise PullFailed(reason, message)
        return sum(read for read, _, _ in results)

    def _claim(self, host: str, port: int, claim: Claim) -> Grant:
        """The prefill pod's grant of ``claim``; raises PullFailed when it refuses."""
        try:
            grant = self._client.claim(host, port, claim, HELLO_TIMEOUT_S)
        except Unauthenticated as exc:  # the peer was replaced by one with other keys
            raise PullFailed("unauthenticated", str(exc)) from None
        except TimeoutError as exc:
            self._unreachable.note((host, port))
            raise PullFailed("unreachable", str(exc)) from None
        except Exception as exc:  # an answer that is not ours
            raise PullFailed("refused", f"the side channel at {host}:{port}: {exc}") from None
        if grant.refusal:
            reason = grant.reason if grant.reason == "expired" else "claim_refused"
            raise PullFailed(reason, f"the prefill pod refused the read: {grant.refusal}")
        return grant

    def _hello(self, host: str, port: int) -> Welcome:
        """The peer's agent and layout, checked against ours; raises PullFailed."""
        if (host, port) in self._unreachable:
            raise PullFailed("unreachable", f"the prefill pod at {host}:{port} was unreachable")
        try:
            welcome = self._client.hello(host, port, self.link.layout, HELLO_TIMEOUT_S)
        except Unauthenticated as exc:
            raise PullFailed("unauthenticated", str(exc)) from None
        except TimeoutError as exc:
            self._unreachable.note((host, port))
            raise PullFailed("unreachable", str(exc)) from None
        except Exception as exc:  # an answer that is not ours: not a pod to read from
            self._client.drop(host, port)
            raise PullFailed("refused", f"the side channel at {host}:{port}: {exc}") from None
        self._unreachable.forget((host, port))
        mismatch = welcome.refusal or next(
            (m for _, layout in welcome.agents() if (m := self.link.layout.mismatch(layout))), ""
        )
        if not mismatch and len(welcome.agents()) != welcome.layout.tp_size:
            mismatch = (
                f"the prefill pod runs {welcome.layout.tp_size} tensor-parallel ranks but offers "
                f"{len(welcome.agents())} to read from"
            )
        if mismatch:
            raise PullFailed("refused", f"the prefill pod's KV does not fit: {mismatch}")
        if not welcome.claims:  # it would not check that the blocks are this request's
            raise PullFailed(
                "refused",
                f"the prefill pod at {host}:{port} runs a tokenline that does not check claims; "
                "upgrade it to read from it",
            )
        self._welcomes[host, port] = welcome
        return welcome

    def _release_remote(self, params: KVTransferParams, seq: Sequence) -> None:
        """Tell the prefill pod, from the worker, that nothing will be read."""
        self._worker.submit(self._release, params, seq, 0, b"")

    def _release(
        self, params: KVTransferParams, seq: Sequence, bytes_read: int, token: bytes
    ) -> None:
        host, port = params.remote_host or "", int(params.remote_port or 0)
        lent = len(params.remote_block_ids or ()) * self.pool.block_size
        # without a granted claim's token, the prompt is the proof that the loan is ours
        digest = b"" if token else prefix_digest(seq.prompt_ids[:lent], seq.lora)
        release = Release(params.remote_request_id or "", bytes_read, token, digest)
        self._client.release(host, port, release)

    # ── between steps ─────────────────────────────────────────────────────────────────────────
    def tend(self) -> None:
        """Blocks held for requests admitted (or gone) since go back; reads that wait for
        room start when there is some."""
        for uid, pull in list(self._admitting.items()):
            if pull.seq.status is not Status.WAITING:  # admitted (sharing them) or gone
                self.pool.drop(pull.blocks)
                del self._admitting[uid]
        for pull in self.pending.values():
            if pull.future is None:
                self._start(pull)

    def poll(self) -> tuple[list[Sequence], list[tuple[Sequence, PullFailed]]]:
        """Requests read (to join the policy) and requests whose read failed."""
        self.tend()
        ready: list[Sequence] = []
        failed: list[tuple[Sequence, PullFailed]] = []
        for uid, pull in list(self.pending.items()):
            if pull.future is None or not pull.future.done():
                continue
            del self.pending[uid]
            error = pull.future.exception()
            if isinstance(error, PullFailed) and error.reason == "stuck":
                # NIXL may still write into these blocks: they never go back to the pool
                log.error("%s: %s; %d KV blocks are kept out of use", uid, error, len(pull.blocks))
            elif pull.dropped or error is not None:
                self.pool.drop(pull.blocks)
            if pull.dropped:
                continue
            if error is not None:
                failure = error
                if not isinstance(error, PullFailed):
                    failure = PullFailed("transfer", str(error))
                self.failures[failure.reason] += 1
                log.warning("%s: %s", uid, failure)
                failed.append((pull.seq, failure))
                continue
            self.bytes_read += pull.future.result()
            self.seconds.append(time.monotonic() - pull.started)
            for offset, block in enumerate(pull.blocks):
                self.pool.adopt(pull.seq, pull.first_index + offset, block)
            self._admitting[uid] = pull
            ready.append(pull.seq)
        return ready, failed

    def drop(self, uid: str) -> Sequence | None:
        """An abort: the request is forgotten here; a read in flight ends first."""
        pull = self._admitting.pop(uid, None)
        if pull is not None:
            self.pool.drop(pull.blocks)
            return None  # the policy holds the sequence itself
        pull = self.pending.pop(uid, None)
        if pull is None:
            return None
        if pull.future is None:
            self._release_remote(pull.params, pull.seq)
        elif pull.future.done():
            self.pool.drop(pull.blocks)
        else:  # NIXL still writes into its blocks: they go back when it is done
            pull.dropped = True
            self._dropped += 1
            self.pending[f"{uid}#dropped{self._dropped}"] = pull
        return pull.seq

    def uids(self) -> list[str]:
        return [uid for uid, pull in self.pending.items() if not pull.dropped]

    def busy(self) -> bool:
        return bool(self.pending or self._admitting)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
