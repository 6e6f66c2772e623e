"""Calls one stage answers alone (/tokenize and /detokenize by the tokenizer, LoRA loads and
unloads by the scheduler): one future per uid.

No stage holds state for a call, so a call the api stops waiting for (its client went away,
its deadline passed) needs no abort: its uid is only remembered, in a bounded set, so that the
answer arriving afterwards is recognised and dropped instead of counted as a late reply. An
answer that has not come within ``horizon_s`` never will (the tokenizer answers in order, or
died), so the uid is forgotten then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from tokenline import protocol
from tokenline.api.http.errors import ApiError
from tokenline.bounded import ExpiringSet

Answer = protocol.TokenizerAnswer | protocol.LoraAnswer


class Calls:
    def __init__(self, abandoned_capacity: int = 4096, horizon_s: float = 630.0) -> None:
        self._pending: dict[str, asyncio.Future[Answer]] = {}
        self.abandoned = ExpiringSet(abandoned_capacity, horizon_s)

    def open(self, uid: str) -> asyncio.Future[Answer]:
        future = asyncio.get_running_loop().create_future()
        self._pending[uid] = future
        return future

    def close(self, uid: str) -> None:
        """Forget ``uid``, answered or not; every opened call is closed (a ``finally``)."""
        future = self._pending.pop(uid, None)
        if future is None:
            return
        if not future.done():
            future.cancel()
        # (a waiter that was cancelled cancelled the future with it)
        elif not future.cancelled() and future.exception() is None:  # read: never logged
            return  # answered: nothing more will come for it
        # Unanswered or failed here (the ring went down): an answer may still be on its way.
        self.abandoned.add(uid)

    def answer(self, message: Answer) -> bool:
        """Hand the answer to its waiting call; False when no call ever had this uid."""
        return self._settle(message.uid, lambda f: f.set_result(message))

    def fail(self, uid: str, error: ApiError) -> bool:
        """End the call ``uid`` with ``error``; False when ``uid`` is no call's."""
        return self._settle(uid, lambda f: f.set_exception(error))

    def fail_all(self, error: ApiError) -> None:
        for uid in list(self._pending):
            self.fail(uid, error)

    def _settle(self, uid: str, settle) -> bool:
        future = self._pending.get(uid)
        if future is None:
            if uid in self.abandoned:
                self.abandoned.discard(uid)
                return True
            return False
        if not future.done():
            settle(future)
        return True

    def __contains__(self, uid: object) -> bool:
        return uid in self._pending

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._pending))

    def __len__(self) -> int:
        return len(self._pending)
