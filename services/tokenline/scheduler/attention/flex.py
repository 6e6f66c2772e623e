"""The slot for a block-table attention kernel on GPUs: not built yet.

What goes here: one ``AttentionBackend`` whose ``prepare`` turns the step's block tables into
the kernel's paged metadata once per step (for torch's ``flex_attention``, a ``BlockMask``
over the pool's pages, as ``torch/nn/attention/experimental/_paged_attention.py`` builds one;
for FlashInfer, its paged-KV ``plan``), and whose ``forward`` writes the step's K/V into the
pool and attends every row, decode and prefill, in one call, without gathering contexts.
GPU-NOTES.md (shared) has what is known of flex_attention on CPU: it runs eagerly, unfused,
and matches SDPA to about 1e-6 in float32, so a CI test of this backend against ``sdpa`` is
possible before a GPU is lent. Until then, choosing it fails at start.
"""

from __future__ import annotations

import torch

from tokenline.scheduler.attention.base import AttentionBackend, AttentionShape


class FlexAttentionBackend(AttentionBackend):
    name = "flex"

    def __init__(self, shape: AttentionShape, kv_cache: torch.Tensor) -> None:
        raise NotImplementedError(
            "the flex attention backend (flex_attention / FlashInfer over the paged pool) is "
            "a documented slot, not built yet; use 'sdpa' or 'dense-cpu'"
        )

    def prepare(self, step):  # pragma: no cover - never constructed
        raise NotImplementedError

    def forward(self, q, k, v, layer, metadata):  # pragma: no cover - never constructed
        raise NotImplementedError
