"""The attention interface: what the runner's layer loop calls, and what a kernel implements.

Two levels, as in mini-sglang's ``BaseAttnBackend`` and its hybrid of a prefill and a decode
backend:

- an ``AttentionBackend`` serves a whole step: ``prepare(step)`` once per step, before the
  layer loop, turns the step's chunks into the metadata its kernels read (gathers, masks,
  plans); ``forward(q, k, v, layer, metadata)`` once per layer writes the step's new keys and
  values into the KV pool and returns the attention output of every token row. The runner
  holds exactly one, chosen at start (``attention.choose``).
- an ``AttentionPath`` serves one kind of row in a step (decode tokens, chunks that start a
  prompt, chunks that continue one) with the same two calls; a backend is the paths it
  routes a step's rows to. Paths take the step's new K/V packed, ``[T, 2 * kv_heads, D]``
  with the keys first, as the pool stores them: the backend packs them once per layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tokenline.scheduler.step_inputs import StepBatch


@dataclass(frozen=True)
class AttentionShape:
    """What every backend of one model needs to know, fixed at start."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    block_size: int  # tokens per KV pool block
    window: int | None  # the model's sliding window, if any of its layers slide
    compile: bool = False  # compile the kernels (--compile); the flex backend always does on CUDA
    max_blocks_per_seq: int = 0  # the most blocks one sequence holds (0: the whole pool)
    max_num_seqs: int = 256  # the most sequences one step runs


@dataclass(frozen=True)
class AttentionLayer:
    """One decoder layer as attention sees it."""

    index: int  # its slice of the KV pool (and of any backend's own buffers)
    scale: float | None  # softmax scale; None: SDPA's 1/sqrt(head_dim)
    slides: bool  # attends only to the model's sliding window


class AttentionPath(ABC):
    """One kind of token row in a step and the kernel that attends for it."""

    def __init__(self, shape: AttentionShape, kv_cache: torch.Tensor) -> None:
        self.shape = shape
        # [layers, slots, 2 * kv_heads, D]: keys and values of a slot side by side
        self.kv_cache = kv_cache

    @abstractmethod
    def prepare(self, step: StepBatch) -> object | None:
        """This path's metadata for the step; None when the step has no row of its kind.
        The metadata has ``rows``: the token rows it covers, in the order `forward` returns
        them, or None for every row of the step in order."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, layer: AttentionLayer, metadata
    ) -> torch.Tensor:
        """Attention of this path's rows, ``[rows, heads, D]``. ``q``: the step's queries
        ``[T, heads, D]``; ``kv``: the step's new K/V, packed, already in the pool."""

    def release(self) -> None:
        """The engine went idle: give back memory held between steps."""
        return None


class AttentionBackend(ABC):
    """A step's attention, chosen once at start: what the runner's layer loop calls."""

    #: the name ``attention.choose`` knows it by
    name: str = ""

    def __init__(self, shape: AttentionShape, kv_cache: torch.Tensor) -> None:
        self.shape = shape
        self.kv_cache = kv_cache

    @abstractmethod
    def prepare(self, step: StepBatch):
        """Metadata for every layer of this step, built once before the layer loop."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        metadata,
    ) -> torch.Tensor:
        """Store the step's new ``k``, ``v`` (``[T, kv_heads, D]``) in the pool and attend:
        ``q`` ``[T, heads, D]`` in, ``[T, heads * D]`` out (the output projection is the
        caller's)."""

    def release(self) -> None:
        """The engine went idle: give back memory held between steps."""
        return None
