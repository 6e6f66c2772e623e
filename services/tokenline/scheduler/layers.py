"""A transformers decoder layer's weights laid out for the runner, and the layer's pieces
around attention: RMSNorm, rotary embeddings, the projections with their residuals, the MLP.

A decode step on CPU runs a few hundred small kernels, and each costs microseconds to
dispatch whatever its size, so these pieces launch few of them:

- q, k, v and gate, up are fused into one matmul each;
- on CPU every projection weight is stored transposed (``column_major``), which MKL multiplies
  by a decode step's few rows in 0.5-0.75 of the time of the usual layout;
- RMSNorm calls ``F.rms_norm`` (no module call, no dtype round trips: 17 against 26 us for 16
  rows), rotary embeddings are four kernels for q and k together instead of about fourteen,
  and the residual adds ride in the output projections' ``addmm``.

Norms and rotary give transformers' bits; a matmul over transposed weights may round its last
bit differently. tests/scheduler checks each piece against its module and every family's
tokens against ``generate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tokenline.scheduler.lora.apply import LayerDelta

Norm = Callable[[torch.Tensor], torch.Tensor]

# transformers' RMSNorm in these families: weight * (x32 * rsqrt(mean(x32²) + eps)).to(dtype)
_LLAMA_STYLE_RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
# rotary types whose frequencies depend on the step's longest position (recomputed each step)
_DYNAMIC_ROPE = {"dynamic", "longrope"}


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same ``[out, in]`` weight stored ``[in, out]``: a transposed view of a contiguous
    tensor, so ``F.linear`` hands MKL a plain (not transposed) matrix. With a decode step's few
    rows that takes 0.5-0.75 of the time on CPU, and about the same time with prefill's
    hundreds of rows (benchmarks/README.md)."""
    return weight.t().contiguous().t()


def fuse(
    linears: list[torch.nn.Linear], transposed: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight for several projections of the same input (one matmul instead of three).

    The original modules are left as views into the fused tensor, so no weight is held twice.
    """
    weight = torch.cat([lin.weight.data for lin in linears])
    if transposed:
        weight = column_major(weight)
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.data for lin in linears]) if has_bias else None
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[offset : offset + rows]
        if bias is not None:
            lin.bias.data = bias[offset : offset + rows]
        offset += rows
    return weight, bias


def rms_norm(module: torch.nn.Module) -> Norm:
    """The module's normalisation as one call; modules of other kinds are called as they are."""
    if type(module).__name__ not in _LLAMA_STYLE_RMS_NORMS:
        return module
    weight, eps = module.weight, module.variance_epsilon
    shape = (weight.shape[-1],)

    def norm(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == weight.dtype == torch.float32:
            return F.rms_norm(x, shape, weight, eps)
        # the module rounds to the input's dtype before it applies the weight
        return weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)

    return norm


@dataclass
class DecoderLayer:
    """A decoder layer's modules plus what the runner calls instead of some of them."""

    module: torch.nn.Module
    qkv: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: tuple[torch.Tensor, torch.Tensor | None] | None  # None: call the module's MLP
    input_norm: Norm
    post_attention_norm: Norm
    q_norm: Norm | None = None  # Qwen3: per-head norms of q and k before the rotation
    k_norm: Norm | None = None

    def attention_residual(
        self, residual: torch.Tensor, attn_out: torch.Tensor, lora: LayerDelta | None = None
    ) -> torch.Tensor:
        """``residual + o_proj(attn_out)`` (plus each row's LoRA delta of o_proj)."""
        out = _linear_residual(residual, attn_out, self.module.self_attn.o_proj)
        return out if lora is None else lora.add("o", out, attn_out)

    def mlp_residual(self, residual: torch.Tensor, lora: LayerDelta | None = None) -> torch.Tensor:
        """``residual + mlp(post_attention_norm(residual))`` (plus LoRA deltas of gate, up,
        down; adapters load only on layers with ``gate_up``, see runner.enable_lora)."""
        x = self.post_attention_norm(residual)
        mlp = self.module.mlp
        if self.gate_up is None:
            return residual + mlp(x)
        gate_up = F.linear(x, *self.gate_up)
        if lora is not None:
            gate_up = lora.add("gate_up", gate_up, x)
        gate, up = gate_up.chunk(2, dim=-1)
        h = mlp.act_fn(gate) * up
        out = _linear_residual(residual, h, mlp.down_proj)
        return out if lora is None else lora.add("down", out, h)


def _linear_residual(
    residual: torch.Tensor, x: torch.Tensor, linear: torch.nn.Linear
) -> torch.Tensor:
    if linear.bias is None:  # one kernel: residual + x @ weightᵀ
        return torch.addmm(residual, x, linear.weight.t())
    return residual + linear(x)


def prepare_layer(layer: torch.nn.Module, transposed: bool) -> DecoderLayer:
    """Fuse the layer's projections (and, when ``transposed``, store every projection weight
    column-major); the returned pieces give the module's own results."""
    attn, mlp = layer.self_attn, layer.mlp
    fused = [attn.q_proj, attn.k_proj, attn.v_proj]
    qkv = fuse(fused, transposed)
    gate_up = None
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        fused += [mlp.gate_proj, mlp.up_proj]
        gate_up = fuse([mlp.gate_proj, mlp.up_proj], transposed)
    if transposed:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear) and not any(module is f for f in fused):
                module.weight.data = column_major(module.weight.data)
    has_qk_norm = hasattr(attn, "q_norm")
    return DecoderLayer(
        module=layer,
        qkv=qkv,
        gate_up=gate_up,
        input_norm=rms_norm(layer.input_layernorm),
        post_attention_norm=rms_norm(layer.post_attention_layernorm),
        q_norm=rms_norm(attn.q_norm) if has_qk_norm else None,
        k_norm=rms_norm(attn.k_norm) if has_qk_norm else None,
    )


class Rotary:
    """The model's rotary embedding for a step's positions, as ``(cos, signed sin)``.

    transformers rotates x into ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) =
    cat(-x2, x1)``; ``roll(x, D/2) * cat(-sin1, sin2)`` is the same product with the sign moved
    onto sin, bit for bit, without the slices, negation and concatenation. cos and signed sin
    are computed by the model's own module once for positions 0..n and looked up per step,
    except for rotary types that change with the step's longest position (and modules with a
    rotary type per layer type), which are computed per step as the module does.
    """

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self._module = module
        self._dtype = dtype
        self._device = device
        rope_type = getattr(module, "rope_type", "default")  # or one per layer type (a dict)
        self._static = isinstance(rope_type, str) and rope_type not in _DYNAMIC_ROPE
        self._table = torch.empty(0, 2, 0, dtype=dtype, device=device)  # [positions, 2, D]

    def _compute(self, positions: torch.Tensor) -> torch.Tensor:
        probe = torch.empty(0, dtype=self._dtype, device=self._device)
        cos, sin = self._module(probe, positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]
        half = sin.shape[-1] // 2
        return torch.stack((cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)), dim=1)

    def at(self, positions: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[T, 1, D]`` for ``positions`` (the largest is ``longest``)."""
        if not self._static:
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


def layer_tail(
    residual: torch.Tensor,
    attn_out: torch.Tensor,
    o_proj: tuple[torch.Tensor, torch.Tensor | None],
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: tuple[torch.Tensor, torch.Tensor | None],
    down: tuple[torch.Tensor, torch.Tensor | None],
) -> torch.Tensor:
    """Everything after attention in a Llama-style layer, as one function of tensors, so that
    ``--compile`` can fuse its elementwise work: output projection, residual, RMSNorm (the
    transformers formula: in float32, weight applied after casting back), SiLU-gated MLP,
    residual."""
    hidden = residual + F.linear(attn_out, *o_proj)
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = norm_weight * x.to(hidden.dtype)
    gate, up = F.linear(x, *gate_up).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, *down)


def fits_layer_tail(layer: DecoderLayer, config) -> bool:
    module = layer.module
    norm = module.post_attention_layernorm
    return (
        layer.gate_up is not None
        and getattr(config, "hidden_act", None) == "silu"
        and type(norm).__name__.endswith("RMSNorm")
        and hasattr(norm, "variance_epsilon")
        and isinstance(module.self_attn.o_proj, torch.nn.Linear)
        and isinstance(module.mlp.down_proj, torch.nn.Linear)
    )
