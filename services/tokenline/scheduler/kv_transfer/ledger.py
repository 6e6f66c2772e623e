"""The prefill pod's loans as both of its threads see them: the scheduler lends and frees, the
side channel's thread grants claims and pins. One lock guards them; no I/O happens here, so the
rules below are tested with plain calls.

A claim is granted only for a live loan (lent, not released, its lease not over) whose blocks
at the claimed positions are exactly the claimed ids, and only to a reader whose prompt, up to
the last claimed block, and its adapter, hash as the loan's do: a KV block holds what its whole
prefix (and the adapter) made of it, so a reader can only read KV of tokens it already has, and
never caches KV under names other than those it was computed for. A grant pins the loan: its lease
cannot end while the reader reads, for the read's time at most, so a reader that dies pins
nothing for long. A release ends the loan (the blocks go back once no pin is left) when it names
a pin's token or proves the prompt the same way: a forged release cannot free another request's
blocks under its reader.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenline.scheduler.kv_transfer.side_channel import Claim, Grant, Release

log = logging.getLogger(__name__)
# A pin outlasts the read it covers by this much: the reader's clock starts after the grant
# travelled to it.
PIN_GRACE_S = 1.0


def prefix_digest(token_ids: Sequence[int], lora: str = "") -> bytes:
    """What both pods compute from a prompt's tokens and adapter to show they mean the same."""
    digest = hashlib.blake2b(lora.encode(), digest_size=16)
    digest.update(b"\0")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass
class Loan:
    blocks: list[int]
    tokens: list[int]  # the prompt's tokens the blocks hold, in order
    expires: float  # monotonic
    expires_at: float  # the same, on the wall clock the reader compares with its own
    lora: str = ""  # the adapter the KV was computed with
    pins: dict[bytes, float] = field(default_factory=dict)  # a grant's token -> until (monotonic)
    released: bool = False

    def pinned(self, now: float) -> bool:
        return any(until > now for until in self.pins.values())


class Ledger:
    def __init__(self, block_size: int, pin_s: float) -> None:
        self.block_size = block_size
        self.pin_s = pin_s  # the longest pin one claim gets
        self._lock = threading.Lock()
        self._loans: dict[str, Loan] = {}

    # ── the scheduler's thread ────────────────────────────────────────────────────────────────
    def add(self, uid: str, loan: Loan) -> None:
        with self._lock:
            self._loans[uid] = loan

    def get(self, uid: str) -> Loan | None:
        with self._lock:
            return self._loans.get(uid)

    def snapshot(self) -> dict[str, Loan]:
        with self._lock:
            return dict(self._loans)

    def remove(self, uid: str) -> Loan | None:
        """The loan ends now, pinned or not (this pod's own decision)."""
        with self._lock:
            return self._loans.pop(uid, None)

    def release(self, release: Release, now: float | None = None) -> tuple[bool, Loan | None]:
        """A reader is done with a loan: (whether the release names a granted read, the loan
        when its blocks may go back now: None while another pin holds them, or when the release
        proves nothing)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            loan = self._loans.get(release.request_id)
            if loan is None:
                return False, None  # released twice, or after its lease
            granted = bool(release.token) and loan.pins.pop(release.token, None) is not None
            if not granted and not (
                release.digest and release.digest == prefix_digest(loan.tokens, loan.lora)
            ):
                log.warning(
                    "kv side channel: a release of %s that names no claim of it nor its "
                    "prompt; ignored (the lease frees it)",
                    release.request_id,
                )
                return False, None
            loan.released = True
            if loan.pinned(now):
                return granted, None  # another reader still reads: ``take_done`` frees it
            return granted, self._loans.pop(release.request_id)

    def take_done(self, now: float) -> tuple[list[Loan], list[Loan]]:
        """Loans that end now, no pin holding them: (released, past their lease)."""
        released: list[Loan] = []
        late: list[Loan] = []
        with self._lock:
            for uid, loan in list(self._loans.items()):
                if loan.pinned(now) or not (loan.released or now > loan.expires):
                    continue
                del self._loans[uid]
                (released if loan.released else late).append(loan)
        return released, late

    # ── the side channel's thread ─────────────────────────────────────────────────────────────
    def claim(self, claim: Claim, now: float | None = None) -> Grant:
        """Grant (and pin) or refuse ``claim``, saying why."""
        now = time.monotonic() if now is None else now
        uid, first, ids = claim.request_id, claim.first, list(claim.block_ids)
        with self._lock:
            loan = self._loans.get(uid)
            if loan is None or loan.released or now > loan.expires:
                return Grant(
                    uid,
                    refusal=f"the prefill pod holds no live loan for request {uid!r} (unknown, "
                    "released, or its lease ended)",
                    reason="expired",
                )
            end = first + len(ids)
            if not ids or first < 0 or end > len(loan.blocks) or loan.blocks[first:end] != ids:
                return Grant(
                    uid,
                    refusal=f"blocks {_shown(ids)} from position {first} are not request "
                    f"{uid!r}'s ({len(loan.blocks)} blocks lent)",
                    reason="claim_refused",
                )
            if claim.digest != prefix_digest(loan.tokens[: end * self.block_size], loan.lora):
                return Grant(
                    uid,
                    refusal=f"the reader's prompt (or adapter) is not the one request {uid!r}'s "
                    "blocks hold",
                    reason="claim_refused",
                )
            seconds = min(claim.seconds, self.pin_s) if claim.seconds > 0 else self.pin_s
            token = os.urandom(16)
            loan.pins[token] = now + seconds + PIN_GRACE_S
            return Grant(uid, token=token, pinned_s=seconds)


def _shown(ids: list[int]) -> str:
    return str(ids) if len(ids) <= 8 else f"[{', '.join(map(str, ids[:8]))}, ...]"
