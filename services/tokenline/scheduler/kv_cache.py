"""KV cache block accounting: which fixed-size blocks of the pool each sequence owns."""

from __future__ import annotations

from tokenline.scheduler.sequence import Sequence


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache holds no block; raise --kv-cache-memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Block 0 is kept back as the padding target of gathers, so it is never handed out.
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        usable = self.num_blocks - 1
        return (usable - len(self._free)) / usable if usable else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, new_tokens: int) -> int:
        """Blocks ``seq`` must gain to hold ``new_tokens`` more computed tokens."""
        return max(0, self.blocks_for(seq.num_computed + new_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, new_tokens: int) -> bool:
        return self.extra_blocks(seq, new_tokens) <= len(self._free)

    def grow(self, seq: Sequence, new_tokens: int) -> None:
        for _ in range(self.extra_blocks(seq, new_tokens)):
            seq.block_table.append(self._free.pop())

    def release(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed = 0
