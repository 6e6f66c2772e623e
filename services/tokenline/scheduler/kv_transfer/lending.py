"""The prefill pod's side: the KV blocks of prompts computed for a decode pod, lent to it.

A request with ``do_remote_decode`` keeps a reference to the full blocks of its prompt when its
prompt is computed; they are what the decode pod reads, and they go back to the pool when the
decode pod says it has read them (or needs them no more), or when the lease runs out, whichever
comes first; a read the prefill pod granted (ledger.py) holds them past the lease until it ends.
The last prompt token's block is never lent: the decode pod computes that token itself, for its
logits, as a prefix-cache hit would.
"""

from __future__ import annotations

import time

from tokenline.protocol import KVTransferParams
from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.kv_transfer.config import KVTransferConfig
from tokenline.scheduler.kv_transfer.ledger import Ledger, Loan
from tokenline.scheduler.kv_transfer.side_channel import Claim, Grant, Release
from tokenline.scheduler.sequence import Sequence


class Lending:
    """Used from the scheduler's thread, but for ``claim`` (the side channel's)."""

    def __init__(
        self, pool: BlockPool, config: KVTransferConfig, host: str, port: int, tp_size: int = 1
    ) -> None:
        self.pool = pool
        self.tp_size = tp_size  # the answer tells the reader; it reads every rank's heads
        self.config = config
        self.host = host  # where decode pods reach the side channel
        self.port = port
        self.ledger = Ledger(pool.block_size, config.pull_timeout_s)
        self.expired = 0  # loans that ran out unread, since start

    @property
    def loans(self) -> dict[str, Loan]:
        return self.ledger.snapshot()

    @property
    def held_blocks(self) -> int:
        return sum(len(loan.blocks) for loan in self.ledger.snapshot().values())

    def lend(self, seq: Sequence) -> None:
        """``seq``'s prompt is computed: keep its full blocks for the reader."""
        if self.ledger.get(seq.uid) is not None:
            return
        full = (len(seq.prompt_ids) - 1) // self.pool.block_size
        blocks = seq.block_table[:full]
        self.pool.retain(blocks)
        lease = self.config.lease_s
        tokens = list(seq.prompt_ids[: full * self.pool.block_size])
        loan = Loan(blocks, tokens, time.monotonic() + lease, time.time() + lease, seq.lora)
        self.ledger.add(seq.uid, loan)

    def params(self, uid: str) -> KVTransferParams | None:
        """What the response tells the decode pod (vLLM's keys); None: nothing was lent."""
        loan = self.ledger.get(uid)
        if loan is None:
            return None
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.config.engine_id,
            remote_request_id=uid,
            remote_block_ids=list(loan.blocks),
            remote_host=self.host,
            remote_port=self.port,
            tp_size=self.tp_size,
            remote_blocks_expiry_time=loan.expires_at,
        )

    def claim(self, claim: Claim) -> Grant:
        """A reader's claim, answered on the side channel's thread."""
        return self.ledger.claim(claim)

    def release(self, release: Release) -> tuple[bool, bool]:
        """A reader's release: (it names a granted read, the blocks went back now)."""
        granted, loan = self.ledger.release(release)
        if loan is not None:
            self.pool.drop(loan.blocks)
        return granted, loan is not None

    def give_back(self, uid: str) -> bool:
        """The loan ends now, whoever reads it."""
        loan = self.ledger.remove(uid)
        if loan is None:
            return False  # released twice, or after its lease
        self.pool.drop(loan.blocks)
        return True

    def expire(self, now: float | None = None) -> int:
        """Released loans no pin holds any more, and those past their lease unpinned, go back;
        returns how many ran out unread."""
        now = time.monotonic() if now is None else now
        released, late = self.ledger.take_done(now)
        for loan in released + late:
            self.pool.drop(loan.blocks)
        self.expired += len(late)
        return len(late)
