"""Bounded histories and caches: everything a stage keeps beyond a request's life has a limit.

Two shapes cover every such structure in tokenline:

- `ExpiringSet`: uids remembered for a while after something happened to them (an abort that
  may have overtaken its request, a uid ended early whose scheduler end is still to come). An
  entry is useless once its time is up, so it expires; a count limit caps a burst.
- `LruCache`: results reused by key (grammar checks, built grammar matchers), where one entry
  may be large because a client chose the key: bounded both in entries and in bytes, as the
  cost function of the cache counts them, least recently used evicted first; an entry that
  alone costs more than a quarter of the byte budget is not kept at all.

Each exports its size as ``tokenline_cache_entries{stage, cache}`` (`metrics.track_cache`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ExpiringSet:
    """A set whose members leave ``ttl_s`` after they were added, or, oldest first, when more
    than ``capacity`` are held. Expired members are dropped as new ones arrive."""

    def __init__(
        self, capacity: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._items: OrderedDict[str, float] = OrderedDict()  # member → when it expires
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock

    def add(self, item: str, ttl_s: float | None = None) -> None:
        now = self._clock()
        self._items[item] = now + (self.ttl_s if ttl_s is None else ttl_s)
        self._items.move_to_end(item)
        self.prune(now)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def discard(self, item: str) -> None:
        self._items.pop(item, None)

    def prune(self, now: float | None = None) -> None:
        """Drop expired members from the oldest end (a member added with a longer time than
        its successors may hold the ones behind it until it goes: the capacity still holds)."""
        now = self._clock() if now is None else now
        while self._items:
            item, expires = next(iter(self._items.items()))
            if expires > now:
                break
            del self._items[item]

    def __contains__(self, item: object) -> bool:
        expires = self._items.get(item)  # type: ignore[call-overload]
        return expires is not None and expires > self._clock()

    def __len__(self) -> int:
        return len(self._items)


class LruCache(Generic[K, V]):
    """At most ``max_entries`` entries and ``max_bytes`` of ``cost(key, value)``; the least
    recently used go first. An entry costing over a quarter of ``max_bytes`` is not kept, so
    one huge key cannot flush every other entry. Safe to share between threads (the api
    checks grammars on worker threads)."""

    def __init__(self, max_entries: int, max_bytes: int, cost: Callable[[K, V], int]) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._cost = cost
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                self.misses += 1
                return None
            self.hits += 1
            self._items.move_to_end(key)
            return entry[0]

    def put(self, key: K, value: V) -> None:
        cost = self._cost(key, value)
        with self._lock:
            self._discard(key)
            if cost > self.max_bytes // 4:
                return
            self._items[key] = (value, cost)
            self.bytes += cost
            while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, evicted) = self._items.popitem(last=False)
                self.bytes -= evicted

    def discard(self, key: K) -> None:
        with self._lock:
            self._discard(key)

    def _discard(self, key: K) -> None:
        entry = self._items.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


def text_cost(key: str, value: object) -> int:
    """Bytes a cache entry of text keeps: the key's and a text value's characters, plus the
    bookkeeping of one entry (about 200 bytes in CPython)."""
    return 200 + len(key) + (len(value) if isinstance(value, str) else 0)


def cached_by_text(
    max_entries: int, max_bytes: int
) -> Callable[[Callable[[str], V]], Callable[[str], V]]:
    """A decorator like ``functools.lru_cache`` for functions of one text argument, bounded in
    bytes as well as in entries (`LruCache` with `text_cost`). The wrapper's ``cache`` is the
    `LruCache`, for its size gauge. An exception is raised again and not cached."""

    def decorate(function: Callable[[str], V]) -> Callable[[str], V]:
        cache: LruCache[str, tuple[V]] = LruCache(
            max_entries, max_bytes, lambda key, value: text_cost(key, value[0])
        )

        def wrapper(text: str) -> V:
            hit = cache.get(text)
            if hit is not None:
                return hit[0]
            result = function(text)
            cache.put(text, (result,))  # boxed: None is a result worth caching too
            return result

        wrapper.cache = cache  # type: ignore[attr-defined]
        wrapper.__wrapped__ = function  # type: ignore[attr-defined]
        wrapper.__doc__ = function.__doc__
        wrapper.__name__ = function.__name__
        return wrapper

    return decorate
