"""The gated MLP of dense layers: ``down(act(gate(x)) * up(x))``, gate and up as one matmul."""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN

from tokenline.scheduler.layers.base import Layer
from tokenline.scheduler.layers.linear import ColumnLinear, RowLinear
from tokenline.scheduler.layers.placement import Placement
from tokenline.scheduler.lora.apply import LayerDelta


class GatedMLP(Layer):
    def __init__(
        self, hidden: int, intermediate: int, act: str, place: Placement, bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_up_proj = ColumnLinear(
            hidden, [intermediate, intermediate], bias, place, "MLP width"
        )
        self.down_proj = RowLinear(intermediate, hidden, bias, place, "MLP width")
        self.act = act
        self.act_fn = ACT2FN[act].forward  # the function, not a module call

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        lora: LayerDelta | None = None,
    ) -> torch.Tensor:
        """``residual + mlp(x)`` (plus LoRA deltas of gate, up and down)."""
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.add("gate_up", gate_up, x)
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        out = self.down_proj(h, residual)
        return out if lora is None else lora.add("down", out, h)
