"""The device side of LoRA: every slot's weights stacked per layer and projection, and the
batched low-rank math that adds each token's own adapter delta to the runner's projections.

The runner fuses q, k, v into one matmul and gate, up into another (layers.py), so the deltas
are laid out per fused projection. For a projection fusing M linears, with S slots of rank R
(``--max-loras``, ``--max-lora-rank``; smaller ranks are zero-padded):

- ``a`` ``[in, M*S*R]``: column block (m, s) is slot s's A of linear m, transposed;
- ``b[m]`` ``[S*R, out_m]``: row block s is slot s's B of linear m, transposed, scaled.

A step gives every token row a slot (-1: the base model) as a one-hot ``[T, S]``. Then

    delta_m = ((x @ a) * onehot)[:, m] @ b[m]        # = x @ A[idx] @ B[idx] per row

is punica's BGMV (``x @ A[idx] @ B[idx]``) with the gather written as a mask: one shrink
matmul over every slot at once, one multiply, one expand per linear, added in place into its
slice of the fused output. The kernels and their shapes do not depend on which adapters a
batch mixes (no per-adapter loop, no per-token weight gather of ``[T, in, R]``), and the extra
work is ``S*R`` columns against the projection's thousands. A base row's mask is zero, so its
delta is exactly zero and its output is the base model's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenline.scheduler.lora.adapters import LoraAdapter
from tokenline.scheduler.step_inputs import long_tensor, to_device

# The runner's projections and the linears each fuses, in its column order (layers.py).
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass
class StackedProjection:
    a: torch.Tensor  # [in, M*S*R]
    b: list[torch.Tensor]  # per fused linear: [S*R, out_m]
    offsets: list[int]  # where each linear's columns start in the fused output
    targeted: set[int]  # slots whose adapter targets this projection (empty: skip it)


@dataclass
class LoraStep:
    """One step's token-to-slot map as the math reads it."""

    onehot: torch.Tensor  # [T, 1, S, 1] in the model's dtype


class LoraWeights:
    """Per layer and projection, the stacked weights of ``slots`` device slots."""

    def __init__(
        self,
        dims: dict[str, tuple[int, int]],
        num_layers: int,
        slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.slots = slots
        self.rank = max_rank
        self.dtype = dtype
        self.device = device
        self.layers: list[dict[str, StackedProjection]] = []
        width = slots * max_rank
        for _ in range(num_layers):
            projections = {}
            for projection, linears in PROJECTIONS.items():
                if not all(name in dims for name in linears):
                    continue
                fan_in = dims[linears[0]][0]
                outs = [dims[name][1] for name in linears]
                offsets = [sum(outs[:i]) for i in range(len(outs))]
                a = torch.zeros(fan_in, len(linears) * width, dtype=dtype, device=device)
                b = [torch.zeros(width, out, dtype=dtype, device=device) for out in outs]
                projections[projection] = StackedProjection(a, b, offsets, set())
            self.layers.append(projections)

    def set_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write ``adapter`` into ``slot`` (None: clear it); ``scaling`` is folded into B."""
        rank, width = self.rank, self.slots * self.rank
        for layer, projections in enumerate(self.layers):
            for projection, stacked in projections.items():
                stacked.targeted.discard(slot)
                for m, name in enumerate(PROJECTIONS[projection]):
                    cols = slice(m * width + slot * rank, m * width + (slot + 1) * rank)
                    stacked.a[:, cols] = 0
                    stacked.b[m][slot * rank : (slot + 1) * rank] = 0
                    pair = None if adapter is None else adapter.weights.get((layer, name))
                    if pair is None:
                        continue
                    a, b = pair
                    r = a.shape[0]
                    stacked.a[:, m * width + slot * rank : m * width + slot * rank + r] = a.t()
                    stacked.b[m][slot * rank : slot * rank + r] = b.t() * adapter.scaling
                    stacked.targeted.add(slot)

    def step(self, token_slots: list[int]) -> LoraStep | None:
        """The step's map from each token row's slot; None when no row uses an adapter, so
        the forward skips LoRA entirely."""
        if all(s < 0 for s in token_slots):
            return None
        idx = to_device(long_tensor(token_slots), self.device)
        onehot = idx.unsqueeze(1) == torch.arange(self.slots, device=self.device)
        return LoraStep(onehot.to(self.dtype).view(len(token_slots), 1, self.slots, 1))


def add_lora(
    out: torch.Tensor, x: torch.Tensor, stacked: StackedProjection | None, step: LoraStep
) -> torch.Tensor:
    """``out`` (the projection of ``x``, fused columns) plus each row's adapter delta, in place."""
    if stacked is None or not stacked.targeted:
        return out
    tokens, fused, slots = x.shape[0], len(stacked.b), step.onehot.shape[2]
    # [T, M*S*R] viewed [T, M, S, R], masked to each row's own slot, back to [T, M, S*R]
    shrunk = ((x @ stacked.a).view(tokens, fused, slots, -1) * step.onehot).view(tokens, fused, -1)
    for m, b in enumerate(stacked.b):
        start = stacked.offsets[m]
        out[:, start : start + b.shape[1]].addmm_(shrunk[:, m], b)
    return out


@dataclass
class LayerDelta:
    """One layer's stacked weights with the step's slot map: what layers.py calls."""

    projections: dict[str, StackedProjection]
    step: LoraStep

    def add(self, projection: str, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return add_lora(out, x, self.projections.get(projection), self.step)
