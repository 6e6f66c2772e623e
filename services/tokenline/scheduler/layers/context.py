"""What every layer of one forward reads besides its input: ``ForwardContext``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenline.scheduler.attention import AttentionBackend
    from tokenline.scheduler.lora.apply import LayerDelta, LoraStep, LoraWeights


@dataclass
class ForwardContext:
    """The step's positions, its attention (the backend chosen at start and this step's
    metadata, built once before the layer loop) and each row's LoRA slot."""

    positions: torch.Tensor  # [T]
    max_position: int
    attention: AttentionBackend
    metadata: object
    lora: LoraStep | None = None  # None: no row uses an adapter
    lora_weights: LoraWeights | None = None

    def lora_layer(self, index: int) -> LayerDelta | None:
        """The deltas layer ``index`` adds this step, or None when no row uses an adapter."""
        if self.lora is None or self.lora_weights is None:
            return None
        from tokenline.scheduler.lora.apply import LayerDelta

        return LayerDelta(self.lora_weights.layers[index], self.lora)
