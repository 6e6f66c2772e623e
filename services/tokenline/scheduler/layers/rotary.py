"""Rotary position embeddings: the family's own transformers module computes the tables (every
rope type it knows: llama3, yarn, longrope, dynamic...), and a step looks its positions up.

transformers rotates x into ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) =
cat(-x2, x1)``; ``roll(x, D/2) * cat(-sin1, sin2)`` is the same product with the sign moved onto
sin, bit for bit, without the slices, negation and concatenation: four kernels for q and k
together instead of about fourteen.
"""

from __future__ import annotations

import torch

# rotary types whose frequencies depend on the step's longest position (recomputed each step)
_DYNAMIC_ROPE = {"dynamic", "longrope"}


class Rotary:
    """The model's rotary embedding for a step's positions, as ``(cos, signed sin)``.

    cos and signed sin are computed by the module once for positions 0..n and looked up per
    step, except for rotary types that change with the step's longest position, which are
    computed per step as the module does. ``layer_type``: the module keeps one rotary per layer
    type (Gemma 3's sliding and full layers); this is that type's.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        dtype: torch.dtype,
        device: torch.device,
        layer_type: str | None = None,
    ) -> None:
        self._module = module
        self._dtype = dtype
        self._device = device
        self._layer_type = layer_type
        rope_type = getattr(module, "rope_type", "default")
        if isinstance(rope_type, dict):  # one per layer type
            rope_type = rope_type.get(layer_type) if layer_type else None
        self.static = isinstance(rope_type, str) and rope_type not in _DYNAMIC_ROPE
        self._table = torch.empty(0, 2, 0, dtype=dtype, device=device)  # [positions, 2, D]

    def _compute(self, positions: torch.Tensor) -> torch.Tensor:
        probe = torch.empty(0, dtype=self._dtype, device=self._device)
        if self._layer_type is None:
            cos, sin = self._module(probe, positions.unsqueeze(0))
        else:
            cos, sin = self._module(probe, positions.unsqueeze(0), self._layer_type)
        cos, sin = cos[0], sin[0]
        half = sin.shape[-1] // 2
        return torch.stack((cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)), dim=1)

    def at(self, positions: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[T, 1, D]`` for ``positions`` (the largest is ``longest``)."""
        if not self.static:
            both = self._compute(positions)
        else:
            if longest >= self._table.shape[0]:
                size = max(longest + 1, 2 * self._table.shape[0], 256)
                self._table = self._compute(torch.arange(size, device=self._device))
            both = self._table.index_select(0, positions)
        return both[:, :1], both[:, 1:]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, heads, D]`` rotated to its positions (see ``Rotary``)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
