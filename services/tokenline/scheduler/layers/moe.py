"""Mixture-of-experts layers: a router picks ``top_k`` experts per token, each expert is a gated
MLP, and a token's output is its experts' outputs weighted by the router.

The router is computed as each family's transformers module computes it: a softmax over the
router logits in float32, the top k, renormalised to sum to one where the family does so
(Mixtral always, Qwen3-MoE with ``norm_topk_prob``), and the weights kept in float32 (Mixtral)
or rounded to the model's dtype (Qwen3-MoE) before they scale the experts' outputs.

A layer's experts are held stacked (``w13``: gate and up, ``[E, 2I, H]``; ``w2``: down,
``[E, H, I]``). A step's (token, expert) pairs are sorted by expert, so each expert runs one
matmul over all of its tokens: on CUDA one grouped GEMM per projection covers every expert
(``torch.nn.functional.grouped_mm``), on CPU a loop over the experts that got tokens. With tensor
parallelism every expert's intermediate dimension is split across ranks (vLLM's default): a rank
computes a partial sum of every expert's output, all-reduced once for the whole layer.
"""

from __future__ import annotations

import re
from collections.abc import Hashable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from tokenline.scheduler.layers.base import Layer
from tokenline.scheduler.layers.linear import Linear, copy_checked, matmul, pack
from tokenline.scheduler.layers.placement import ModelRefused, Placement

# A checkpoint's per-expert weights, as the Hub stores them: Qwen-style names and Mixtral's.
EXPERT_WEIGHT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
# transformers 5 stacks them itself: ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
STACKED_WEIGHT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
MIXTRAL_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}


def grouped_gemm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """One grouped GEMM per projection on CUDA, where torch offers it (its CUDA kernels take
    bf16)."""
    return device.type == "cuda" and dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


class Experts(Layer):
    # the CPU loop's per-expert weights in oneDNN's layout (`pack_weights`), and the fewest rows
    # of an expert that read them
    packed13: list[torch.Tensor] | None = None
    packed2: list[torch.Tensor] | None = None
    packed_from_rows = 1

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        act: str,
        place: Placement,
        grouped: bool | None = None,
    ) -> None:
        super().__init__()
        self.place = place
        self.num_experts = num_experts
        self.local = place.split(intermediate, "experts' intermediate size")
        self.w13 = place.stacked(num_experts, 2 * self.local, hidden)
        self.w2 = place.stacked(num_experts, hidden, self.local)
        self.act_fn = ACT2FN[act].forward  # the function, not a module call
        if grouped is None:
            grouped = grouped_gemm_available(place.device, place.dtype)
        self.grouped = grouped

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """This rank's part of ``sum_k weights[t, k] * expert[experts[t, k]](x[t])``."""
        top_k = experts.shape[1]
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert
        tokens = order // top_k
        # scatter_add, not bincount: bincount's size depends on the values, so on CUDA it
        # would wait for them (and could not be captured in a graph)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        xs = x.index_select(0, tokens)
        if self.grouped:
            offsets = counts.cumsum(0, dtype=torch.int32)
            gate_up = F.grouped_mm(xs, self.w13.transpose(1, 2), offs=offsets)
            gate, up = gate_up.chunk(2, dim=-1)
            ys = F.grouped_mm(self.act_fn(gate) * up, self.w2.transpose(1, 2), offs=offsets)
        else:
            ys = torch.empty_like(xs)
            start, packed13, packed2 = 0, self.packed13, self.packed2
            for expert, n in enumerate(counts.tolist()):
                if n:
                    rows = slice(start, start + n)
                    if packed13 is not None and n >= self.packed_from_rows:
                        w13, w2 = packed13[expert], packed2[expert]
                    else:
                        w13, w2 = self.w13[expert], self.w2[expert]
                    gate, up = matmul(xs[rows], w13).chunk(2, dim=-1)
                    ys[rows] = matmul(self.act_fn(gate) * up, w2)
                    start += n
        ys = (ys * weights.reshape(-1).index_select(0, order).unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, ys)

    def pack_weights(self, keep_plain: bool) -> None:
        """Each expert's projections packed as a dense layer's are (linear.py `Packable`), for
        the CPU loop; the grouped GEMM reads the stacked weights. Past the caches the stacked
        weights go, so the model is held once."""
        if self.grouped:
            return
        self.__dict__["packed13"] = [pack(w) for w in self.w13]
        self.__dict__["packed2"] = [pack(w) for w in self.w2]
        if keep_plain:
            self.__dict__["packed_from_rows"] = 2
        else:
            empty = torch.empty(0, 0, 0, dtype=self.place.dtype, device=self.place.device)
            self.w13 = torch.nn.Parameter(empty, requires_grad=False)
            self.w2 = torch.nn.Parameter(empty.clone(), requires_grad=False)

    # ── loading ──────────────────────────────────────────────────────────────────────────
    def shards(self, param: str) -> set[Hashable]:
        parts = ("gate", "up") if param == "w13" else ("down",)
        return {(e, p) for e in range(self.num_experts) for p in parts}

    def load_weight(self, param: str, shard: Hashable, tensor) -> set[Hashable]:
        """``shard``: (expert, "gate" | "up" | "down") for one expert's projection, or
        (None, "gate_up" | "down") for every expert's, stacked."""
        expert, part = shard
        rank, n = self.place.rank, self.local
        mine = slice(rank * n, (rank + 1) * n)
        if expert is None:  # stacked: [E, 2I, H] or [E, H, I]
            experts = range(self.num_experts)
            if part == "gate_up":
                full = tensor.shape[1] // 2
                up = slice(full + rank * n, full + (rank + 1) * n)
                copy_checked(self.w13[:, :n], tensor[:, mine], "experts.gate_up_proj (gate)")
                copy_checked(self.w13[:, n:], tensor[:, up], "experts.gate_up_proj (up)")
                return {(e, p) for e in experts for p in ("gate", "up")}
            copy_checked(self.w2, tensor[:, :, mine], "experts.down_proj")
            return {(e, "down") for e in experts}
        if not 0 <= expert < self.num_experts:
            raise ModelRefused(f"expert {expert}: the model has {self.num_experts} experts")
        name = f"experts.{expert}.{part}"
        if part == "gate":
            copy_checked(self.w13[expert, :n], tensor[mine], name)
        elif part == "up":
            copy_checked(self.w13[expert, n:], tensor[mine], name)
        else:
            copy_checked(self.w2[expert], tensor[:, mine], name)
        return {shard}


def expert_target(name: str, names: dict[str, str]) -> tuple[str, str, Hashable] | None:
    """(module, parameter, shard) of a checkpoint's expert weight, or None: not an expert's.
    ``names``: the family's projection names (`PROJECTIONS`, `MIXTRAL_PROJECTIONS`)."""
    match = EXPERT_WEIGHT.match(name)
    if match and match["proj"] in names:
        part = names[match["proj"]]
        param = "w2" if part == "down" else "w13"
        return match["experts"], param, (int(match["expert"]), part)
    match = STACKED_WEIGHT.match(name)
    if match:
        stacked = "gate_up" if match["proj"] == "gate_up_proj" else "down"
        return match["experts"], "w13" if stacked == "gate_up" else "w2", (None, stacked)
    return None


class SparseMoE(Layer):
    """Router and experts; checkpoint names ``...mlp.gate.weight`` and ``...mlp.experts.*``."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        act: str,
        place: Placement,
        *,
        renormalize: bool,
        float_weights: bool,
        grouped: bool | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ModelRefused(f"{top_k} experts per token out of {num_experts}")
        self.place = place
        self.top_k = top_k
        self.renormalize = renormalize
        self.float_weights = float_weights
        self.gate = Linear(hidden, num_experts, False, place)
        self.experts = Experts(num_experts, hidden, intermediate, act, place, grouped)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights, ``[T, top_k]`` each."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float_weights:
            weights = weights.to(logits.dtype)
        return experts, weights

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, lora: object = None
    ) -> torch.Tensor:
        experts, weights = self.route(x)
        out = self.place.all_reduce(self.experts(x, experts, weights))
        return out if residual is None else residual + out
