"""Gemma 3, text (``Gemma3ForCausalLM``: Gemma 3 1B, and the text towers saved on their own).

What sets it apart from Llama, each as transformers' ``modeling_gemma3`` computes it:

- the embedding is multiplied by ``sqrt(hidden_size)`` (rounded to the model's dtype first);
- every norm is Gemma's (``(1 + weight)``, applied in float32), and there are four per layer:
  the attention's and the MLP's outputs are normalised too, before their residual adds;
- q and k are normalised per head before the rotation, and scores are scaled by
  ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``;
- layers alternate: ``layer_types`` marks most of them ``sliding_attention`` (a window of
  ``sliding_window`` tokens, rotary base 10k) and every sixth ``full_attention`` (the whole
  context, rotary base 1M with its own scaling): two rotary tables, each layer reads its own;
- the MLP's activation is ``hidden_activation`` (GELU, tanh approximation);
- logits are soft-capped when ``final_logit_softcapping`` is set.
"""

from __future__ import annotations

import torch

from tokenline.scheduler.layers.attention import Attention
from tokenline.scheduler.layers.base import Layer
from tokenline.scheduler.layers.context import ForwardContext
from tokenline.scheduler.layers.embedding import LMHead, VocabEmbedding
from tokenline.scheduler.layers.mlp import GatedMLP
from tokenline.scheduler.layers.norm import GemmaRMSNorm
from tokenline.scheduler.layers.placement import ModelRefused, Placement
from tokenline.scheduler.layers.rotary import RopeFrequencies, Rotary
from tokenline.scheduler.models.base import CausalLM, Geometry
from tokenline.scheduler.models.llama import head_dim_of, window_by_layer_type
from tokenline.scheduler.models.weights import Target, packed_target

LAYER_TYPES = ("sliding_attention", "full_attention")


class Gemma3DecoderLayer(Layer):
    def __init__(self, config, index: int, place: Placement) -> None:
        super().__init__()
        self.index = index
        self.layer_type = config.layer_types[index]
        hidden = config.hidden_size

        def norm(size: int) -> GemmaRMSNorm:
            return GemmaRMSNorm(size, config.rms_norm_eps, place)

        self.input_layernorm = norm(hidden)
        self.self_attn = Attention(
            index,
            hidden,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim_of(config),
            place,
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            scale=config.query_pre_attn_scalar**-0.5,
            window=window_by_layer_type(config, index),
            qk_norm=norm,
        )
        self.post_attention_layernorm = norm(hidden)
        self.pre_feedforward_layernorm = norm(hidden)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation, place)
        self.post_feedforward_layernorm = norm(hidden)

    def forward(
        self,
        h: torch.Tensor,
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
        context: ForwardContext,
    ) -> torch.Tensor:
        lora = context.lora_layer(self.index)
        cos, sin = rotary[self.layer_type]
        attn = self.self_attn.attend(self.input_layernorm(h), cos, sin, context, lora)
        h = h + self.post_attention_layernorm(self.self_attn.project(attn, None, lora))
        mlp = self.mlp(self.pre_feedforward_layernorm(h), None, lora)
        return h + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(CausalLM):
    model_type = "gemma3_text"  # the decoder alone; "gemma3" is the multimodal model

    def __init__(self, config, place: Placement) -> None:
        super().__init__(config, place)
        if getattr(config, "attn_logit_softcapping", None):
            raise ModelRefused(
                "attn_logit_softcapping: soft-capped attention scores need an attention kernel "
                "that caps them, which tokenline's do not"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelRefused("use_bidirectional_attention: an encoder, not a decoder")
        unknown = set(config.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ModelRefused(f"layer types {sorted(unknown)}")
        hidden = config.hidden_size
        self.model = torch.nn.Module()
        self.model.embed_tokens = VocabEmbedding(config.vocab_size, hidden, place, hidden**0.5)
        self.model.layers = torch.nn.ModuleList(
            Gemma3DecoderLayer(config, i, place) for i in range(config.num_hidden_layers)
        )
        self.model.norm = GemmaRMSNorm(hidden, config.rms_norm_eps, place)
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        tied = self.model.embed_tokens if self.tied else None
        self.lm_head = LMHead(hidden, config.vocab_size, place, tied)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        layer_types = sorted(set(config.layer_types))
        frequencies = RopeFrequencies(config, layer_types).to(place.device)
        self.rotary = {
            layer_type: Rotary(frequencies, place.dtype, place.device, layer_type)
            for layer_type in layer_types
        }
        attention = [layer.self_attn for layer in self.model.layers]
        self.geometry = Geometry(
            num_heads=attention[0].num_heads,
            num_kv_heads=attention[0].num_kv_heads,
            head_dim=attention[0].head_dim,
            layers=tuple(a.layer for a in attention),
            windows=tuple(a.window for a in attention),
        )

    def forward(
        self, input_ids: torch.Tensor, context: ForwardContext, rows: torch.Tensor
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        rotary = {
            layer_type: table.at(context.positions, context.max_position)
            for layer_type, table in self.rotary.items()
        }
        for layer in self.model.layers:
            h = layer(h, rotary, context)
        return self.model.norm(h.index_select(0, rows))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def checkpoint_target(self, name: str) -> Target | str:
        return packed_target(name)

    @property
    def lora_dims(self) -> dict[str, tuple[int, int]]:
        config = self.config
        hidden, head_dim, inter = config.hidden_size, head_dim_of(config), config.intermediate_size
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        return {
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
