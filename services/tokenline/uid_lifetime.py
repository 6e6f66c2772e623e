"""What a message means for a uid's lifetime: which uids it starts, ends or hands on.

One reading of the protocol's promise (every stage sees the end of every uid it saw the start
of), by which each stage's leak ledger (stage_runtime.py) opens and closes a uid, kept apart
from the wire schema so that the rule reads in one place.
"""

from __future__ import annotations

import msgspec

from tokenline.protocol import (
    Abort,
    Begin,
    Failed,
    Generate,
    LoraAnswer,
    ReplyBatch,
    TokenBatch,
    Tokenized,
    TokenizerAnswer,
)


def started_uids(message: msgspec.Struct) -> list[tuple[str, float]]:
    """(uid, timeout) for each uid whose state a stage creates when ``message`` arrives."""
    if isinstance(message, Generate | Tokenized | Begin):
        return [(message.uid, message.timeout_s)]
    return []


def ended_uids(message: msgspec.Struct) -> list[str]:
    """Uids that ``message``, sent onward, ends: no stage before it holds them any longer."""
    if isinstance(message, Failed | Abort | TokenizerAnswer | LoraAnswer):
        return [message.uid]
    if isinstance(message, TokenBatch):
        return [o.uid for o in message.outputs if o.finish_reason is not None]
    if isinstance(message, ReplyBatch):
        return [r.uid for r in message.replies if r.finish_reason is not None]
    return []


def released_uids(message: msgspec.Struct) -> list[str]:
    """Uids the sending stage lets go of by sending ``message``: their end, or a hand-off."""
    if isinstance(message, Tokenized):
        return [message.uid]
    return ended_uids(message)


def uids_of(message: msgspec.Struct) -> list[str]:
    """Every uid a message concerns."""
    if isinstance(message, TokenBatch):
        return [o.uid for o in message.outputs]
    if isinstance(message, ReplyBatch):
        return [r.uid for r in message.replies]
    uid = getattr(message, "uid", None)
    return [uid] if uid is not None else []
