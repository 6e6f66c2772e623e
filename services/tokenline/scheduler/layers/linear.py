"""Projections that hold this rank's share of their weight and load it from the checkpoint.

- `ColumnLinear`: output features split across ranks; several projections of one input fused
  into one matmul (gate and up), each split on its own so a rank's gate and up rows match.
- `QKVLinear`: q, k and v fused; split by heads, with a KV head held by every rank whose query
  heads read it when there are fewer KV heads than ranks (GQA).
- `RowLinear`: input features split; each rank's product is a partial sum, all-reduced, and the
  bias (when there is one) joins the sum once. Alone, the residual add rides in ``addmm``.
- `Linear`: the whole weight on every rank (an MoE router).

On CPU the projections' weights are repacked after loading (`Packable.pack_weights`) into
oneDNN's blocked layout, which its GEMMs stream at close to memory speed: a decode step reads
every weight once, and the layout decides how fast. A model whose weights fit the caches keeps
its plain weights too, for single rows: there MKL's call costs less than oneDNN's, and oneDNN
wins from a few rows on (benchmarks/README.md, "The forward at real sizes"). A packed weight is
an opaque tensor that only `matmul` multiplies; ``F.linear`` refuses it loudly.

Every layer loads itself: ``load_weight(param, shard, tensor)`` copies its slice of a
checkpoint tensor (``tensor[index]`` reads only those bytes from a safetensors file) and returns
the shards it filled; ``shards(param)`` names every shard it needs, so the loader can tell a
missing weight from a loaded one.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F

from tokenline.scheduler.layers.base import Layer
from tokenline.scheduler.layers.placement import ModelRefused, Placement

WHOLE: Hashable = None  # the shard key of a parameter loaded in one piece


# Weights past this no longer fit a CPU's last-level cache (benchmarks/README.md, "The forward
# at real sizes"): a decode step streams them from memory.
CACHE_SIZED_WEIGHTS = 64 << 20


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weightᵀ + bias``, by oneDNN when the weight is packed (`pack`)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack(weight: torch.Tensor) -> torch.nn.Parameter:
    """An ``[out, in]`` weight in oneDNN's layout for its matmul (CPU only)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    return torch.nn.Parameter(packed, requires_grad=False)


class Packable:
    """A layer whose ``weight`` oneDNN can multiply packed. `weight_for` picks the copy a
    matmul of ``x`` reads."""

    packed: torch.Tensor | None = None  # a packed copy beside the plain weight
    packed_from_rows = 1  # the fewest rows of ``x`` that read ``packed``

    def pack_weights(self, keep_plain: bool) -> None:
        """Pack ``weight``; ``keep_plain``: keep it too, for single rows."""
        if keep_plain:
            self.__dict__["packed"] = pack(self.weight)
            self.__dict__["packed_from_rows"] = 2
        else:
            self.weight = pack(self.weight)

    def weight_for(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is None or x.shape[0] < self.packed_from_rows:
            return self.weight
        return packed


def packs_weights(place: Placement) -> bool:
    """Whether `pack` applies: oneDNN's GEMMs on a CPU, in a dtype it packs."""
    return (
        place.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and place.dtype in (torch.float32, torch.bfloat16)
    )


def copy_checked(target: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(source.shape) != tuple(target.shape):
        raise ModelRefused(
            f"{name}: the checkpoint's shape {tuple(source.shape)} does not fit the model's "
            f"{tuple(target.shape)}"
        )
    target.copy_(source)


class Linear(Layer):
    """The whole ``[out, in]`` weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, place: Placement) -> None:
        super().__init__()
        self.weight = place.weight(out_features, in_features)
        self.bias = place.vector(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def shards(self, param: str) -> set[Hashable]:
        return {WHOLE}

    def load_weight(self, param: str, shard: Hashable, tensor) -> set[Hashable]:
        copy_checked(getattr(self, param), tensor[:], param)
        return {WHOLE}


class ColumnLinear(Packable, Layer):
    """Output features split across ranks; ``parts`` are the full sizes of the projections
    fused in this one (their shard keys are their indexes)."""

    def __init__(
        self, in_features: int, parts: list[int], bias: bool, place: Placement, what: str
    ) -> None:
        super().__init__()
        self.place = place
        self.local = [place.split(size, what) for size in parts]
        self.offsets = [sum(self.local[:i]) for i in range(len(parts))]
        self.weight = place.weight(sum(self.local), in_features)
        self.bias = place.vector(sum(self.local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight_for(x), self.bias)

    def shards(self, param: str) -> set[Hashable]:
        return set(range(len(self.local)))

    def rows(self, part: int) -> slice:
        """This rank's rows of part ``part`` of the checkpoint."""
        n = self.local[part]
        return slice(self.place.rank * n, (self.place.rank + 1) * n)

    def load_weight(self, param: str, shard: Hashable, tensor) -> set[Hashable]:
        part = int(shard or 0)
        target = getattr(self, param)[self.offsets[part] : self.offsets[part] + self.local[part]]
        copy_checked(target, tensor[self.rows(part)], f"{param} part {part}")
        return {part}


class QKVLinear(ColumnLinear):
    """q, k and v of one input as one matmul; shards ``"q"``, ``"k"``, ``"v"``."""

    PARTS = ("q", "k", "v")

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        place: Placement,
    ) -> None:
        ranks = place.world_size
        place.split(num_heads, "attention heads")
        if num_kv_heads % ranks and ranks % num_kv_heads:
            raise ModelRefused(
                f"--tensor-parallel-size {ranks} does not divide the model's {num_kv_heads} KV "
                "heads, nor do they divide it"
            )
        local_kv_heads = max(1, num_kv_heads // ranks)
        kv_width = local_kv_heads * head_dim * ranks  # the split gives back one rank's share
        super().__init__(hidden, [num_heads * head_dim, kv_width, kv_width], bias, place, "heads")
        self.num_heads = num_heads // ranks
        # fewer KV heads than ranks: each rank keeps the one KV head its query heads read
        self.num_kv_heads = local_kv_heads
        self.total_kv_heads = num_kv_heads  # the model's, replicated when fewer than ranks
        self.head_dim = head_dim
        if num_kv_heads >= ranks:
            self.kv_start = place.rank * local_kv_heads
        else:
            self.kv_start = place.rank // (ranks // num_kv_heads)

    def shards(self, param: str) -> set[Hashable]:
        return set(self.PARTS)

    def rows(self, part: int) -> slice:
        if part == 0:
            return super().rows(0)
        start = self.kv_start * self.head_dim
        return slice(start, start + self.num_kv_heads * self.head_dim)

    def load_weight(self, param: str, shard: Hashable, tensor) -> set[Hashable]:
        super().load_weight(param, self.PARTS.index(shard), tensor)
        return {shard}


class RowLinear(Packable, Layer):
    """Input features split across ranks: a partial sum per rank, all-reduced."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, place: Placement, what: str
    ) -> None:
        super().__init__()
        self.place = place
        self.local_in = place.split(in_features, what)
        self.weight = place.weight(out_features, self.local_in)
        self.bias = place.vector(out_features) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual + x @ weightᵀ + bias`` (without the residual when None)."""
        weight = self.weight_for(x)
        if self.place.tp is None:
            # one kernel, eagerly; traced (layers/compiled.py), a linear and an add, which
            # inductor packs for oneDNN and fuses
            if residual is not None and self.bias is None and not torch.compiler.is_compiling():
                if weight.is_mkldnn:
                    return torch.ops.mkldnn._linear_pointwise.binary(
                        x, residual, weight, None, "add"
                    )
                return torch.addmm(residual, x, weight.t())
            out = matmul(x, weight, self.bias)
            return out if residual is None else residual + out
        partial = matmul(x, weight)
        if self.bias is not None and self.place.is_driver:  # the bias joins the sum once
            partial = partial + self.bias
        out = self.place.all_reduce(partial)
        return out if residual is None else residual + out

    def shards(self, param: str) -> set[Hashable]:
        return {WHOLE}

    def load_weight(self, param: str, shard: Hashable, tensor) -> set[Hashable]:
        if param == "bias":
            copy_checked(self.bias, tensor[:], param)
        else:
            start = self.place.rank * self.local_in
            copy_checked(self.weight, tensor[:, start : start + self.local_in], param)
        return {WHOLE}
