"""Mixture-of-experts layers compute what each family's own transformers block computes.

Checked on batches where several tokens share an expert and some experts get none: the router
picks the same experts with the same weights (in the same dtype: Mixtral keeps them in float32,
Qwen3-MoE rounds them to the model's), and the layer's output matches the family's block run
with its own per-expert loop, through the CPU loop and through the grouped GEMM that CUDA
uses; two tensor-parallel shards of the experts sum to the whole.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tokenline.scheduler.layers.moe import (
    MIXTRAL_PROJECTIONS,
    PROJECTIONS,
    Experts,
    SparseMoE,
    expert_target,
)
from tokenline.scheduler.layers.placement import Placement

HIDDEN, EXPERTS = 64, 8
CPU = torch.device("cpu")
# name → (config, block, its experts' width, SparseMoE's switches)
FAMILIES = {
    "qwen3-moe": (
        transformers.Qwen3MoeConfig(
            hidden_size=HIDDEN, moe_intermediate_size=32, num_experts=EXPERTS,
            num_experts_per_tok=2, norm_topk_prob=True,
        ),
        Qwen3MoeSparseMoeBlock,
        32,
        {"renormalize": True, "float_weights": False},
    ),
    "qwen3-moe-unnormalised": (
        transformers.Qwen3MoeConfig(
            hidden_size=HIDDEN, moe_intermediate_size=32, num_experts=EXPERTS,
            num_experts_per_tok=2, norm_topk_prob=False,
        ),
        Qwen3MoeSparseMoeBlock,
        32,
        {"renormalize": False, "float_weights": False},
    ),
    "mixtral": (
        transformers.MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=48, num_local_experts=EXPERTS,
            num_experts_per_tok=2,
        ),
        MixtralSparseMoeBlock,
        48,
        {"renormalize": True, "float_weights": True},
    ),
}  # fmt: skip


def _block(family: str, dtype: torch.dtype) -> tuple[torch.nn.Module, int, dict]:
    config, block_type, width, switches = FAMILIES[family]
    config._experts_implementation = "eager"  # the family's own per-expert loop
    torch.manual_seed(0)
    block = block_type(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.5)
    return block.to(dtype).eval(), width, switches


def _ours(block, width: int, switches: dict, place: Placement, grouped: bool) -> SparseMoE:
    moe = SparseMoE(HIDDEN, width, EXPERTS, 2, "silu", place, grouped=grouped, **switches)
    with torch.no_grad():
        moe.gate.load_weight("weight", None, block.gate.weight.detach())
        moe.experts.load_weight("w13", (None, "gate_up"), block.experts.gate_up_proj.detach())
        moe.experts.load_weight("w2", (None, "down"), block.experts.down_proj.detach())
    return moe


def _tokens(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(10, HIDDEN).to(dtype)


def _rank(rank: int, world: int) -> SimpleNamespace:
    return SimpleNamespace(
        rank=rank, world_size=world, is_driver=rank == 0, all_reduce=lambda partial: partial
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_router_picks_the_familys_experts_and_weights(family, dtype):
    block, width, switches = _block(family, dtype)
    moe = _ours(block, width, switches, Placement(CPU, dtype), grouped=False)
    x = _tokens(dtype)
    with torch.inference_mode():
        _, want_weights, want_experts = block.gate(x)
        experts, weights = moe.route(x)
    counts = torch.bincount(experts.flatten(), minlength=EXPERTS)
    assert (counts == 0).any() and (counts >= 2).any(), "the batch must share and skip experts"
    assert torch.equal(experts, want_experts)
    assert weights.dtype == want_weights.dtype
    torch.testing.assert_close(weights, want_weights)


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped-gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_layer_gives_the_familys_block_output(family, dtype, grouped):
    block, width, switches = _block(family, dtype)
    moe = _ours(block, width, switches, Placement(CPU, dtype), grouped)
    x = _tokens(dtype)
    residual = torch.randn_like(x)
    with torch.inference_mode():
        want = block(x.unsqueeze(0))[0]
        got = moe(x)
        with_residual = moe(x, residual)
    # float32: within rounding of sums whose terms are a thousand times the result's smallest
    scale = float(want.abs().max())
    tolerance = {"atol": 1e-6 * scale, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tolerance)
    torch.testing.assert_close(with_residual, residual + got, **tolerance)


def test_two_tensor_parallel_shards_of_the_experts_sum_to_the_whole():
    """Each rank holds half of every expert's intermediate dimension: gate and up rows,
    down columns; the partial outputs add up to the unsplit layer's."""
    block, width, switches = _block("qwen3-moe", torch.float32)
    x = _tokens(torch.float32)
    whole = _ours(block, width, switches, Placement(CPU, torch.float32), grouped=False)
    ranks = [
        _ours(block, width, switches, Placement(CPU, torch.float32, _rank(r, 2)), grouped=False)
        for r in range(2)
    ]
    assert ranks[0].experts.w13.shape == (EXPERTS, width, HIDDEN)  # half of 2 * width
    with torch.inference_mode():
        torch.testing.assert_close(ranks[0](x) + ranks[1](x), whole(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("names", "gate", "up", "down"),
    [(PROJECTIONS, "gate_proj", "up_proj", "down_proj"), (MIXTRAL_PROJECTIONS, "w1", "w3", "w2")],
    ids=["qwen-names", "mixtral-names"],
)
def test_each_experts_checkpoint_tensors_load_as_the_stacked_ones(names, gate, up, down):
    """The Hub stores one tensor per expert and projection; transformers 5 stacks them. Both
    load into the same weights."""
    block, width, switches = _block("qwen3-moe", torch.float32)
    stacked = block.experts.gate_up_proj.detach()
    experts = Experts(EXPERTS, HIDDEN, width, "silu", Placement(CPU, torch.float32))
    filled = set()
    for e in range(EXPERTS):
        tensors = {gate: stacked[e, :width], up: stacked[e, width:]}
        tensors[down] = block.experts.down_proj.detach()[e]
        for proj, tensor in tensors.items():
            module, param, shard = expert_target(
                f"model.layers.0.mlp.experts.{e}.{proj}.weight", names
            )
            assert module == "model.layers.0.mlp.experts"
            filled |= experts.load_weight(param, shard, tensor)
    assert filled == experts.shards("w13") | experts.shards("w2")
    loaded = _ours(block, width, switches, Placement(CPU, torch.float32), grouped=False).experts
    assert torch.equal(experts.w13, loaded.w13) and torch.equal(experts.w2, loaded.w2)
