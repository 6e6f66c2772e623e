"""Llama and the dense families that compute as it does: Mistral, Qwen2, Qwen3.

A decoder layer is pre-norm attention and a pre-norm MLP, each added to the residual:

    h = h + o_proj(attention(rotary(qkv_proj(norm(h)))))
    h = h + mlp(norm(h))

The families differ in a few switches, read from the config as transformers reads them: biases
(Qwen2's q/k/v; Llama's ``attention_bias`` and ``mlp_bias``), Qwen3's per-head q and k norms,
and which layers slide over a window (Mistral: every layer, by ``sliding_window``; Qwen2 and
Qwen3: the layers ``layer_types`` marks). The mixture-of-experts families (qwen3_moe.py,
mixtral.py) are this decoder with another feed-forward block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenline.scheduler.layers.attention import Attention
from tokenline.scheduler.layers.base import Layer
from tokenline.scheduler.layers.compiled import CompiledLayers
from tokenline.scheduler.layers.context import ForwardContext
from tokenline.scheduler.layers.embedding import LMHead, VocabEmbedding
from tokenline.scheduler.layers.mlp import GatedMLP
from tokenline.scheduler.layers.norm import RMSNorm
from tokenline.scheduler.layers.placement import Placement
from tokenline.scheduler.layers.rotary import RopeFrequencies, Rotary
from tokenline.scheduler.models.base import CausalLM, Geometry
from tokenline.scheduler.models.weights import Target, packed_target


class DecoderLayer(Layer):
    def __init__(self, attention: Attention, mlp: torch.nn.Module, norm) -> None:
        super().__init__()
        self.index = attention.layer.index
        hidden = attention.o_proj.weight.shape[0]
        self.input_layernorm = norm(hidden)
        self.self_attn = attention
        self.post_attention_layernorm = norm(hidden)
        self.mlp = mlp
        self.tail = None  # ``--compile``: everything after attention, compiled (`layer_tail`)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        lora = context.lora_layer(self.index)
        attn = self.self_attn.attend(self.input_layernorm(h), cos, sin, context, lora)
        if self.tail is not None and lora is None:  # the compiled tail has no LoRA deltas
            return self.tail(h, attn, *self.tail_weights())
        h = self.self_attn.project(attn, h, lora)
        return self.mlp(self.post_attention_layernorm(h), h, lora)

    def tail_weights(self) -> tuple:
        o, norm, mlp = self.self_attn.o_proj, self.post_attention_layernorm, self.mlp
        return (
            (o.weight, o.bias),
            norm.weight,
            norm.eps,
            (mlp.gate_up_proj.weight, mlp.gate_up_proj.bias),
            (mlp.down_proj.weight, mlp.down_proj.bias),
        )


def layer_tail(
    residual: torch.Tensor,
    attn_out: torch.Tensor,
    o_proj: tuple[torch.Tensor, torch.Tensor | None],
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: tuple[torch.Tensor, torch.Tensor | None],
    down: tuple[torch.Tensor, torch.Tensor | None],
) -> torch.Tensor:
    """Everything after attention in a Llama layer with a SiLU MLP, as one function of tensors,
    so that ``--compile`` can fuse its elementwise work: output projection, residual, RMSNorm
    (the transformers formula: in float32, weight applied after casting back), MLP, residual."""
    hidden = residual + F.linear(attn_out, *o_proj)
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = norm_weight * x.to(hidden.dtype)
    gate, up = F.linear(x, *gate_up).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, *down)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaForCausalLM(CausalLM):
    """Llama. Subclasses change the switches (`biases`, `qk_norm`, `window`, `mlp`)."""

    model_type = "llama"
    captures_aux = True  # EAGLE-3 heads can read its layers (`_layers_keeping_aux`)

    def __init__(self, config, place: Placement) -> None:
        super().__init__(config, place)
        hidden = config.hidden_size
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.model = torch.nn.Module()  # the checkpoint's names: model.embed_tokens, ...
        self.model.embed_tokens = VocabEmbedding(config.vocab_size, hidden, place)
        self.model.layers = torch.nn.ModuleList(
            DecoderLayer(self.attention(config, i), self.mlp(config, i), self.norm)
            for i in range(config.num_hidden_layers)
        )
        self.model.norm = self.norm(hidden)
        tied = self.model.embed_tokens if self.tied else None
        self.lm_head = LMHead(hidden, config.vocab_size, place, tied)
        frequencies = RopeFrequencies(config).to(place.device)
        self.rotary_emb = Rotary(frequencies, place.dtype, place.device)
        first = self.model.layers[0].self_attn
        self.compiled: CompiledLayers | None = None  # ``--compile`` on CPU
        self.geometry = Geometry(
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            layers=tuple(layer.self_attn.layer for layer in self.model.layers),
            windows=tuple(layer.self_attn.window for layer in self.model.layers),
        )

    # ── the family's switches ─────────────────────────────────────────────────────────────
    qk_norm = False  # Qwen3: q and k normalised per head before the rotation

    def biases(self, config) -> tuple[bool, bool, bool]:
        """Which projections have biases: (q/k/v, o, MLP), as the family's module builds them."""
        attention = bool(getattr(config, "attention_bias", False))
        return attention, attention, bool(getattr(config, "mlp_bias", False))

    def norm(self, size: int) -> torch.nn.Module:
        return RMSNorm(size, self.config.rms_norm_eps, self.place)

    def window(self, config, index: int) -> int | None:
        return None

    def attention(self, config, index: int) -> Attention:
        qkv_bias, o_bias, _ = self.biases(config)
        return Attention(
            index,
            config.hidden_size,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim_of(config),
            self.place,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            window=self.window(config, index),
            qk_norm=self.norm if self.qk_norm else None,
        )

    def mlp(self, config, index: int) -> torch.nn.Module:
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            self.place,
            self.biases(config)[2],
        )

    # ── the runner's calls ────────────────────────────────────────────────────────────────
    def forward(
        self, input_ids: torch.Tensor, context: ForwardContext, rows: torch.Tensor
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.at(context.positions, context.max_position)
        if self.aux_layers:
            h = self._layers_keeping_aux(h, cos, sin, context)
        elif self.compiled is not None and context.lora is None:
            h = self.compiled(h, cos, sin, context)
        else:
            for layer in self.model.layers:
                h = layer(h, cos, sin, context)
        return self.model.norm(h.index_select(0, rows))

    def _layers_keeping_aux(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor:
        """The layers, keeping the residual stream entering each of ``aux_layers`` (vLLM's
        auxiliary hidden states: ``hidden_states + residual`` before that layer) in
        ``aux_hidden``. A layer returns a new tensor, so the kept ones stay as they were."""
        kept = []
        for index, layer in enumerate(self.model.layers):
            if index in self.aux_layers:
                kept.append(h)
            h = layer(h, cos, sin, context)
        self.aux_hidden = torch.cat(kept, dim=-1)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def checkpoint_target(self, name: str) -> Target | str:
        return packed_target(name)

    @property
    def lora_dims(self) -> dict[str, tuple[int, int]]:
        config = self.config
        hidden, head_dim = config.hidden_size, head_dim_of(config)
        q = config.num_attention_heads * head_dim
        kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
        dims = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv)}
        dims["o_proj"] = (q, hidden)
        if all(isinstance(layer.mlp, GatedMLP) for layer in self.model.layers):
            inter = config.intermediate_size
            dims |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter)}
            dims["down_proj"] = (inter, hidden)
        return dims

    def graph_modules(self) -> list[torch.nn.Module]:
        return list(self.model.layers.modules()) if self.compiled is not None else []

    def compile_layers(self) -> bool:
        """On CPU every layer, as one graph with frozen weights (layers/compiled.py); on a GPU
        each layer's tail after attention (`layer_tail`)."""
        layers = self.model.layers
        if self.place.tp is not None or not all(
            isinstance(layer.mlp, GatedMLP) and layer.mlp.act == "silu" for layer in layers
        ):
            return False
        if self.place.device.type == "cpu":
            if not CompiledLayers.supported():
                return False
            self.compiled = CompiledLayers(layers)
            return True
        tail = torch.compile(layer_tail, dynamic=True)  # one graph for every token count
        for layer in layers:
            layer.tail = tail
        return True


class MistralForCausalLM(LlamaForCausalLM):
    model_type = "mistral"

    def biases(self, config) -> tuple[bool, bool, bool]:
        return False, False, False

    def window(self, config, index: int) -> int | None:
        return getattr(config, "sliding_window", None) or None  # every layer


def window_by_layer_type(config, index: int) -> int | None:
    """Qwen2, Qwen3, Gemma 3: the layers ``layer_types`` marks ``sliding_attention`` slide."""
    layer_types = getattr(config, "layer_types", None) or []
    if index < len(layer_types) and layer_types[index] == "sliding_attention":
        return config.sliding_window
    return None


class Qwen2ForCausalLM(MistralForCausalLM):
    model_type = "qwen2"

    def biases(self, config) -> tuple[bool, bool, bool]:
        return True, False, False  # q, k and v have biases; o and the MLP do not

    def window(self, config, index: int) -> int | None:
        return window_by_layer_type(config, index)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    model_type = "qwen3"
    qk_norm = True

    def biases(self, config) -> tuple[bool, bool, bool]:
        attention = bool(getattr(config, "attention_bias", False))
        return attention, attention, False
