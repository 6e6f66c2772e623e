"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): Qwen3's attention (per-head q and
k norms) and, in place of the MLP, a mixture of experts.

The router is transformers' ``Qwen3MoeTopKRouter``: softmax over the experts in float32, the
top ``num_experts_per_tok``, renormalised when ``norm_topk_prob``, rounded to the model's dtype.
Layers listed in ``mlp_only_layers``, or off the ``decoder_sparse_step`` rhythm, keep a dense
MLP of ``intermediate_size``; the experts are ``moe_intermediate_size`` wide. Every layer
attends over ``sliding_window`` when ``use_sliding_window`` is set (the config clears it
otherwise).
"""

from __future__ import annotations

import torch

from tokenline.scheduler.layers.mlp import GatedMLP
from tokenline.scheduler.layers.moe import PROJECTIONS, SparseMoE, expert_target
from tokenline.scheduler.models.llama import Qwen3ForCausalLM
from tokenline.scheduler.models.weights import Target, packed_target


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_type = "qwen3_moe"

    def window(self, config, index: int) -> int | None:
        return getattr(config, "sliding_window", None) or None

    def mlp(self, config, index: int) -> torch.nn.Module:
        sparse = (
            index not in (config.mlp_only_layers or [])
            and config.num_experts > 0
            and (index + 1) % config.decoder_sparse_step == 0
        )
        if not sparse:
            return GatedMLP(
                config.hidden_size, config.intermediate_size, config.hidden_act, self.place
            )
        return SparseMoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_act,
            self.place,
            renormalize=bool(config.norm_topk_prob),
            float_weights=False,
        )

    def checkpoint_target(self, name: str) -> Target | str:
        return expert_target(name, PROJECTIONS) or packed_target(name)
