"""KV cache block accounting: which fixed-size blocks of the pool each sequence holds, and which
blocks hold a known prefix (automatic prefix caching).

A full block is named by a hash chain: the hash of its parent block's name and its own token
ids, so equal names mean equal tokens at equal positions, hence equal K/V (the model, its dtype
and the block size are fixed for the life of a pool). Once a block's K/V is computed it is
registered under its name; a later sequence whose prompt starts with the same tokens shares it
by reference count instead of computing it again. A block nobody references keeps its name and
stays cached until the pool needs room: then the least recently released goes first. Blocks
that never got a name (partial, or a duplicate of a block already registered) are handed out
before any cached one is evicted.

Only blocks whose K/V has been written are registered (``cache_full_blocks`` runs after the
forward pass), so a sequence can never share a block still being computed in the same step.
A shared block is always full and a sequence only writes past its own computed tokens, so
nothing ever writes into a shared block: no copy-on-write is needed.

KV-cache events (kv_events.py publishes them in vLLM's wire format): while ``events`` is a
list, the pool appends to it what a router needs to mirror the cache: a run of blocks stored
(registered under their names), a block removed (its name evicted), all blocks cleared. Off
(``None``) nothing is recorded, so a pool nobody listens to pays one attribute test per event.

Block names (``hash_algo``): ``blake2b``, the default, is blake2b-256 over the parent's name
(empty for a prompt's first block) followed by the block's token ids as signed 64-bit
little-endian integers. ``sha256_cbor`` is vLLM's ``--prefix-caching-hash-algo sha256_cbor``:
sha256 of the canonical CBOR of ``(parent, tuple(token_ids), None)``, the first block's parent
being ``NONE_HASH`` = sha256_cbor(``PYTHONHASHSEED``) (random when that is unset, as in vLLM),
so an indexer that hashes prompts itself (llm-d's) computes the names this pool publishes.

LoRA: a sequence served by an adapter names every block with the adapter's name too (vLLM's
extra hash keys: ``(parent, tokens, (lora_name,))`` under sha256_cbor), so the same tokens
under two adapters, or under an adapter and the base, never share K/V; the base model's names
are unchanged. Stored events carry the adapter's name.
"""

from __future__ import annotations

import hashlib
import logging
import os
from array import array
from collections import OrderedDict
from collections.abc import Callable

from tokenline.scheduler.sequence import Sequence

log = logging.getLogger(__name__)

HASH_ALGOS = ("blake2b", "sha256_cbor")
# What ``BlockPool.events`` holds: (STORED, names, parent name or None, token ids of those
# blocks, LoRA adapter name or None), (REMOVED, name), (CLEARED,).
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
BlockHasher = Callable[[bytes, list[int], str], bytes]  # (parent, token ids, LoRA name)


def block_hash(parent: bytes, token_ids: list[int], lora: str = "") -> bytes:
    """The name of a full block: a collision-safe hash of its parent's name and its tokens.

    A collision would hand one prompt another's K/V, so Python's ``hash`` (64 bits, and
    trivially collided for ints) is not good enough; blake2b is fast and cryptographic."""
    digest = hashlib.blake2b(parent, digest_size=32)
    digest.update(array("q", token_ids).tobytes())
    if lora:  # after a full block's fixed-size tokens, so no two inputs run together
        digest.update(b"\x00lora\x00" + lora.encode())
    return digest.digest()


def sha256_cbor_hasher(seed: str | None = None) -> BlockHasher:
    """vLLM's ``sha256_cbor`` block hash, with vLLM's ``NONE_HASH`` for a first block's parent:
    sha256_cbor of the seed (``PYTHONHASHSEED``, as vLLM reads it), else 32 random bytes.

    cbor2 is imported here, not at module load: only this option needs it."""
    import cbor2

    def sha256_cbor(value: object) -> bytes:
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    none_hash = sha256_cbor(seed) if seed is not None else os.urandom(32)

    def hasher(parent: bytes, token_ids: list[int], lora: str = "") -> bytes:
        # vLLM's extra keys: the LoRA name when there is one (no multimodal, no cache salt)
        extra = (lora,) if lora else None
        return sha256_cbor((parent or none_hash, tuple(token_ids), extra))

    return hasher


def make_hasher(algo: str, seed: str | None = None) -> BlockHasher:
    """The block hash function named ``algo`` (one of ``HASH_ALGOS``)."""
    if algo == "blake2b":
        return block_hash
    if algo == "sha256_cbor":
        if seed is None:
            # vLLM warns the same: every process then names the same prefix differently
            log.warning(
                "PYTHONHASHSEED is not set: sha256_cbor block hashes start from a random "
                "seed, so no router that hashes prompts itself can find them"
            )
        return sha256_cbor_hasher(seed)
    raise ValueError(f"unknown block hash algorithm {algo!r}; use one of {HASH_ALGOS}")


class BlockPool:
    """``caching=False`` turns prefix caching off: no block is named, looked up or shared."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache holds no block; raise --kv-cache-memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        # Block 0 is kept back as the padding target of gathers, so it is never handed out.
        self._free = list(range(num_blocks - 1, 0, -1))  # unreferenced and unnamed
        # Unreferenced but named: still a cache hit; evicted oldest first when room is needed.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._name: list[bytes | None] = [None] * num_blocks
        self._by_name: dict[bytes, int] = {}
        self._hash: BlockHasher = block_hash
        self.hash_algo = "blake2b"
        #: KV-cache events since the publisher last took them; None: not recorded at all
        self.events: list[tuple] | None = None

    def use_hash(self, algo: str, seed: str | None = None) -> None:
        """Name blocks with ``algo`` from now on; only before any block is named, since names
        of two schemes never match."""
        if self._by_name:
            raise RuntimeError("the block hash can only change while no block is cached")
        self._hash = make_hasher(algo, seed)
        self.hash_algo = algo

    # ── accounting ─────────────────────────────────────────────────────────────────────────────
    @property
    def num_free(self) -> int:
        """Blocks a sequence can get: unreferenced ones, cached or not."""
        return len(self._free) + len(self._evictable)

    @property
    def num_referenced(self) -> int:
        """Blocks some live sequence holds; 0 whenever the engine is idle."""
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix, referenced or not."""
        return len(self._by_name)

    @property
    def usage(self) -> float:
        """Share of usable blocks that are referenced (cached, unreferenced ones are free)."""
        usable = self.num_blocks - 1
        return self.num_referenced / usable if usable else 0.0

    @property
    def capacity(self) -> int:
        """The tokens one sequence could hold with every usable block."""
        return (self.num_blocks - 1) * self.block_size

    def refs(self, block: int) -> int:
        return self._refs[block]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, new_tokens: int) -> int:
        """Blocks ``seq`` must gain to hold ``new_tokens`` more computed tokens."""
        return max(0, self.blocks_for(seq.num_computed + new_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, new_tokens: int) -> bool:
        return self.extra_blocks(seq, new_tokens) <= self.num_free

    def grow(self, seq: Sequence, new_tokens: int) -> None:
        for _ in range(self.extra_blocks(seq, new_tokens)):
            seq.block_table.append(self._allocate())

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the ones ``seq``'s known tokens need: those that only
        held proposals the target rejected (never full of computed tokens, so never named)."""
        keep = self.blocks_for(seq.num_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; its named blocks stay cached.

        Tail first, so that under pressure a chain loses its end before its start: a chain is
        only reachable from its first block."""
        self.drop(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def drop(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks``, last first."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._name[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # ── blocks held outside a sequence (prefill/decode disaggregation, kv_transfer/) ──────────
    def retain(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (all held already): a remote reader's,
        kept until `drop`."""
        for block in blocks:
            self._refs[block] += 1

    def take(self, count: int) -> list[int]:
        """``count`` blocks for K/V written from elsewhere, one reference each; the caller
        checked ``num_free``."""
        return [self._allocate() for _ in range(count)]

    def adopt(self, seq: Sequence, index: int, block: int) -> None:
        """``block`` holds the K/V of ``seq``'s ``index``-th block, read from another pool:
        cached under its name, so admission finds it as a prefix hit. A name cached already
        (computed here meanwhile) keeps its block; this one stays unnamed."""
        name = self._block_name(seq, index)
        if not self.caching or name in self._by_name:
            return
        self._by_name[name] = block
        self._name[block] = name
        if self.events is not None:
            parent = seq.block_hashes[index - 1] if index else None
            bs = self.block_size
            tokens = seq.token_slice(index * bs, (index + 1) * bs)
            self.events.append((STORED, [name], parent, tokens, seq.lora or None))

    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            name = self._name[block]
            del self._by_name[name]
            self._name[block] = None
            if self.events is not None:
                self.events.append((REMOVED, name))
        self._refs[block] = 1
        return block

    # ── prefix cache ───────────────────────────────────────────────────────────────────────────
    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks of ``seq``'s longest cached prefix, for a sequence holding none.

        At most ``num_tokens - 1`` tokens rounded down to a block, so the last known token is
        always computed (its logits give the next token) and the sequence's first write lands
        in a block of its own."""
        if not self.caching:
            return []
        hits: list[int] = []
        for index in range((seq.num_tokens - 1) // self.block_size):
            block = self._by_name.get(self._block_name(seq, index))
            if block is None:
                break
            hits.append(block)
        return hits

    def can_admit(self, seq: Sequence, num_tokens: int, hits: list[int]) -> bool:
        """Whether the pool holds ``num_tokens`` tokens of ``seq`` when it starts with ``hits``:
        only the blocks it must newly get count, and a cached hit it revives is not free."""
        revived = sum(1 for block in hits if self._refs[block] == 0)
        return self.blocks_for(num_tokens) - len(hits) <= self.num_free - revived

    def share(self, seq: Sequence, hits: list[int]) -> int:
        """``seq`` (holding no block) starts with ``hits`` as its computed prefix: the tokens
        they hold, for the policy to count as computed (it alone writes sequence counters)."""
        assert not seq.block_table
        for block in hits:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_table = list(hits)
        seq.num_registered_blocks = len(hits)
        return len(hits) * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that its last forward pass filled.

        Called after every forward pass; costs nothing until a block fills."""
        full = seq.num_computed // self.block_size
        if not self.caching or full <= seq.num_registered_blocks:
            return
        run_start = -1  # first index of the run of blocks registered now, for one event
        for index in range(seq.num_registered_blocks, full):
            name = self._block_name(seq, index)
            block = seq.block_table[index]
            # A block computed twice at once (two sequences missed together) is registered
            # once; the other copy stays unnamed and is freed plainly.
            if name not in self._by_name:
                self._by_name[name] = block
                self._name[block] = name
                if run_start < 0:
                    run_start = index
            elif run_start >= 0:  # a stored event names a chain: this one breaks it
                self._stored(seq, run_start, index)
                run_start = -1
        if run_start >= 0:
            self._stored(seq, run_start, full)
        seq.num_registered_blocks = full

    def _stored(self, seq: Sequence, start: int, end: int) -> None:
        if self.events is None:
            return
        names = seq.block_hashes
        parent = names[start - 1] if start else None
        bs = self.block_size
        tokens = seq.token_slice(start * bs, end * bs)
        self.events.append((STORED, names[start:end], parent, tokens, seq.lora or None))

    def clear_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache); refused, returning False,
        while any block is referenced, since a running sequence's names must stay valid."""
        if self.num_referenced:
            return False
        for block in self._evictable:
            self._name[block] = None
            self._free.append(block)
        self._evictable.clear()
        self._by_name.clear()
        if self.events is not None:
            self.events.append((CLEARED,))
        return True

    def _block_name(self, seq: Sequence, index: int) -> bytes:
        # A sequence's tokens are only ever appended, so its names stay valid for its life,
        # across preemption too; each is computed once.
        names = seq.block_hashes
        bs = self.block_size
        while len(names) <= index:
            i = len(names)
            parent = names[-1] if names else b""
            names.append(self._hash(parent, seq.token_slice(i * bs, (i + 1) * bs), seq.lora))
        return names[index]
