"""Which adapters exist, which sit in host memory and which occupy a device slot. No tensors:
the policy asks this for a slot at admission, the engine wires ``load`` (disk → host) and
``write_slot`` (host → device) to the real thing, and tests pass fakes.

- Known adapters (name → uri) are every adapter a request may name; an unknown name is a 404.
- The host keeps at most ``max_cpu_loras`` of them loaded, least recently used evicted first;
  an evicted one is read again from its uri when it next needs a slot.
- ``max_loras`` device slots. A running sequence holds a reference on its adapter's slot; a
  slot nobody references stays resident (a later request finds it there) until a waiting
  sequence's adapter needs it, least recently used first. When every slot is referenced the
  sequence waits.
- Unload marks the adapter draining: new requests for it are refused, the ones held finish,
  and the last one out frees its slot and host copy.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

from tokenline.scheduler.lora.adapters import AdapterNotFound, LoraAdapter, LoraError

Loader = Callable[[str, str], LoraAdapter]  # (name, uri) → adapter, or raises LoraError
SlotWriter = Callable[[int, LoraAdapter | None], None]


class LoraSlots:
    def __init__(
        self, max_loras: int, max_cpu_loras: int, load: Loader, write_slot: SlotWriter
    ) -> None:
        if max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self._load = load
        self._write_slot = write_slot
        self.uris: dict[str, str] = {}  # every adapter loaded, draining ones included
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU, oldest first
        self.slots: list[str | None] = [None] * max_loras
        self._lru: OrderedDict[str, None] = OrderedDict()  # resident adapters, oldest first
        self.refs: Counter[str] = Counter()  # sequences holding the adapter's slot
        self.users: Counter[str] = Counter()  # sequences the scheduler holds, any state
        self.draining: set[str] = set()

    # ── the adapter set ────────────────────────────────────────────────────────────────────────
    def known(self, name: str) -> bool:
        """Whether a new request may name ``name``."""
        return name in self.uris and name not in self.draining

    @property
    def names(self) -> list[str]:
        return sorted(n for n in self.uris if n not in self.draining)

    def add(self, name: str, uri: str) -> LoraAdapter:
        """Load ``name`` from ``uri`` into host memory and make it servable."""
        if name in self.draining:
            raise LoraError(f"The lora adapter '{name}' is being unloaded; retry when it is gone")
        if name in self.uris:
            raise LoraError(f"The lora adapter '{name}' has already been loaded.")
        adapter = self._load(name, uri)
        self.uris[name] = uri
        self._keep(adapter)
        return adapter

    def unload(self, name: str) -> None:
        """Refuse new requests for ``name``; it goes when the last one it holds ends."""
        if not self.known(name):
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        self.draining.add(name)
        self._collect(name)

    # ── sequences ──────────────────────────────────────────────────────────────────────────────
    def enter(self, name: str) -> None:
        """A sequence of ``name`` is now held by the scheduler."""
        self.users[name] += 1

    def leave(self, name: str) -> None:
        self.users[name] -= 1
        if self.users[name] <= 0:
            del self.users[name]
            self._collect(name)

    def slot_of(self, name: str) -> int | None:
        return self.slots.index(name) if name in self._lru else None

    def acquire(self, name: str) -> int | None:
        """A slot holding ``name`` for one more sequence, loading it there if needed; None
        when every slot is held by sequences of other adapters (the sequence waits)."""
        slot = self.slot_of(name)
        if slot is None:
            free = [s for s, held in enumerate(self.slots) if held is None]
            if free:
                slot = free[0]
            else:
                idle = next((n for n in self._lru if self.refs[n] == 0), None)
                if idle is None:
                    return None
                slot = self.slots.index(idle)
                del self._lru[idle]
            self._write_slot(slot, self._host_copy(name))
            self.slots[slot] = name
            self._lru[name] = None
        self._lru.move_to_end(name)
        self.refs[name] += 1
        return slot

    def release(self, name: str) -> None:
        self.refs[name] -= 1
        if self.refs[name] <= 0:
            del self.refs[name]

    # ── inside ─────────────────────────────────────────────────────────────────────────────────
    def _host_copy(self, name: str) -> LoraAdapter:
        adapter = self.host.get(name)
        if adapter is None:  # evicted from host memory: read again
            adapter = self._load(name, self.uris[name])
            self._keep(adapter)
        self.host.move_to_end(name)
        return adapter

    def _keep(self, adapter: LoraAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    def _collect(self, name: str) -> None:
        """Forget a draining adapter once no sequence holds it."""
        if name not in self.draining or self.users[name] > 0:
            return
        slot = self.slot_of(name)
        if slot is not None:
            del self._lru[name]
            self.slots[slot] = None
            self._write_slot(slot, None)
        self.refs.pop(name, None)
        self.host.pop(name, None)
        del self.uris[name]
        self.draining.discard(name)

    def counts(self) -> dict[str, int]:
        """Adapters by state, for tokenline_lora_adapters{state}."""
        return {
            "resident": len(self._lru),
            "host": len(self.host),
            "draining": len(self.draining),
        }
