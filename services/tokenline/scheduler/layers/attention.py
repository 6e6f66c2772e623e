"""A decoder layer's attention: fused q/k/v projection, optional per-head q/k norms, rotary
positions, the attention backend (which stores K/V in the paged pool and attends), and the
output projection. Shared by every native family; what differs is passed in."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenline.scheduler.attention import AttentionLayer
from tokenline.scheduler.layers.base import Layer
from tokenline.scheduler.layers.context import ForwardContext
from tokenline.scheduler.layers.linear import QKVLinear, RowLinear
from tokenline.scheduler.layers.placement import Placement
from tokenline.scheduler.layers.rotary import rotate
from tokenline.scheduler.lora.apply import LayerDelta

NormFactory = Callable[[int], torch.nn.Module]


class Attention(Layer):
    def __init__(
        self,
        index: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        place: Placement,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        scale: float | None = None,
        window: int | None = None,
        qk_norm: NormFactory | None = None,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVLinear(hidden, num_heads, num_kv_heads, head_dim, qkv_bias, place)
        self.o_proj = RowLinear(num_heads * head_dim, hidden, o_bias, place, "attention heads")
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.window = window
        self.layer = AttentionLayer(index, scale, window is not None)
        self.q_norm = qk_norm(head_dim) if qk_norm is not None else None
        self.k_norm = qk_norm(head_dim) if qk_norm is not None else None

    def attend(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: ForwardContext,
        lora: LayerDelta | None = None,
    ) -> torch.Tensor:
        """``[T, heads * D]``: attention over each row's context, before the output projection."""
        tokens, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if lora is not None:
            qkv = lora.add("qkv", qkv, x)
        qk_size = (heads + kv_heads) * dim
        qk = qkv[:, :qk_size].view(tokens, heads + kv_heads, dim)
        v = qkv[:, qk_size:].view(tokens, kv_heads, dim)
        if self.q_norm is not None:  # q and k are normalised apart, then rotated
            q = rotate(self.q_norm(qk[:, :heads]), cos, sin)
            k = rotate(self.k_norm(qk[:, heads:]), cos, sin)
        else:
            qk = rotate(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        return context.attention.forward(q, k, v, self.layer, context.metadata)

    def project(
        self,
        attn: torch.Tensor,
        residual: torch.Tensor | None = None,
        lora: LayerDelta | None = None,
    ) -> torch.Tensor:
        """``residual + o_proj(attn)`` (plus each row's LoRA delta of o_proj)."""
        out = self.o_proj(attn, residual)
        return out if lora is None else lora.add("o", out, attn)
