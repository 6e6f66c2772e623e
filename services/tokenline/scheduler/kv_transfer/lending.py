"""The prefill pod's side: the KV blocks of prompts computed for a decode pod, lent to it.

A request with ``do_remote_decode`` keeps a reference to the full blocks of its prompt when its
prompt is computed; they are what the decode pod reads, and they go back to the pool when the
decode pod says it has read them (or needs them no more), or when the lease runs out, whichever
comes first. The last prompt token's block is never lent: the decode pod computes that token
itself, for its logits, as a prefix-cache hit would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenline.protocol import KVTransferParams
from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.kv_transfer.config import KVTransferConfig
from tokenline.scheduler.sequence import Sequence


@dataclass
class _Loan:
    blocks: list[int]
    expires: float  # monotonic
    expires_at: float  # the same, on the wall clock the reader compares with its own


class Lending:
    def __init__(self, pool: BlockPool, config: KVTransferConfig, host: str, port: int) -> None:
        self.pool = pool
        self.config = config
        self.host = host  # where decode pods reach the side channel
        self.port = port
        self.loans: dict[str, _Loan] = {}
        self.expired = 0  # loans that ran out unread, since start

    @property
    def held_blocks(self) -> int:
        return sum(len(loan.blocks) for loan in self.loans.values())

    def lend(self, seq: Sequence) -> None:
        """``seq``'s prompt is computed: keep its full blocks for the reader."""
        if seq.uid in self.loans:
            return
        blocks = seq.block_table[: (len(seq.prompt_ids) - 1) // self.pool.block_size]
        self.pool.retain(blocks)
        lease = self.config.lease_s
        self.loans[seq.uid] = _Loan(blocks, time.monotonic() + lease, time.time() + lease)

    def params(self, uid: str) -> KVTransferParams | None:
        """What the response tells the decode pod (vLLM's keys); None: nothing was lent."""
        loan = self.loans.get(uid)
        if loan is None:
            return None
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.config.engine_id,
            remote_request_id=uid,
            remote_block_ids=list(loan.blocks),
            remote_host=self.host,
            remote_port=self.port,
            tp_size=1,
            remote_blocks_expiry_time=loan.expires_at,
        )

    def give_back(self, uid: str) -> bool:
        loan = self.loans.pop(uid, None)
        if loan is None:
            return False  # released twice, or after its lease
        self.pool.drop(loan.blocks)
        return True

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        late = [uid for uid, loan in self.loans.items() if now > loan.expires]
        for uid in late:
            self.give_back(uid)
        self.expired += len(late)
        return len(late)
