"""Rotary position embeddings: `RopeFrequencies` computes the tables as the families' transformers
modules do, with transformers' own rope functions (every rope type: llama3, yarn, longrope,
dynamic...), and a step looks its positions up.

transformers rotates x into ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) =
cat(-x2, x1)``; ``roll(x, D/2) * cat(-sin1, sin2)`` is the same product with the sign moved onto
sin, bit for bit, without the slices, negation and concatenation: four kernels for q and k
together instead of about fourteen.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

# rotary types whose frequencies depend on the step's longest position (recomputed each step)
_DYNAMIC_ROPE = {"dynamic", "longrope"}


class RopeFrequencies(torch.nn.Module):
    """The cos and sin of positions as transformers' rotary modules compute them for ``config``:
    one set of frequencies, or one per layer type (``layer_types``: Gemma 3's sliding and full
    layers, each with its own rope parameters).

    The families' own modules (``LlamaRotaryEmbedding`` and its copies, ``Gemma3RotaryEmbedding``)
    live in their modeling modules, whose import brings in transformers' model classes and
    torch's compiler, seconds of a scheduler's start on two cores. This is the same computation:
    the non-default rope types' frequencies from transformers' ``ROPE_INIT_FUNCTIONS``, their
    per-step updates (dynamic, longrope) from its ``dynamic_rope_update``, under the attribute
    names that decorator reads. tests/scheduler/test_layers.py holds it to every family's module,
    bit for bit, in every rope type.
    """

    def __init__(self, config, layer_types: list[str] | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        if layer_types is None:
            self.rope_type = config.rope_parameters["rope_type"]
            self._frequencies(config.rope_parameters, self.rope_type, None)
            return
        self.rope_type = {}
        for layer_type in layer_types:
            params = config.rope_parameters[layer_type]
            if params is not None:
                self.rope_type[layer_type] = params["rope_type"]
                self._frequencies(params, params["rope_type"], layer_type)

    def _frequencies(self, params: dict, rope_type: str, layer_type: str | None) -> None:
        if rope_type == "default":
            config = self.config
            dim = getattr(config, "head_dim", None) or (
                config.hidden_size // config.num_attention_heads
            )
            exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
            inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
        else:
            by_type = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, None, **by_type)
        prefix = "" if layer_type is None else f"{layer_type}_"
        self.register_buffer(f"{prefix}inv_freq", inv_freq, persistent=False)
        self.register_buffer(f"{prefix}original_inv_freq", inv_freq.clone(), persistent=False)
        setattr(self, f"{prefix}attention_scaling", scaling)

    @dynamic_rope_update
    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = "" if layer_type is None else f"{layer_type}_"
        inv_freq = getattr(self, f"{prefix}inv_freq")
        scaling = getattr(self, f"{prefix}attention_scaling")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        both = torch.cat((freqs, freqs), dim=-1)
        return (both.cos() * scaling).to(dtype=x.dtype), (both.sin() * scaling).to(dtype=x.dtype)


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
