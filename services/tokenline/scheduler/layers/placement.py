"""Where a model's weights live: the device, the dtype, and this rank's share of the model.

Every layer takes one `Placement` and allocates its own share from it, so a model file reads
the same at one rank and at eight (Megatron's and vLLM's parallel layers). A size that the
ranks cannot split evenly is refused here, with the model's name for it, at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenline.scheduler.parallel.group import TensorParallel


class ModelRefused(Exception):
    """The checkpoint cannot be run exactly as its family computes it: say what and why."""


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    tp: TensorParallel | None = None

    @property
    def rank(self) -> int:
        return self.tp.rank if self.tp is not None else 0

    @property
    def world_size(self) -> int:
        return self.tp.world_size if self.tp is not None else 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def column_major(self) -> bool:
        """Float32 projection weights are stored ``[in, out]`` on CPU: MKL multiplies a decode
        step's few rows by that layout faster than by ``[out, in]`` (benchmarks/README.md);
        bfloat16's GEMMs measured the other way. Where oneDNN packs the weights after loading
        (linear.py `pack`), this is only the layout they are loaded into."""
        return self.device.type == "cpu" and self.dtype == torch.float32

    def split(self, size: int, what: str) -> int:
        """This rank's share of ``size``; ``what`` names it in the refusal."""
        if size % self.world_size:
            raise ModelRefused(
                f"--tensor-parallel-size {self.world_size} does not divide the model's {what} "
                f"({size})"
            )
        return size // self.world_size

    def weight(self, out_features: int, in_features: int) -> torch.nn.Parameter:
        """An uninitialised ``[out, in]`` projection weight, column-major where that is
        faster (`column_major`): a transposed view of a contiguous ``[in, out]`` tensor."""
        if self.column_major:
            data = torch.empty(in_features, out_features, dtype=self.dtype, device=self.device).t()
        else:
            data = torch.empty(out_features, in_features, dtype=self.dtype, device=self.device)
        return torch.nn.Parameter(data, requires_grad=False)

    def stacked(self, count: int, out_features: int, in_features: int) -> torch.nn.Parameter:
        """``count`` projection weights ``[count, out, in]`` (a layer's experts), each laid out
        as `weight` lays out one."""
        if self.column_major:
            shape = (count, in_features, out_features)
            data = torch.empty(shape, dtype=self.dtype, device=self.device).transpose(1, 2)
        else:
            shape = (count, out_features, in_features)
            data = torch.empty(shape, dtype=self.dtype, device=self.device)
        return torch.nn.Parameter(data, requires_grad=False)

    def vector(self, size: int, fill: float | None = None) -> torch.nn.Parameter:
        data = torch.empty(size, dtype=self.dtype, device=self.device)
        if fill is not None:
            data.fill_(fill)
        return torch.nn.Parameter(data, requires_grad=False)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``partial`` (itself at one rank)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)
