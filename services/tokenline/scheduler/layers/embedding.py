"""The token embedding and the LM head, split by vocabulary rows across ranks.

A rank holds ``ceil(vocab / ranks)`` rows (the last rank's tail is zero padding). Its tokens
outside them look up zeros, and the all-reduce sums each token's one non-zero row; the LM
head's logits are gathered along the vocabulary and the padding cut off.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F

from tokenline.scheduler.layers.base import Layer
from tokenline.scheduler.layers.linear import WHOLE, Packable, copy_checked, matmul, pack
from tokenline.scheduler.layers.placement import Placement


class VocabEmbedding(Layer):
    def __init__(
        self, vocab_size: int, hidden: int, place: Placement, scale: float | None = None
    ) -> None:
        super().__init__()
        self.place = place
        self.vocab_size = vocab_size
        self.local = -(-vocab_size // place.world_size)
        self.start = place.rank * self.local
        # row-major: a lookup reads whole rows (and a tied LM head multiplies by them)
        self.weight = torch.nn.Parameter(
            torch.zeros(self.local, hidden, dtype=place.dtype, device=place.device),
            requires_grad=False,
        )
        # Gemma multiplies by sqrt(hidden) rounded to the model's dtype first, as its module does
        self.scale = None
        if scale is not None:
            self.scale = torch.tensor(scale, dtype=torch.float32).to(place.dtype).to(place.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.place.tp is None:
            hidden = F.embedding(ids, self.weight)
        else:
            local = ids - self.start
            outside = (local < 0) | (local >= self.local)
            hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
            hidden = self.place.all_reduce(hidden.masked_fill(outside.unsqueeze(-1), 0))
        return hidden if self.scale is None else hidden * self.scale

    def shards(self, param: str) -> set[Hashable]:
        return {WHOLE}

    def load_weight(self, param: str, shard: Hashable, tensor) -> set[Hashable]:
        end = min(self.start + self.local, self.vocab_size)
        rows = max(0, end - self.start)
        if tensor.shape[0] != self.vocab_size:
            copy_checked(self.weight, tensor[:], param)  # refused: names both shapes
        copy_checked(self.weight[:rows], tensor[self.start : self.start + rows], param)
        return {WHOLE}


class LMHead(Packable, VocabEmbedding):
    """Hidden states to logits over the whole vocabulary; ``tied``: the embedding's weight."""

    def __init__(
        self, hidden: int, vocab_size: int, place: Placement, tied: VocabEmbedding | None
    ) -> None:
        super().__init__(vocab_size, hidden, place)
        if tied is not None:
            del self.weight  # not a parameter of its own: nothing to load
            self.__dict__["tied"] = tied  # not a submodule either: its weight is loaded once
        else:
            self.__dict__["tied"] = None

    @property
    def plain_weight(self) -> torch.Tensor:
        return self.tied.weight if self.tied is not None else self.weight

    def pack_weights(self, keep_plain: bool) -> None:
        """A tied head packs a copy: the embedding's lookups read the plain rows."""
        if self.tied is None:
            super().pack_weights(keep_plain)
            return
        self.__dict__["packed"] = pack(self.tied.weight)
        self.__dict__["packed_from_rows"] = 2 if keep_plain else 1

    def weight_for(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.shape[0] < self.packed_from_rows:
            return self.plain_weight
        return self.packed

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = matmul(hidden, self.weight_for(hidden))
        if self.place.tp is None:
            return logits
        return self.place.tp.all_gather_last(logits)[..., : self.vocab_size]
