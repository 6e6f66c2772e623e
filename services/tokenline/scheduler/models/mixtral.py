"""Mixtral (8x7B, 8x22B): Mistral's attention and, in place of the MLP, a mixture of experts.

The router is transformers' ``MixtralTopKRouter``: softmax over the experts in float32, the top
``num_experts_per_tok``, always renormalised, and kept in float32 while they scale the experts'
outputs. The Hub's checkpoints name the block ``block_sparse_moe`` and each expert's
projections ``w1`` (gate), ``w3`` (up), ``w2`` (down).
"""

from __future__ import annotations

import torch

from tokenline.scheduler.layers.moe import MIXTRAL_PROJECTIONS, SparseMoE, expert_target
from tokenline.scheduler.models.llama import MistralForCausalLM
from tokenline.scheduler.models.weights import Target, packed_target


class MixtralForCausalLM(MistralForCausalLM):
    model_type = "mixtral"

    def mlp(self, config, index: int) -> torch.nn.Module:
        return SparseMoE(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_act,
            self.place,
            renormalize=True,
            float_weights=True,
        )

    def checkpoint_target(self, name: str) -> Target | str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_target(name, MIXTRAL_PROJECTIONS) or packed_target(name)
