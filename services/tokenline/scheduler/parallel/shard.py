"""Which slice of each weight a rank holds, and the layer pieces that combine the slices.

Megatron's split, as vLLM does it: q, k, v, gate and up are column-parallel (each rank holds
some output rows: its attention heads, its part of the MLP), o_proj and down_proj are
row-parallel (each rank holds the matching input columns and produces a partial sum), so one
all-reduce after attention and one after the MLP make every rank's hidden state whole again.
The embedding and the LM head are split by vocabulary rows. With fewer KV heads than ranks
(GQA), each KV head is replicated on the ranks whose query heads read it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenline.scheduler.layers import DecoderLayer
from tokenline.scheduler.parallel.group import TensorParallel

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class ShardPlan:
    """The rank's share of heads, MLP width and vocabulary."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        n = self.world_size
        problems = []
        if self.num_heads % n:
            problems.append(f"{self.num_heads} attention heads")
        if self.num_kv_heads % n and n % self.num_kv_heads:
            problems.append(f"{self.num_kv_heads} KV heads (nor a divisor of the ranks)")
        if self.intermediate_size % n:
            problems.append(f"an MLP {self.intermediate_size} wide")
        if problems:
            raise ValueError(
                f"--tensor-parallel-size {n} does not divide the model's {', '.join(problems)}"
            )

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        # fewer KV heads than ranks: each rank keeps the one KV head its query heads read
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def kv_head_start(self) -> int:
        if self.num_kv_heads >= self.world_size:
            return self.rank * self.local_kv_heads
        ranks_per_kv_head = self.world_size // self.num_kv_heads
        return self.rank // ranks_per_kv_head

    @property
    def local_vocab(self) -> int:
        return -(-self.vocab_size // self.world_size)  # padded up; the pad rows are zeros

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab

    def rows(self, module: str, size: int) -> slice:
        """Rows (output features) of a column-parallel or vocabulary-split weight."""
        if module == "q_proj":
            width = self.local_heads * self.head_dim
            return slice(self.rank * width, (self.rank + 1) * width)
        if module in ("k_proj", "v_proj"):
            start = self.kv_head_start * self.head_dim
            return slice(start, start + self.local_kv_heads * self.head_dim)
        if module in ("gate_proj", "up_proj"):
            width = self.intermediate_size // self.world_size
            return slice(self.rank * width, (self.rank + 1) * width)
        if module in _VOCAB:
            end = self.vocab_start + self.local_vocab
            return slice(min(self.vocab_start, size), min(end, size))
        raise KeyError(module)

    def columns(self, module: str) -> slice:
        """Columns (input features) of a row-parallel weight."""
        if module == "o_proj":
            width = self.local_heads * self.head_dim
        else:
            width = self.intermediate_size // self.world_size
        return slice(self.rank * width, (self.rank + 1) * width)


def plan_for(config, tp: TensorParallel) -> ShardPlan:
    heads = config.num_attention_heads
    return ShardPlan(
        rank=tp.rank,
        world_size=tp.world_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
    )


def sharded_config(config, plan: ShardPlan):
    """The config whose modules have exactly this rank's shard shapes (head_dim kept)."""
    local = copy.deepcopy(config)
    local.num_attention_heads = plan.local_heads
    local.num_key_value_heads = plan.local_kv_heads
    local.head_dim = plan.head_dim
    local.intermediate_size = plan.intermediate_size // plan.world_size
    local.vocab_size = plan.local_vocab
    return local


def slice_of(name: str, plan: ShardPlan, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The index of this rank's part of the checkpoint tensor ``name``; None: all of it."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    if module in _COLUMN or module in _VOCAB:
        return (plan.rows(module, shape[0]),)
    if module in _ROW and kind == "weight":
        return (slice(None), plan.columns(module))
    return None  # norms, row-parallel biases (added once, on rank 0), anything else


class ShardedDecoderLayer(DecoderLayer):
    """A layer whose output projections hold input columns: each rank's product is a partial
    sum, all-reduced before the residual is added (once, not once per rank)."""

    tp: TensorParallel

    def attention_residual(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        return residual + self._row_parallel(attn_out, self.module.self_attn.o_proj)

    def mlp_residual(self, residual: torch.Tensor) -> torch.Tensor:
        x = self.post_attention_norm(residual)
        mlp = self.module.mlp
        gate, up = F.linear(x, *self.gate_up).chunk(2, dim=-1)
        return residual + self._row_parallel(mlp.act_fn(gate) * up, mlp.down_proj)

    def _row_parallel(self, x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
        partial = x @ linear.weight.t()
        if linear.bias is not None and self.tp.is_driver:  # the bias joins the sum once
            partial = partial + linear.bias
        return self.tp.all_reduce(partial)


def shard_layer(layer: DecoderLayer, tp: TensorParallel) -> ShardedDecoderLayer:
    if layer.gate_up is None:
        raise ValueError("tensor parallelism needs a gated MLP (gate_proj, up_proj, down_proj)")
    sharded = ShardedDecoderLayer(**{f: getattr(layer, f) for f in layer.__dataclass_fields__})
    sharded.tp = tp
    return sharded


class VocabParallelEmbedding(torch.nn.Module):
    """The rank's rows of the embedding: tokens outside them look up zeros, and the all-reduce
    sums each token's one non-zero row."""

    def __init__(self, embedding: torch.nn.Embedding, plan: ShardPlan, tp: TensorParallel):
        super().__init__()
        self.weight = embedding.weight
        self.start = plan.vocab_start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden = hidden.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)


class ParallelLMHead(torch.nn.Module):
    """The rank's vocabulary rows of the LM head; the logits of every rank are gathered along
    the vocabulary and the padding rows cut off."""

    def __init__(self, head: torch.nn.Linear, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.head = head
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.head(hidden))[..., : self.vocab_size]
